import os

from hypothesis import HealthCheck, settings

# No test reaches a model hub (these machines have none): say so before any test module imports
# huggingface_hub / datasets, which read the flag once at import; with it unset, a hub name
# waits on network retries (20-45 s a test) before it fails.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Deterministic by default: the same examples on every run and machine.
settings.register_profile(
    "default",
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# More examples, random seeds: `HYPOTHESIS_PROFILE=thorough pytest`.
settings.register_profile("thorough", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

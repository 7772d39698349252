import os

from hypothesis import HealthCheck, settings

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

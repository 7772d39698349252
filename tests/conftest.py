import os

import pytest
from hypothesis import HealthCheck, settings

# No test reaches a model hub (these machines have none): say so before any test module imports
# huggingface_hub / datasets, which read the flag once at import; with it unset, a hub name
# waits on network retries (20-45 s a test) before it fails.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Every Ray session the tests start runs its workers at nice 0 (as trainers.ray.init_ray does),
# not Ray's default 15: under a background CPU load a nice-15 actor gets a few percent of a core
# (the CFS weight of nice 15 is 36 against 1,024 at nice 0), and the tests' deadlines measure that.
os.environ.setdefault("RAY_worker_niceness", "0")

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


# The launcher variables that in-process engines set for the whole process (DeepSpeed's
# LOCAL_RANK on CPU, the torch.distributed tests' MASTER_ADDR / MASTER_PORT): restored after each
# test module, so that a module never sees another's. Under pytest-xdist a worker runs modules in
# any order: accelerate (TRL's GRPOTrainer in the side-by-side benchmark) read a leaked LOCAL_RANK
# as a launcher's and waited for a MASTER_ADDR.
_LAUNCHER_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True, scope="module")
def _launcher_env_per_module():
    before = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v

import os

import pytest
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


# --------------------------------------------------------------------------- one Ray for the session


@pytest.fixture(scope="session")
def ray_cluster():
    """The test session's one Ray instance, started by the first test that asks for it and
    stopped at the end of the session: two nodes on this machine (a head node with the custom
    resource ``rollout_node``, a second node with ``train_node``, so placement across nodes is
    tested), 2 logical CPUs and a 100 MB object store each, no dashboard. Tests get the driver's
    connection through :func:`ray_session`; a test that needs Ray *not* running disconnects the
    driver (``ray.shutdown()``) and reconnects it (``ray.init(address=ray_cluster.address)``)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        ray.shutdown()  # a test's own session: the shared one replaces it
    node = {"num_cpus": 2, "object_store_memory": 100 * 2**20, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "resources": {"rollout_node": 1}})
    cluster.add_node(**node, resources={"train_node": 1})
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """The ``ray`` module, its driver connected to :func:`ray_cluster`."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_cluster.address, log_to_driver=False)
    return ray

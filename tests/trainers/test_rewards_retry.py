"""A reward worker killed mid-sample: the sample is scored again on a live worker (bounded by
``max_retries``), and the crashes and retries are counted, on worker processes and Ray actors.

The verifier :class:`DieOnce` kills its own worker process (``os._exit``) the first time it
sees a sample, marked by a file in a directory of the test, and scores the sample 1.0 the next
time: without a retry the correct sample would be trained as wrong (0.0).
"""

import os
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from trainers.data import Prompt
from trainers.rewards import RewardPool, exact_match

Q = Prompt("12+34=", "46", "addition")


class DieOnce:
    """``die-once:NAME``: the first call kills the calling process (NAME's marker file does not
    exist yet: create it, then ``os._exit``), later calls return 1.0. ``die-always`` kills it
    every time; ``sleep:S`` sleeps S seconds and returns 1.0; anything else is ``exact_match``."""

    def __init__(self, marker_dir: Path) -> None:
        self.marker_dir = str(marker_dir)

    def __call__(self, completion: str, prompt: Prompt) -> float:
        if completion.startswith("die-once:"):
            marker = Path(self.marker_dir) / completion.split(":", 1)[1]
            if not marker.exists():
                marker.touch()
                os._exit(7)
            return 1.0
        if completion == "die-always":
            os._exit(7)
        if completion.startswith("sleep:"):
            time.sleep(float(completion.split(":", 1)[1]))
            return 1.0
        return exact_match(completion, prompt)


def counts(pool):
    m = pool.metrics()
    return {k: int(m[k]) for k in ("scored", "crashes", "retries", "crash_failures", "timeouts", "restarts")}


def retry_scenario(pool, marker_dir, *, max_retries):
    # 1. killed once, right the second time: 1.0, one crash, one retry
    pool.submit("once", "die-once:once", Q)
    pool.submit("right", "46", Q)
    assert pool.gather() == {"once": 1.0, "right": 1.0}
    assert (marker_dir / "once").exists()
    c = counts(pool)
    assert (c["scored"], c["crashes"], c["retries"], c["crash_failures"], c["restarts"]) == (2, 1, 1, 0, 1)
    assert any("retrying on a fresh worker" in e for e in pool.recent_errors)
    # 2. a sample that kills every worker it reaches: 0.0 after 1 + max_retries attempts, counted
    pool.submit("always", "die-always", Q)
    pool.submit("after", "46", Q)
    assert pool.gather() == {"always": 0.0, "after": 1.0}
    c = counts(pool)
    assert c["crashes"] == 1 + (1 + max_retries) and c["retries"] == 1 + max_retries
    assert c["crash_failures"] == 1 and c["scored"] == 4
    assert any(f"({1 + max_retries} attempts)" in e for e in pool.recent_errors)
    # 3. a timeout is not retried: it would time out again
    pool.submit("slow", f"sleep:{pool.timeout_s * 20}", Q)
    assert pool.gather() == {"slow": 0.0}
    c2 = counts(pool)
    assert c2["timeouts"] == 1 and c2["retries"] == c["retries"] and c2["crashes"] == c["crashes"]
    # the replacements still work
    pool.submit("last", "46", Q)
    assert pool.gather() == {"last": 1.0}


@pytest.mark.slow
def test_process_pool_retries_a_killed_sample(tmp_path):
    with RewardPool(DieOnce(tmp_path), backend="process", num_workers=1, timeout_s=1.0) as pool:
        assert pool.max_retries == 1  # the default
        retry_scenario(pool, tmp_path, max_retries=1)


@pytest.mark.slow
def test_process_pool_without_retries_scores_a_killed_sample_zero(tmp_path):
    with RewardPool(DieOnce(tmp_path), backend="process", num_workers=1, timeout_s=5, max_retries=0) as pool:
        pool.submit("once", "die-once:once", Q)
        assert pool.gather() == {"once": 0.0}
        c = counts(pool)
        assert (c["crashes"], c["retries"], c["crash_failures"]) == (1, 0, 1)


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    if ray.is_initialized():
        pytest.skip("a Ray session is running")
    this = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(this)  # Ray workers need not find the test module
    ray.init(address="local", num_cpus=2, object_store_memory=80 * 1024**2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
    cloudpickle.unregister_pickle_by_value(this)


@pytest.mark.slow
def test_ray_pool_retries_a_killed_sample(ray_session, tmp_path):
    # 10 s: Ray reports an actor's death late on a loaded machine (with Ray's default worker nice 15, a
    # dying one took over 2 s under two busy processes); a crash told after the deadline would
    # count as a timeout, which is never retried
    with RewardPool(DieOnce(tmp_path), backend="ray", num_workers=1, timeout_s=10.0, max_retries=2) as pool:
        retry_scenario(pool, tmp_path, max_retries=2)

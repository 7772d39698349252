"""Verifiers (exact match, real Math-Verify) and RewardPool backends (inline, process, Ray).

The pool tests score real samples with real worker processes / Ray actors; the verifier
doubles in ``_reward_doubles`` script each failure mode (raise, sleep past the timeout,
``os._exit``). Multi-process tests are ``slow``.
"""

import os
import signal
import threading
import time

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import _reward_doubles as doubles

from rollkit.registry import UnknownNameError
from trainers.data import Prompt
from trainers.rewards import (
    VERIFIERS,
    CodeVerifier,
    JudgeReward,
    MathVerifier,
    RewardPool,
    exact_match,
    exact_match_reward,
    get_verifier,
    parse_number,
    register_verifier,
)

Q = Prompt("12+34=", "46", "addition")

#: the cap of every wait for an event below (a worker replaced, a pool grown or shrunk, a file
#: written): it only bounds a hang, a loaded machine is never this slow
CAP_S = 120.0


def wait_until(cond, cap=CAP_S):
    """Poll ``cond()`` until it is truthy or ``cap`` seconds passed; returns its last value."""
    end = time.monotonic() + cap
    while not (value := cond()) and time.monotonic() < end:
        time.sleep(0.02)
    return value


# --------------------------------------------------------------------------- verifiers


def test_get_verifier():
    assert get_verifier("exact_match") is exact_match
    assert isinstance(get_verifier("math_verify"), MathVerifier)
    assert get_verifier(doubles.scripted) is doubles.scripted
    assert set(VERIFIERS) == {
        "exact_match",
        "math_verify",
        "llm_judge",
        "code",
        "reward_model",
        "ifeval",
        "multiple_choice",
    }
    with pytest.raises(
        UnknownNameError, match=r"verifier: unknown name 'nope'; known: code, exact_match, ifeval, llm_judge"
    ):
        get_verifier("nope")
    with pytest.raises(TypeError, match="verifier must be a name"):
        get_verifier(3)
    # every name is a factory: options build a new verifier; a callable takes none
    judge = get_verifier("llm_judge", judge_model="tiny", max_tokens=5)
    assert isinstance(judge, JudgeReward) and judge.model == "tiny" and judge.max_tokens == 5
    assert judge is not get_verifier("llm_judge")
    assert get_verifier("math_verify", timeout_s=2).timeout_s == 2
    code = get_verifier("code", mode="fraction", timeout_s=3.0, memory_mb=128, isolation="rlimit")
    assert isinstance(code, CodeVerifier) and code.mode == "fraction" and code.sandbox["memory_mb"] == 128
    with pytest.raises(
        TypeError, match=r"verifier 'exact_match': unknown options \['judge_model'\]; it takes no options"
    ):
        get_verifier("exact_match", judge_model="tiny")
    with pytest.raises(
        TypeError, match=r"verifier 'math_verify': unknown options \['mode'\]; it takes \['timeout_s'\]"
    ):
        get_verifier("math_verify", mode="all")
    with pytest.raises(TypeError, match=r"sandbox options: unknown \['memroy_mb'\]"):
        get_verifier("code", memroy_mb=128)
    with pytest.raises(ValueError, match="memory_mb must be a positive finite number"):
        get_verifier("code", memory_mb=0)
    with pytest.raises(TypeError, match="options are for verifiers chosen by name"):
        get_verifier(doubles.scripted, max_tokens=3)


def test_register_verifier():
    def always(value: float = 1.0):
        return lambda completion, prompt: value

    register_verifier("always", always)
    try:
        assert get_verifier("always", value=0.5)("x", Q) == 0.5
        with pytest.raises(ValueError, match="'always' is already registered"):
            register_verifier("always", always)
        register_verifier("always", lambda: exact_match, overwrite=True)
        assert get_verifier("always") is exact_match
    finally:
        del VERIFIERS["always"]
    with pytest.raises(TypeError, match="factory must be callable"):
        register_verifier("x", 3)


def test_exact_match():
    assert exact_match_reward("46", "46") == 1.0
    assert exact_match_reward("12 + 34 = 46.", "46") == 1.0
    assert exact_match_reward("1,046", "1046") == 1.0
    assert exact_match_reward("45", "46") == 0.0 and exact_match_reward("no idea", "46") == 0.0
    assert parse_number("a -3 b 4.5") == "4.5" and parse_number("x") is None
    assert exact_match("12+34=46", Q) == 1.0
    assert exact_match("the sum is 46.0", Q) == 1.0
    assert exact_match("45", Q) == 0.0
    assert exact_match("", Q) == 0.0


math_verify = pytest.importorskip("math_verify")

MATH_CASES = [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # a LaTeX gold answer
    ("x=3", "3", 1.0),
    ("12+34=46", "46", 1.0),
    ("The answer is $\\sqrt{4}$", "2", 1.0),
    ("\\boxed{7}", "3", 0.0),
    ("I think it is 45", "46", 0.0),
    ("%%## garbage ]]{", "3", 0.0),
    ("", "3", 0.0),
]


@pytest.mark.parametrize(("completion", "answer", "reward"), MATH_CASES)
def test_math_verify_real_strings(completion, answer, reward):
    assert MathVerifier()(completion, Prompt("q", answer)) == reward


def test_math_verify_outside_workers_disables_its_alarms():
    """Outside a pool worker Math-Verify runs without signal.alarm: no SIGALRM handler is
    installed in the caller, and it works in a non-main thread (where alarms would fail)."""
    before = signal.getsignal(signal.SIGALRM)
    assert MathVerifier()("\\boxed{\\frac{1}{2}}", Prompt("q", "0.5")) == 1.0
    assert signal.getsignal(signal.SIGALRM) is before
    out = []
    t = threading.Thread(target=lambda: out.append(MathVerifier()("x=3", Prompt("q", "3"))))
    t.start()
    t.join()
    assert out == [1.0]


def test_math_verify_bad_gold_and_arguments():
    with pytest.raises(ValueError, match="cannot parse the answer"):
        MathVerifier()("3", Prompt("q", " "))
    with pytest.raises(ValueError, match="timeout_s"):
        MathVerifier(timeout_s=0)


# --------------------------------------------------------------------------- inline pool


def test_inline_pool_keys_errors_and_metrics():
    # 0.25 s: far more than a fast sample takes, even on a loaded machine (a pause of the
    # interpreter included); the slow one takes twice that
    with RewardPool(doubles.scripted, backend="inline", timeout_s=0.25) as pool:
        pool.submit(("p0", 0), "46", Q)
        pool.submit(("p0", 1), "45", Q)
        pool.submit("boom", "raise", Q)
        pool.submit("nan", "nan", Q)
        pool.submit("slow", "sleep:0.5:1", Q)  # cannot be interrupted inline: 0.0 afterwards
        pool.submit("main", "main-thread?", Q)
        with pytest.raises(ValueError, match=r"key 'boom' was already submitted"):
            pool.submit("boom", "46", Q)
        assert pool.gather() == {
            ("p0", 0): 1.0,
            ("p0", 1): 0.0,
            "boom": 0.0,
            "nan": 0.0,
            "slow": 0.0,
            "main": 1.0,
        }
        m = pool.metrics()
        assert (m["scored"], m["errors"], m["timeouts"], m["crashes"]) == (6, 2, 1, 0)
        assert m["busy_s"] >= 0.5 and m["pending"] == 0 and m["queue_hwm"] == 1
        assert (m["workers"], m["workers_hwm"], m["scale_ups"], m["scale_downs"]) == (0, 0, 0, 0)
        assert (m["retries"], m["crash_failures"], m["restarts"]) == (0, 0, 0)
        assert any("RuntimeError: verifier failed on purpose" in e for e in pool.recent_errors)
        # a new round: keys may be reused, gather of an empty round is empty
        assert pool.gather() == {}
        pool.submit("boom", "46", Q)
        assert pool.gather() == {"boom": 1.0}
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("x", "1", Q)


def test_pool_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        RewardPool("exact_match", backend="threads")
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool("exact_match", backend="process", num_workers=0)
    for bad in (1, 2.5, True, "4"):
        with pytest.raises(
            ValueError, match=r"max_workers must be None \(a fixed pool\) or an int >= num_workers"
        ):
            RewardPool("exact_match", backend="process", num_workers=2, max_workers=bad)
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ValueError, match="idle_s must be a number > 0"):
            RewardPool("exact_match", backend="process", num_workers=1, max_workers=2, idle_s=bad)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool("exact_match", timeout_s=0)
    with pytest.raises(ValueError, match="start_method"):
        RewardPool("exact_match", backend="process", start_method="fork")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_retries must be an int >= 0"):
            RewardPool("exact_match", max_retries=bad)
    with pytest.raises(ValueError, match="ray_num_cpus must be a number >= 0"):
        RewardPool("exact_match", ray_num_cpus=-1)
    with pytest.raises(TypeError, match="picklable"):
        RewardPool(lambda c, p: 1.0, backend="process")
    with RewardPool("exact_match") as pool, pytest.raises(TypeError, match="completion must be a str"):
        pool.submit(0, [1, 2], Q)


# --------------------------------------------------------------------------- process / ray pools


def run_failure_scenario(pool):
    """Out-of-order completion, a raise, a timeout and a sample that kills its worker on every
    attempt (retried once, then 0.0) in one round, then a clean round on the replaced workers.
    Returns the metrics. The pool's ``timeout_s`` must leave the 0.3 s samples a wide margin
    (a loaded machine adds latency to every one)."""
    # sample k sleeps (6 - k) * 50 ms and returns k: later submissions finish first
    for k in range(6):
        pool.submit(("ordered", k), f"sleep:{(6 - k) * 0.05}:{k}", Q)
    pool.submit("raise", "raise", Q)
    pool.submit("hang", "sleep:3600:1", Q)
    pool.submit("exit", "exit", Q)
    pool.submit("right", "46", Q)
    pool.submit("main", "main-thread?", Q)
    t0 = time.perf_counter()
    got = pool.gather()
    # the hang was cut short: in far less than its hour (the bound leaves room for three
    # replacement workers to start on a loaded machine: each imports torch; on Ray under two
    # busy processes the round took 273 s)
    assert time.perf_counter() - t0 < 1800
    assert got == {
        **{("ordered", k): float(k) for k in range(6)},
        "raise": 0.0,
        "hang": 0.0,
        "exit": 0.0,
        "right": 1.0,
        "main": 1.0,  # workers score on their main thread
    }
    m = pool.metrics()
    assert (m["scored"], m["errors"], m["timeouts"], m["crashes"]) == (11, 1, 1, 2)
    assert (m["retries"], m["crash_failures"]) == (1, 1)  # the timeout was not retried
    assert m["restarts"] == 3 and m["queue_hwm"] == 11 and m["pending"] == 0
    # a fixed-size pool: replacements are restarts, never scaling
    assert m["workers"] == m["workers_hwm"] == pool.num_workers and m["scale_ups"] == m["scale_downs"] == 0
    # the replacements work
    for k in range(8):
        pool.submit(k, "46" if k % 2 else "45", Q)
    assert pool.gather() == {k: float(k % 2) for k in range(8)}
    assert pool.metrics()["scored"] == 19
    return m


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_process_pool_failures(start_method):
    with RewardPool(
        doubles.scripted, backend="process", num_workers=2, timeout_s=1.0, start_method=start_method
    ) as pool:
        pids = pool.worker_pids()
        run_failure_scenario(pool)
        assert len(set(pool.worker_pids()) - set(pids)) == 2  # the hung and the dead worker


@pytest.mark.slow
def test_process_pool_worker_killed_from_outside(tmp_path):
    flag = tmp_path / "started"
    # max_retries=0: the killed sample scores 0.0 (with retries it would be scored again)
    with RewardPool(doubles.scripted, backend="process", num_workers=1, timeout_s=30, max_retries=0) as pool:
        pool.submit("a", f"started:{flag}", Q)
        assert wait_until(flag.exists), "the worker never started scoring"
        os.kill(pool.worker_pids()[0], signal.SIGKILL)
        pool.submit("b", "46", Q)
        assert pool.gather() == {"a": 0.0, "b": 1.0}
        m = pool.metrics()
        assert (m["crashes"], m["restarts"], m["timeouts"], m["retries"], m["crash_failures"]) == (
            1,
            1,
            0,
            0,
            1,
        )
        assert any("died" in e for e in pool.recent_errors)


@pytest.mark.slow
def test_process_pool_setup_failure_raises():
    with RewardPool(doubles.FailingSetup(), backend="process", num_workers=1, timeout_s=5) as pool:
        pool.submit("a", "x", Q)
        with pytest.raises(RuntimeError, match="cannot load the reward model"):
            pool.gather()


@pytest.mark.slow
def test_math_verify_in_workers():
    """Real Math-Verify in worker processes: correct rewards; ``9^{9^{9^{9}}}`` (sympy would
    run for ever) is stopped by the pool's timeout when Math-Verify's own alarm is longer,
    and by Math-Verify's alarm (which needs the worker's main thread) when it is shorter."""
    cases = [(c, a, r) for c, a, r in MATH_CASES]
    with RewardPool(MathVerifier(timeout_s=60), backend="process", num_workers=2, timeout_s=3) as pool:
        for k, (c, a, _) in enumerate(cases):
            pool.submit(k, c, Prompt("q", a))
        pool.submit("hang", "\\boxed{9^{9^{9^{9}}}}", Prompt("q", "3"))
        got = pool.gather()
        assert got == {**{k: r for k, (_, _, r) in enumerate(cases)}, "hang": 0.0}
        assert pool.metrics()["timeouts"] == 1
    with RewardPool(MathVerifier(timeout_s=1), backend="process", num_workers=1, timeout_s=30) as pool:
        pool.submit("hang", "\\boxed{9^{9^{9^{9}}}}", Prompt("q", "3"))
        pool.submit("ok", "\\boxed{3}", Prompt("q", "3"))
        assert pool.gather() == {"hang": 0.0, "ok": 1.0}
        assert pool.metrics()["timeouts"] == 0  # Math-Verify's 1 s alarm ended it, not the pool's 30 s


def test_ray_backend_needs_ray_init():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session is running")
    with pytest.raises(RuntimeError, match=r"ray.init\(\)"):
        RewardPool("exact_match", backend="ray")


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    from ray import cloudpickle  # Ray's own (vendored) cloudpickle serialises task arguments

    cloudpickle.register_pickle_by_value(doubles)  # Ray workers need not find the test module
    ray.init(address="local", num_cpus=2, object_store_memory=80 * 1024**2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
    cloudpickle.unregister_pickle_by_value(doubles)


@pytest.mark.slow
def test_ray_pool_failures(ray_session):
    # 10 s: Ray reports an actor's death late on a loaded machine (with Ray's default worker nice 15, a
    # dying one took over 2 s under two busy processes, and the crash counted as a timeout)
    with RewardPool(doubles.scripted, backend="ray", num_workers=2, timeout_s=10.0) as pool:
        run_failure_scenario(pool)


@pytest.mark.slow
def test_ray_pool_math_verify_alarm_works_in_actors(ray_session):
    with RewardPool(MathVerifier(timeout_s=1), backend="ray", num_workers=1, timeout_s=30) as pool:
        pool.submit("hang", "\\boxed{9^{9^{9^{9}}}}", Prompt("q", "3"))
        pool.submit("ok", "x=3", Prompt("q", "3"))
        assert pool.gather() == {"hang": 0.0, "ok": 1.0}
        assert pool.metrics()["timeouts"] == 0 and pool.metrics()["errors"] == 0


@pytest.mark.slow
def test_process_pool_poll_returns_scores_as_they_arrive(tmp_path):
    release = tmp_path / "release"
    with RewardPool(doubles.scripted, backend="process", num_workers=1, timeout_s=60) as pool:
        assert pool.poll() == {}
        pool.submit("fast", "46", Q)
        pool.submit("slow", f"wait:{release}:1", Q)  # scored once the test releases it
        got: dict = {}
        assert wait_until(lambda: got.update(pool.poll()) or "fast" in got)
        assert got == {"fast": 1.0}  # the slow one is still being scored
        pool.submit("fast", "45", Q)  # a polled key may be submitted again
        release.touch()
        assert pool.gather() == {"slow": 1.0, "fast": 0.0}
        assert pool.poll() == {}


def test_inline_pool_poll():
    with RewardPool("exact_match") as pool:
        pool.submit(0, "46", Q)
        pool.submit(1, "4", Q)
        assert pool.poll() == {0: 1.0, 1: 0.0}
        assert pool.poll() == {} and pool.gather() == {}


# --------------------------------------------------------------------------- queue-driven sizing


def run_scaling_scenario(pool, *, burst, sleep_s):
    """A burst of slow samples grows the pool from ``num_workers`` to ``max_workers``; once it
    has been idle for ``idle_s`` it shrinks back; the shrunk pool still scores. Returns the
    metrics at the end."""
    lo, hi = pool.num_workers, pool.max_workers
    assert pool.metrics()["workers"] == lo
    for k in range(burst):
        pool.submit(k, f"sleep:{sleep_s}:{k}", Q)
    assert pool.gather() == {k: float(k) for k in range(burst)}
    m = pool.metrics()
    assert m["workers_hwm"] == hi and m["scale_ups"] == hi - lo  # grew to the cap, not beyond
    wait_until(lambda: pool.metrics()["workers"] <= lo)  # idle for idle_s: shrunk
    m = pool.metrics()
    assert m["workers"] == lo and m["scale_downs"] == hi - lo and m["workers_hwm"] == hi
    assert m["restarts"] == 0 and m["crashes"] == 0 and m["timeouts"] == 0
    pool.submit("after", "46", Q)  # the survivor still works, and a trickle does not grow the pool
    assert pool.gather() == {"after": 1.0}
    m = pool.metrics()
    assert m["scale_ups"] == hi - lo and m["workers"] == lo
    return m


@pytest.mark.slow
def test_process_pool_grows_with_its_queue_and_shrinks_when_idle():
    with RewardPool(
        doubles.scripted, backend="process", num_workers=1, max_workers=3, idle_s=0.3, timeout_s=30
    ) as pool:
        run_scaling_scenario(pool, burst=6, sleep_s=0.5)
        survivor = pool.worker_pids()
        assert len(survivor) == 1
        # a second burst grows it again, by new processes
        for k in range(4):
            pool.submit(k, f"sleep:0.5:{k}", Q)
        assert wait_until(lambda: pool.metrics()["workers"] >= 3)
        assert len(set(pool.worker_pids()) - set(survivor)) == 2  # two new processes
        assert pool.gather() == {k: float(k) for k in range(4)}
        assert pool.metrics()["scale_ups"] == 4


@pytest.mark.slow
def test_process_pool_scaled_workers_fail_like_fixed_ones():
    """A hung and a dying sample on scaled-up workers: replaced (restarts), the dying one
    retried once, never lost."""
    with RewardPool(
        doubles.scripted, backend="process", num_workers=1, max_workers=2, idle_s=0.2, timeout_s=1.0
    ) as pool:
        pool.submit("hang", "sleep:30:1", Q)
        pool.submit("exit", "exit", Q)
        pool.submit("ok", "46", Q)
        assert pool.gather() == {"hang": 0.0, "exit": 0.0, "ok": 1.0}
        m = pool.metrics()
        assert (m["timeouts"], m["crashes"], m["retries"], m["restarts"]) == (1, 2, 1, 3) and m[
            "workers_hwm"
        ] == 2
        wait_until(lambda: pool.metrics()["workers"] <= 1)  # the surplus worker, idle, stops
        assert pool.metrics()["workers"] == 1


@pytest.mark.slow
def test_ray_pool_grows_with_its_queue_and_shrinks_when_idle(ray_session):
    with RewardPool(
        doubles.scripted, backend="ray", num_workers=1, max_workers=2, idle_s=0.3, timeout_s=60
    ) as pool:
        run_scaling_scenario(pool, burst=4, sleep_s=0.5)

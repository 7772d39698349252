"""trainers.envs.workers.EnvWorkers: environments in worker processes, a deadline per call, and
hang / error / died told apart -- exercised with real environments that misbehave
(trainers.envs.chaos), not with mocks."""

from __future__ import annotations

import os
import time

import pytest

from trainers.envs.chaos import CounterEnv, DyingEnv, HangingEnv, RaisingEnv, UnpicklableEnv
from trainers.envs.frozenlake import FrozenLakeEnv
from trainers.envs.workers import EnvWorkers

DEADLINE = 1.0


@pytest.fixture
def runner():
    r = EnvWorkers(deadline_s=DEADLINE, start_timeout_s=60.0)
    yield r
    r.close()


def test_results_match_the_in_process_environment(runner):
    runner.add("lake", "frozenlake", size=4)
    runner.add("soko", "sokoban")
    local = FrozenLakeEnv(size=4)
    res = runner.reset("lake", seed=7)
    assert res.ok and res.value[0] == local.reset(seed=7)[0] and res.env_id == "lake"
    for a in ("down", r"\boxed{right}", "jump"):
        got = runner.step("lake", a)
        assert got.status == "ok" and got.method == "step"
        assert got.value[:4] == local.step(a)[:4]
        if got.value[2] or got.value[3]:
            break
    assert runner.reset("soko", seed=1).ok
    assert runner.metrics["ok"] == runner.metrics["calls"] and runner.metrics["replaced"] == 0


def test_each_failure_is_reported_distinctly_and_attributed_to_its_env(runner):
    runner.add(0, CounterEnv)
    runner.add(1, HangingEnv)
    runner.add(2, RaisingEnv, message="boom at step 1")
    runner.add(3, DyingEnv, how="exit", exit_code=7)
    runner.add(4, DyingEnv, how="kill")
    runner.add(5, CounterEnv)
    resets = runner.run([(i, "reset", 10 + i) for i in range(6)])
    assert [r.status for r in resets] == ["ok"] * 6
    pids = {r.env_id: r.value[1]["pid"] for r in resets}
    assert len(set(pids.values())) == 6 and os.getpid() not in pids.values()

    t0 = time.monotonic()
    res = runner.run([(i, "step", f"action-{i}") for i in reversed(range(6))])
    wall = time.monotonic() - t0
    by_id = {r.env_id: r for r in res}
    assert [r.env_id for r in res] == list(reversed(range(6)))  # in the order of the calls
    # the healthy envs answer with their own state, whatever their neighbours did
    assert by_id[0].status == by_id[5].status == "ok"
    assert by_id[0].value[0] == "step 1 (seed 10) after 'action-0'"
    assert by_id[5].value[0] == "step 1 (seed 15) after 'action-5'"
    assert by_id[1].status == "hang" and "no reply within" in by_id[1].error
    assert by_id[1].elapsed_s >= DEADLINE and wall < DEADLINE + 10  # all calls ran in parallel
    assert by_id[2].status == "error" and "RuntimeError: boom at step 1" in by_id[2].error
    assert "Traceback" in by_id[2].error
    assert by_id[3].status == "died" and "exited with code 7" in by_id[3].error
    assert by_id[4].status == "died" and "SIGKILL" in by_id[4].error
    assert all(r.value is None for r in res if not r.ok)
    m = runner.metrics
    assert (m["calls"], m["ok"], m["hang"], m["error"], m["died"], m["replaced"]) == (12, 8, 1, 1, 2, 4)

    # dropped and replaced: a fresh worker, a fresh env, the next episode works
    again = runner.run([(i, "reset", 0) for i in range(1, 5)])
    assert all(r.ok for r in again)
    assert all(r.incarnation == 1 for r in again)
    assert all(r.value[1]["pid"] != pids[r.env_id] for r in again)


def test_hung_worker_is_killed(runner):
    runner.add("h", HangingEnv, fail_at=0)  # hangs in reset
    slot_proc = runner._slots["h"].proc
    res = runner.reset("h", seed=0, deadline_s=0.5)
    assert res.status == "hang" and res.elapsed_s >= 0.5
    slot_proc.join(timeout=5)
    assert not slot_proc.is_alive() and slot_proc.exitcode < 0  # SIGKILL


def test_construction_failure_and_unpicklable_results_are_errors(runner):
    runner.add("bad", "frozenlake", size=1)
    res = runner.reset("bad", seed=0)
    assert res.status == "error" and "building the environment failed" in res.error and "size" in res.error
    runner.add("u", UnpicklableEnv)
    assert runner.reset("u", seed=0).ok
    res = runner.step("u", "go")
    assert res.status == "error" and "pickle" in res.error.lower()
    assert runner.metrics["error"] == 2 and runner.metrics["replaced"] == 2


def test_without_auto_replace_a_failed_env_stays_dropped():
    with EnvWorkers(deadline_s=DEADLINE, auto_replace=False) as r:
        r.add("x", RaisingEnv)
        r.reset("x", seed=0)
        assert r.step("x", "a").status == "error"
        with pytest.raises(RuntimeError, match="dropped"):
            r.step("x", "a")
        r.replace("x")
        assert r.reset("x", seed=0).ok and r.metrics["replaced"] == 1
        r.remove("x")
        assert r.env_ids == []


def test_submit_runs_off_the_callers_thread(runner):
    runner.add("a", CounterEnv, delay_s=0.2)
    runner.add("b", CounterEnv, delay_s=0.2)
    runner.run([("a", "reset", 1), ("b", "reset", 2)])
    fa, fb = runner.submit("a", "step", "x"), runner.submit("b", "step", "y")
    ra, rb = fa.result(timeout=30), fb.result(timeout=30)
    assert (
        ra.ok
        and rb.ok
        and ra.value[0].startswith("step 1 (seed 1)")
        and rb.value[0].startswith("step 1 (seed 2)")
    )


def test_bad_input_raises(runner):
    with pytest.raises(ValueError, match="deadline_s"):
        EnvWorkers(deadline_s=0)
    with pytest.raises(ValueError, match="never 'fork'"):
        EnvWorkers(start_method="fork")
    runner.add("a", CounterEnv)
    with pytest.raises(ValueError, match="already running"):
        runner.add("a", CounterEnv)
    with pytest.raises(ValueError, match="no environment 'zzz'"):
        runner.reset("zzz")
    with pytest.raises(ValueError, match="twice"):
        runner.run([("a", "reset", 0), ("a", "reset", 1)])
    with pytest.raises(ValueError, match="method"):
        runner.run([("a", "close", None)])
    with pytest.raises(TypeError, match="action must be a str"):
        runner.step("a", 3)
    with pytest.raises(TypeError, match="factory"):
        runner.add("b", 3)
    with pytest.raises(ValueError, match="deadline_s"):
        runner.reset("a", deadline_s=-1)
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner.reset("a")


@pytest.mark.slow
def test_spawn_start_method_and_a_gem_env_in_a_worker():
    with EnvWorkers(deadline_s=30.0, start_method="spawn") as r:
        r.add("lake", "frozenlake")
        r.add("dying", DyingEnv)
        assert r.reset("lake", seed=0).ok and r.reset("dying", seed=0).ok
        assert r.step("dying", "x").status == "died"
        pytest.importorskip("gem")
        r.add("gem", "gem:game:GuessTheNumber-v0-easy")
        res = r.reset("gem", seed=3)
        assert res.ok and "Guess The Number" in res.value[0]
        assert r.step("gem", r"\boxed{5}").ok

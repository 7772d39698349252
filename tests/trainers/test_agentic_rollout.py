"""trainers.envs.episodes: lock-step, environment-level asynchronous and redundant multi-turn rollout
with a real tiny Qwen2, the transformers rollout engine and real environments in EnvWorkers worker
processes -- including environments that hang, raise or are SIGKILLed mid-episode
(trainers.envs.chaos). Checked: failures are counted, dropped and replaced, the step goes on, every
launched episode is accounted for exactly once, and no sample is attributed to the wrong episode
(each trajectory's tokens re-derive from its own environment's transcript)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("transformers")

from rollkit.trajectory import build_trajectory
from trainers.engines import HFRolloutEngine, SamplingParams
from trainers.envs.chaos import CounterEnv, FaultOnceEnv
from trainers.envs.episodes import EpisodeRunner
from trainers.envs.turns import TurnEncoder
from trainers.envs.wrappers import LatencyEnv, StateIdEnv
from trainers.models import char_tokenizer, tiny_qwen2

PARAMS = SamplingParams(max_tokens=6, seed=0)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    return HFRolloutEngine(tiny_qwen2(tok), tok)


def accounted(m: dict) -> float:
    keys = ("env/hang", "env/error", "env/died", "rollout/stale", "env/cancelled", "rollout/discarded")
    return sum(m[k] for k in keys)


def check_attribution(rollout: EpisodeRunner, episodes, seeds: dict[int, int]) -> None:
    """Each episode's turns re-derive from its own transcript: the counter env echoes the seed and
    the decoded action into its next observation, so a swapped sample cannot go unnoticed."""
    tok, enc = rollout.tokenizer, rollout.encoder
    for e in episodes:
        assert e.status == "done" and e.seed == seeds[e.group]
        assert len(e.turns) == len(e.actions) == len(e.observations) - 1 == 3
        assert e.observations[0] == f"step 0 (seed {e.seed})"
        assert e.turns[0].obs_ids == enc.prompt_ids(e.observations[0])
        for k, turn in enumerate(e.turns):
            assert tok.decode(turn.action_ids, skip_special_tokens=True) == e.actions[k]
            assert e.observations[k + 1] == f"step {k + 1} (seed {e.seed}) after {e.actions[k]!r}"
            if k:
                assert list(turn.obs_ids) == enc.obs_ids(e.observations[k], e.turns[k - 1].action_ids)
            assert len(turn.logprobs) == len(turn.action_ids)
        traj = build_trajectory(e.turns)
        assert traj.reward == 1.0  # CounterEnv pays 1 on its last step
        for k in range(3):
            a0, a1 = traj.bounds[k, 1:].tolist()
            assert traj.input_ids[a0:a1].tolist() == list(e.turns[k].action_ids)


# ----------------------------------------------------------------------------- validation (fast)


def test_collect_validates_its_arguments(engine, tok):
    ro = EpisodeRunner(engine, TurnEncoder(tok), CounterEnv)
    try:
        with pytest.raises(ValueError, match="mode"):
            ro.collect([1], PARAMS, mode="batch")
        with pytest.raises(ValueError, match="redundancy"):
            ro.collect([1], PARAMS, mode="lockstep", redundancy=1)
        with pytest.raises(ValueError, match="seeds"):
            ro.collect([1], PARAMS, groups=2)
        with pytest.raises(ValueError, match="distinct"):
            ro.collect([1, 1], PARAMS)
        with pytest.raises(ValueError, match="group_size"):
            ro.collect([1], PARAMS, group_size=0)
        with pytest.raises(ValueError, match=r"params\.n"):
            ro.collect([1], SamplingParams(n=2))
        with pytest.raises(ValueError, match="launch_groups"):
            ro.collect([1, 2, 3], PARAMS, groups=2, launch_groups=1)
        with pytest.raises(TypeError, match="encoder"):
            EpisodeRunner(engine, tok, CounterEnv)
        with pytest.raises(ValueError, match="max_turns"):
            EpisodeRunner(engine, TurnEncoder(tok), CounterEnv, max_turns=0)
        assert ro.num_env_workers == 0  # nothing was started by the failed calls
    finally:
        ro.close()


def test_state_id_wrapper_and_latency_env_are_real_envs():
    env = StateIdEnv(CounterEnv, {"max_turns": 2})
    _, info = env.reset(seed=4)
    _, _, _, _, info2 = env.step("a")
    assert info["state_id"] != info2["state_id"]
    lat = LatencyEnv(CounterEnv, {"max_turns": 2}, latency_mean_s=0.05, latency_std_s=0.0, seed=0)
    lat.reset(seed=1)
    t0 = time.perf_counter()
    assert lat.step("x")[0] == "step 1 (seed 1) after 'x'"
    assert time.perf_counter() - t0 >= 0.04
    flaky = LatencyEnv(CounterEnv, latency_mean_s=0.0, latency_std_s=0.0, fail_prob=1.0, seed=0)
    flaky.reset(seed=0)
    with pytest.raises(RuntimeError, match="simulated"):
        flaky.step("x")
    with pytest.raises(ValueError, match="fail_mode"):
        LatencyEnv(CounterEnv, fail_mode="explode")
    with pytest.raises(ValueError, match="latency_std_s"):
        LatencyEnv(CounterEnv, latency_std_s=-1.0)


# ----------------------------------------------------------------------------- faults (processes)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_hang_raise_and_kill_are_dropped_replaced_counted_and_never_misattributed(
    engine, tok, tmp_path, mode
):
    faults = {11: ("hang", 2), 12: ("raise", 1), 13: ("kill", 2)}
    ro = EpisodeRunner(
        engine,
        TurnEncoder(tok),
        FaultOnceEnv,
        {"marker_dir": str(tmp_path), "faults": faults, "max_turns": 3},
        deadline_s=2.0,
    )
    try:
        t0 = time.perf_counter()
        res = ro.collect([10, 11, 12, 13], PARAMS, group_size=2, mode=mode)
        wall = time.perf_counter() - t0
        m = res.metrics
        assert (m["env/hang"], m["env/error"], m["env/died"], m["env/replaced"]) == (1, 1, 1, 3)
        assert len(res.episodes) == 8 and res.group_ids == [0, 0, 1, 1, 2, 2, 3, 3]
        assert m["rollout/launched"] == 8 + 3 == len(res.episodes) + accounted(m)
        check_attribution(ro, res.episodes, res.seeds)
        # the replaced tasks ran on fresh worker processes
        assert {tuple(sorted(f.name for f in tmp_path.iterdir()))} == {("fault-11", "fault-12", "fault-13")}
        # a hang costs one deadline, never its hour (the bound leaves a loaded machine time to
        # start the replacement workers and generate)
        assert wall < 600
    finally:
        ro.close()


@pytest.mark.slow
def test_lockstep_and_async_keep_the_same_trajectories_count_and_async_batches_requests(engine, tok):
    ro = EpisodeRunner(engine, TurnEncoder(tok), CounterEnv, {"max_turns": 3})
    try:
        seeds = [3, 4, 5, 6]
        lock = ro.collect(seeds, PARAMS, group_size=2, mode="lockstep")
        asyn = ro.collect(seeds, PARAMS, group_size=2, mode="async")
        for res in (lock, asyn):
            assert len(res.episodes) == 8 and res.group_ids == [0, 0, 1, 1, 2, 2, 3, 3]
            check_attribution(ro, res.episodes, res.seeds)
            assert res.metrics["env/cancelled"] == res.metrics["env/replaced"] == 0
        assert lock.metrics["rollout/engine_calls"] == 3  # one call per turn for the whole batch
        turns = sum(len(e.turns) for e in asyn.episodes)
        assert asyn.metrics["rollout/engine_calls"] < turns  # concurrent requests share engine calls
        b = asyn.to_batch()
        assert b.input_ids.shape[0] == 8 and int(b.num_turns.sum()) == 24
        # the lock-step path is reproducible: same seeds, same samples
        again = ro.collect(seeds, PARAMS, group_size=2, mode="lockstep")
        assert [e.actions for e in again.episodes] != [] and ro.num_env_workers == 8
    finally:
        ro.close()


@pytest.mark.slow
def test_redundant_rollout_keeps_first_finishers_and_cancels_the_rest(engine, tok):
    env_kwargs = {
        "env": CounterEnv,
        "env_kwargs": {"max_turns": 3},
        "latency_mean_s": 0.1,
        "latency_std_s": 0.1,
    }
    ro = EpisodeRunner(engine, TurnEncoder(tok), LatencyEnv, env_kwargs)
    try:
        ro.prestart(4 * 3)
        res = ro.collect([1, 2, 3, 4], PARAMS, groups=2, group_size=2, redundancy=1, mode="async")
        m = res.metrics
        assert len(res.episodes) == 4 and len(set(res.group_ids)) == 2
        assert m["rollout/launched"] == 12 and m["env/cancelled"] + m["rollout/discarded"] == 12 - 4
        assert m["rollout/launched"] == len(res.episodes) + accounted(m)
        check_attribution(ro, res.episodes, res.seeds)
    finally:
        ro.close()


@pytest.mark.slow
def test_staleness_is_bounded_per_turn(engine, tok):
    """The weights change while episodes are mid-way: every episode holding a turn older than the
    floor is aborted at its next turn and replaced; what is kept has only fresh turns."""
    ro = EpisodeRunner(engine, TurnEncoder(tok), CounterEnv, {"max_turns": 3, "delay_s": 0.3})
    server = ro.server
    start_version = server.policy_version

    def bump() -> None:  # once the first turns are generated (at most 120 s: a hang's bound)
        end = time.monotonic() + 120
        while server.stats["calls"] < 1 and time.monotonic() < end:
            time.sleep(0.01)
        server.update_weights(list(engine.model.named_parameters()), start_version + 1)

    try:
        ro.prestart(4)
        t = threading.Thread(target=bump)
        t.start()
        res = ro.collect(
            [7, 8], PARAMS, group_size=2, mode="async", version_floor=lambda: server.policy_version
        )
        t.join()
        m = res.metrics
        assert m["rollout/stale"] >= 1 and m["env/replaced"] == m["rollout/stale"]
        assert all(v == start_version + 1 for e in res.episodes for v in e.versions)
        assert m["rollout/launched"] == len(res.episodes) + accounted(m)
        check_attribution(ro, res.episodes, res.seeds)
    finally:
        ro.close()

"""The simulator of benchmarks/sim: the real schedulers on simulated engines (docs/simulator.md).

Invariants on every run (the drivers assert them), analytic cases with deterministic costs, and
properties of the closed-form engine; all on the virtual clock, a few seconds in all.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.sim.agentic import AgenticRun, AgenticSetting, run_agentic
from benchmarks.sim.clock import VirtualClock
from benchmarks.sim.costs import CostModel, DecodeCost, Latency, TrainCost, cpu_train, gpu_model
from benchmarks.sim.engine import RunList, SimEngine
from benchmarks.sim.lengths import Lengths
from benchmarks.sim.plan import main as plan_main
from benchmarks.sim.run import Setting, run_queue, run_sync, run_tail
from trainers.engines.base import PackedBatch, SamplingParams
from trainers.engines.requests import Request, RequestEngine
from trainers.learner import UpdateSpec, micro_batches

DECODE = DecodeCost(a=0.01, b=0.002, c=1e-5, p0=0.05, p1=1e-3)
TRAIN = TrainCost(t0=0.5, per_token=1e-3, sync_s=0.25)


def _cost(reward: float = 0.1) -> CostModel:
    return CostModel(decode=DECODE, train=TRAIN, reward=Latency("const", reward))


def test_sim_engine_is_a_request_engine():
    eng = SimEngine(VirtualClock(), DECODE, Lengths(8, 0.0, 8))
    assert isinstance(eng, RequestEngine)


def test_sync_step_is_the_sum_of_its_stages():
    """One engine, every response exactly L tokens: a synchronous step is prefill + L decode
    iterations + reward + train + weight sync, to rounding."""
    P, n, L, p = 3, 4, 20, 16
    s = Setting(P, n, Lengths(L, 0.0, 64), _cost(0.1), prompt_len=p, steps=4)
    res = run_queue(s, ratio=0, replicate=False)
    B = P * n
    expected = (
        DECODE.prefill(B * p) + DECODE.iterations(L, B, B * p) + 0.1 + TRAIN.time(B * (p + L)) + TRAIN.sync_s
    )
    for step in res.steps:
        assert step.time == pytest.approx(expected, rel=1e-9)
        assert step.trained_tokens == B * L and step.staleness == {0: P}


@settings(max_examples=12, deadline=None)
@given(
    ratio=st.sampled_from([0.5, 1.0, 1.5, 2.0, 4.0]),
    sigma=st.floats(0.0, 1.5),
    engines=st.integers(1, 3),
    seed=st.integers(0, 10),
)
def test_async_invariants_and_pipeline_bound(ratio, sigma, engines, seed):
    """Every run checks the buffer's conservation laws, the staleness bound and that no request
    is lost across suspend / update / resume; the speed-up over sync is at most the pipeline
    bound: a step is never shorter than training plus the weight sync."""
    s = Setting(4, 3, Lengths(24, sigma, 96), _cost(0.05), engines=engines, prompt_len=8, steps=6, seed=seed)
    sync = run_queue(s, ratio=0)
    res = run_queue(s, ratio=ratio)
    assert max(max(x.staleness, default=0) for x in res.steps) <= math.ceil(ratio)
    c = res.counts
    assert c["reserved"] == c["consumed"] + c["aborted"] + c["dropped_stale"] + c["held"] + c["running"]
    assert c["consumed"] == 4 * 6
    for x in res.steps:
        assert x.time >= x.train + x.sync >= TRAIN.t0 + TRAIN.sync_s
    bound = max(sync.steps[1:], key=lambda x: x.time).time / (TRAIN.t0 + TRAIN.sync_s)
    assert sync.s_per_step / res.s_per_step <= bound


def test_requests_stopped_at_an_update_continue_with_their_tokens():
    s = Setting(4, 2, Lengths(200, 0.5, 400), _cost(), prompt_len=8, steps=5)
    res = run_queue(s, ratio=2, keep=True)
    assert res.counts["resubmitted"] > 0  # continued after an update, tokens kept
    again = run_queue(s, ratio=2, keep=False)
    assert again.counts["restarted"] > 0
    assert again.generated_tokens > res.generated_tokens  # restarting wastes the tokens


@pytest.mark.parametrize("w1", ["", "lognormal:16:1.5"])
def test_sync_collector_matches_the_queue_at_ratio_0(w1):
    """The synchronous trainer's own GroupCollector (batch generate, or per-request budgets with
    W1) gives the same steps as the queue scheduler at ratio 0, prompts on one engine."""
    lengths = Lengths(16, 1.5, 512) if w1 else Lengths(20, 0.0, 20)
    s = Setting(3, 4, lengths, _cost(0.1), prompt_len=8, steps=4, w1=w1)
    sync = run_sync(s)  # asserts: every step trains 3 x 4 samples of new prompts
    queue = run_queue(s, ratio=0, replicate=False)
    assert [x.time for x in sync.steps] == pytest.approx([x.time for x in queue.steps], rel=1e-12)
    assert [x.trained_tokens for x in sync.steps] == [x.trained_tokens for x in queue.steps]
    assert sync.counts == {"trained_prompts": 12, "per_request": bool(w1)}


def test_tail_batching_trains_every_prompt_once_and_shortens_steps():
    s = Setting(
        4, 4, Lengths(16, 1.5, 512), _cost(0.0), engines=1, prompt_len=8, steps=10, w1="lognormal:16:1.5"
    )
    tail = run_tail(s)  # asserts: no prompt trained twice, drawn = trained + dropped + queued
    sync = run_queue(s, ratio=0, replicate=False)
    assert tail.counts["long_rounds"] >= 1
    assert tail.s_per_step < sync.s_per_step
    assert sum(x.samples for x in tail.steps) == 10 * 16


@settings(max_examples=30, deadline=None)
@given(
    resp=st.lists(st.integers(1, 600), min_size=1, max_size=40),
    n=st.integers(1, 8),
    mbs=st.integers(1, 16),
    sort=st.booleans(),
)
def test_train_cost_forms_the_learners_micro_batches(resp, n, mbs, sort):
    """The micro-batched train cost uses the learner's own micro-batches (same rows, same order),
    counts each micro-batch's distinct prompts and pads to its longest response."""
    cost = TrainCost(t0=0.3, per_token=1e-3, micro_batch=mbs, sort_by_length=sort, per_micro_batch=0.1,
                     k_attn=1e-6, share_prompts=True)  # fmt: skip
    P = 7
    mask = torch.zeros(len(resp), max(resp), dtype=torch.bool)
    for i, r in enumerate(resp):
        mask[i, :r] = True
    batch = PackedBatch(
        torch.zeros(len(resp), P + max(resp), dtype=torch.long), torch.ones_like(mask), mask, P
    )
    spec = UpdateSpec(micro_batch_size=mbs, sort_by_length=sort)
    real = [m.tolist() for m in micro_batches(batch, torch.arange(len(resp)), spec)]
    assert cost.micro_batches(resp) == real
    groups = [i // n for i in range(len(resp))]
    expected = cost.t0
    for rows in real:
        U, B, R = len({groups[i] for i in rows}), len(rows), max(resp[i] for i in rows)
        expected += 0.1 + 1e-3 * (U * P + B * R) + 1e-6 * B * R * (P + R)
    assert cost.batch_time(resp, prompt_len=P, groups=groups) == pytest.approx(expected, rel=1e-12)


def test_cpu_train_cost_grows_with_the_sequence_shape():
    """This machine's train model: per padded token (rows x (prompt + response)), W1's long
    micro-batches cost far more than the recipe's short ones with shared prompts (the reason one
    constant per token could not fit both jobs); the recipe's update is the fitted 5.62 s."""
    recipe = cpu_train(16, sort_by_length=False)
    t = recipe.batch_time([12] * 32, prompt_len=37, groups=[i // 8 for i in range(32)])
    assert t == pytest.approx(5.62, rel=0.01)
    long = cpu_train(8).batch_time([512] * 8, prompt_len=37, groups=[i // 4 for i in range(8)])
    assert long / (8 * (37 + 512)) > 2 * t / (32 * (37 + 12))


def test_shared_prefix_is_prefilled_once():
    clock = VirtualClock()
    shared = DecodeCost(a=0.01, b=0.0, c=0.0, p0=0.05, p1=1e-3, share_prefix=True)
    for cost, tokens in ((shared, 10 + 10), (DECODE, 4 * 10 + 10)):
        eng = SimEngine(clock, cost, Lengths(5, 0.0, 5))
        p = SamplingParams(max_tokens=5, ignore_eos=True)
        eng.add([Request(f"a{j}", RunList(1, 10, key=0), p) for j in range(4)])
        eng.add([Request("b", RunList(1, 10, key=1), p)])
        t0 = clock.now
        eng.step()
        assert eng.next_event() - t0 == pytest.approx(cost.prefill(tokens) + cost.iterations(5, 5, 50))


@settings(max_examples=30, deadline=None)
@given(k=st.integers(0, 300), B=st.integers(1, 64), kv=st.integers(0, 10_000))
def test_closed_form_decode_matches_iterations(k, B, kv):
    total = sum(DECODE.iteration(B, kv + B * i) for i in range(k))
    assert DECODE.iterations(k, B, kv) == pytest.approx(total, rel=1e-9, abs=1e-12)
    assert DECODE.max_iterations(DECODE.iterations(k, B, kv), B, kv) == k


def test_engine_abort_keeps_tokens_and_length_budget():
    clock = VirtualClock()
    eng = SimEngine(clock, DECODE, Lengths(50, 0.0, 50))
    req = Request("r", RunList(1, 10), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add([req])
    assert eng.step() == []  # admitted (prefilled) at t = 0
    clock.advance_to(DECODE.prefill(10) + DECODE.iterations(20, 1, 10))
    assert eng.step() == []
    (stopped,) = eng.abort()
    assert len(stopped.token_ids) == 20 and stopped.finish_reason is None
    eng.update_weights(None, 1)
    eng.add([stopped])
    while eng.num_running:
        clock.advance_to(eng.next_event())
        done = eng.step()
    assert len(done[0].token_ids) == 50 and done[0].token_versions.values() == {0, 1}


def test_agentic_env_level_async_beats_lockstep():
    cost = gpu_model("7B").with_(env=Latency("gauss", 10.0, 5.0))
    s = AgenticSetting(batch=16, turns=3, lengths=Lengths(64, 0.5, 256), cost=cost, engines=2, steps=3)
    lock = run_agentic(s, "lockstep")
    assert run_agentic(s, "env-async") <= lock
    assert run_agentic(s, "redundant", redundancy=0.5) <= run_agentic(s, "env-async")
    with pytest.raises(ValueError, match="mode"):
        run_agentic(s, "bogus")
    with pytest.raises(ValueError, match="group_size"):
        run_agentic(dataclasses.replace(s, group_size=5))
    with pytest.raises(ValueError, match="lockstep"):
        run_agentic(s, "lockstep", max_staleness=1)


@settings(max_examples=15, deadline=None)
@given(
    group_size=st.sampled_from([1, 2, 4]),
    failure=st.sampled_from([0.0, 0.02, 0.05]),
    redundancy=st.sampled_from([0.0, 0.25, 1.0]),
    staleness=st.integers(0, 2),
    seed=st.integers(0, 3),
)
def test_agentic_runs_the_real_async_schedule(group_size, failure, redundancy, staleness, seed):
    """The env-level runner's own AsyncSchedule decides: failed episodes replaced, spare groups
    cancelled; every run's invariants hold (AgenticRun.check), and the counters show the
    schedule at work."""
    cost = gpu_model("7B").with_(env=Latency("gauss", 10.0, 5.0))
    s = AgenticSetting(
        batch=8, turns=3, lengths=Lengths(64, 0.5, 256), cost=cost, engines=2, steps=3,
        group_size=group_size, failure=failure, seed=seed,
    )  # fmt: skip
    run = AgenticRun(s, "redundant", max_staleness=staleness, redundancy=redundancy)
    assert run.run() > 0  # checks the invariants
    done = [c for c in run.schedules if c is not None and c.done]
    assert len(done) >= s.steps
    keys = ("launched", "error", "replaced", "cancelled", "abandoned")
    total = {k: sum(c.counts[k] for c in done) for k in keys}
    assert total["replaced"] <= total["error"]
    if not total["abandoned"]:  # every failure replaced while its group has attempts left
        assert total["replaced"] == total["error"]
    if redundancy:
        assert total["cancelled"] > 0  # the spare groups' episodes
    assert total["launched"] >= s.steps * s.batch + total["error"]
    assert len(run.trained) == s.steps * s.batch


@settings(max_examples=10, deadline=None)
@given(
    group_size=st.sampled_from([1, 2, 4]),
    failure=st.sampled_from([0.0, 0.05, 0.15]),
    seed=st.integers(0, 3),
)
def test_agentic_runs_the_real_lockstep_schedule(group_size, failure, seed):
    """Lock-step is the runner's own LockstepSchedule: an episode whose environment fails
    leaves its round and is replayed in another round (each a full set of turns), so failures
    cost lock-step whole rounds; every run's invariants hold."""
    cost = gpu_model("7B").with_(env=Latency("gauss", 10.0, 5.0))
    s = AgenticSetting(
        batch=8, turns=3, lengths=Lengths(64, 0.5, 256), cost=cost, engines=2, steps=3,
        group_size=group_size, failure=failure, seed=seed,
    )  # fmt: skip
    run = AgenticRun(s, "lockstep")
    per_step = run.run()  # checks the invariants
    calls = [c for c in run.schedules if c.done]
    assert len(calls) == s.steps and len(run.trained) == s.steps * s.batch
    total = {k: sum(c.counts[k] for c in calls) for k in ("launched", "error", "replaced", "cancelled")}
    assert total["cancelled"] == 0  # lock-step cancels nothing
    assert total["launched"] == s.steps * s.batch + total["error"] + sum(c.counts["discarded"] for c in calls)
    assert per_step > 0 and len(run.rounds) == len(run.schedules)
    for call, rounds in zip(run.schedules, run.rounds):  # a failure costs its call another round
        assert rounds >= 1 + (call.counts["error"] > 0)
    assert sum(run.rounds) > s.steps or total["error"] == 0


def test_lengths_parse_and_file(tmp_path):
    d = Lengths.parse("lognormal:median=100,sigma=0.5,cap=300,prompt=0.5")
    assert d.cap == 300 and d.natural(1, 2) == d.natural(1, 2)
    for bad in ("normal:median=1", "lognormal:median=x", "lognormal:foo=1", "lognormal:cap=1.5"):
        with pytest.raises(ValueError, match="--lengths"):
            Lengths.parse(bad)
    f = tmp_path / "past.jsonl"
    f.write_text("\n".join(json.dumps({"length": n}) for n in (10, 20, 400)) + "\n5\n")
    lf = Lengths.from_file(f)
    assert lf.cap == 400 and lf.natural(0, 0) in (5, 10, 20, 400)
    f.write_text('{"length": -1}\n')
    with pytest.raises(ValueError, match="--lengths-file: line 1"):
        Lengths.from_file(f)


def test_plan_command(tmp_path, capsys):
    f = tmp_path / "past.jsonl"
    f.write_text("\n".join(str(n) for n in (100, 200, 300, 2000, 150, 120)))
    res = plan_main(
        [
            "--lengths-file",
            str(f),
            "--model-size",
            "7B",
            "--rollout-gpus",
            "2",
            "--train-gpus",
            "1",
            "--prompts",
            "4",
            "--n",
            "2",
            "--steps",
            "3",
            "--ratios",
            "1,2",
        ]
    )
    out = capsys.readouterr().out
    assert "best (trained tokens/s):" in out and "async ratio 2" in res
    for argv, name in [
        (["--rollout-gpus", "1", "--train-gpus", "1"], "--lengths / --lengths-file"),
        (["--lengths", "lognormal:median=10", "--rollout-gpus", "0", "--train-gpus", "1"], "--rollout-gpus"),
        (
            ["--lengths", "lognormal:median=10", "--rollout-gpus", "1", "--train-gpus", "1", "--ratios", "a"],
            "--ratios",
        ),
        (
            [
                "--lengths",
                "lognormal:median=10",
                "--rollout-gpus",
                "1",
                "--train-gpus",
                "1",
                "--model-size",
                "xB",
            ],
            "model size",
        ),
    ]:
        with pytest.raises(SystemExit, match=name):
            plan_main(argv)


def test_adaptive_timeout_cuts_reward_time_of_doomed_programs():
    """W2 on the virtual clock: 5% of programs never halt; the real AdaptiveTimeout spends far
    fewer worker-seconds on them than RollPacker's fixed 30 s."""
    from benchmarks.sim.engine import SimRewards, make_prompts
    from rollkit.scheduling import AdaptiveTimeout

    prompts = make_prompts(20)
    spent = {}
    for name, timeout in (("fixed", lambda problem: 30.0), ("adaptive", AdaptiveTimeout().timeout)):
        r = SimRewards(
            VirtualClock(),
            Latency("lognormal", 1.0, 0.3),
            8,
            accuracy=lambda k: 0.7,
            timeout=timeout,
            doomed=0.05,
        )
        for i in range(2000):
            r.submit(i, "", prompts[i % 20])
        r.gather()
        spent[name] = r.busy_s
    assert spent["adaptive"] < 0.6 * spent["fixed"]

"""rollkit.scheduling: RollPacker's tail batching policy and adaptive timeout.

The property test drives :class:`TailBatchingPolicy` with ``RandomOrderEngineDouble``, a
**test double of a rollout engine** for scheduler tests only (it generates nothing: it reports
the launched responses as finished in a random order, and lets aborted responses still be
reported late, as real engines do), with random checkpoint / restore points between and
inside steps.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
import random
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from rollkit.scheduling import AdaptiveTimeout, EpochSampler, TailBatchingPolicy

# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0, 4), {}, "prompts_per_step"),
        ((2.0, 4), {}, "prompts_per_step"),
        ((True, 4), {}, "prompts_per_step"),
        ((4, 0), {}, "responses_per_prompt"),
        ((4, "8"), {}, "responses_per_prompt"),
        ((4, 8), {"eta_prompts": 0.9}, "eta_prompts"),
        ((4, 8), {"eta_prompts": math.nan}, "eta_prompts"),
        ((4, 8), {"eta_prompts": math.inf}, "eta_prompts"),
        ((4, 8), {"eta_prompts": "1.25"}, "eta_prompts"),
        ((4, 8), {"eta_responses": True}, "eta_responses"),
        ((4, 8), {"eta_responses": 0.5}, "eta_responses"),
        ((4, 8), {"dynamic_sampling": 1}, "dynamic_sampling"),
        ((4, 8), {"max_tokens": 0}, "max_tokens"),
        ((4, 8), {"max_tokens": 1.5}, "max_tokens"),
    ],
)
def test_bad_configuration_names_the_argument(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TailBatchingPolicy(*args, **kwargs)


@pytest.mark.parametrize(
    "n, eta, launched",
    [
        (4, 1.25, 5),  # the paper's setting: exact
        (3, 1.25, 4),  # ceil(3.75)
        (1, 1.25, 2),  # ceil(1.25): a single prompt is still over-provisioned
        (8, 1.25, 10),
        (2, 1.0, 2),  # eta = 1: no over-provisioning
        (7, 1.5, 11),  # ceil(10.5)
        (10, 1.1, 11),  # 1.1 * 10 is 11.000000000000002 in floats: exact decimal gives 11
        (100, 1.07, 107),  # 1.07 * 100 is 107.00000000000001 in floats
    ],
)
def test_over_provisioning_rounds_up_exactly(n, eta, launched):
    p = TailBatchingPolicy(n, n, eta_prompts=eta, eta_responses=eta)
    assert p.launch_prompts == launched
    assert p.launch_responses == launched


@given(st.integers(1, 500), st.decimals(1, 4, places=3, allow_nan=False, allow_infinity=False))
def test_launch_counts_are_the_exact_ceiling(n, eta):
    p = TailBatchingPolicy(n, n, eta_prompts=float(eta), eta_responses=float(eta))
    exact = Fraction(str(eta)) * n
    assert p.launch_prompts == p.launch_responses
    assert p.launch_prompts - 1 < exact <= p.launch_prompts  # the smallest int >= eta * n


def test_defaults_are_the_papers():
    p = TailBatchingPolicy(4, 8)
    assert (p.eta_prompts, p.eta_responses, p.dynamic_sampling) == (1.25, 1.25, False)
    t = AdaptiveTimeout()
    assert (t.lam, t.t_min, t.t_max) == (1.5, 2.0, 30.0)


# ----------------------------------------------------------------------------- the rules, scripted


def _report(policy, events):
    return [policy.on_response_finished(rid, resp) for rid, resp in events]


def test_short_round_keeps_first_r0_responses_and_first_p0_prompts():
    p = TailBatchingPolicy(2, 2, max_tokens=64)  # launches 3 prompts x 3 responses
    plan = p.plan_step(iter("abcdefgh"))
    assert plan.round == "short" and plan.max_tokens == 64
    assert plan.prompt_ids == ("a", "b", "c") and plan.num_responses == 9
    d = _report(p, [(0, 2), (1, 1), (0, 0)])
    assert [x.keep for x in d] == [True, True, True]
    assert d[2].prompt_completed and d[2].abort == (0,) and not d[2].round_complete
    late = p.on_response_finished(0, 1)  # the aborted third response raced the abort
    assert not late.keep and not late.stale
    d = p.on_response_finished(2, 1)
    assert d.keep and d.abort == ()
    d = p.on_response_finished(2, 0)  # 2nd completed prompt: quota full
    assert d.round_complete and d.abort == (2, 1) and d.deferred == ("b",)
    assert not p.on_response_finished(1, 0).keep  # prompt b is out of the batch
    batch = p.finish_step()
    assert batch.round == "short" and batch.prompt_ids == ("a", "c")
    assert batch.responses == ((2, 0), (1, 0))
    assert batch.queued == ("b",) and p.queue == ("b",)
    m = batch.metrics
    assert m["tail/long_round"] == 0.0 and m["tail/queue_length"] == 1.0
    assert m["tail/launched_responses"] == 9.0
    # finished: (0,2) (1,1) (0,0) (0,1) (2,1) (2,0) (1,0) = 7; kept 4
    assert m["tail/aborted_responses"] == 2.0 and m["tail/discarded_responses"] == 3.0
    assert m["tail/deferred_prompts"] == 1.0 and m["tail/dropped_prompts"] == 0.0


def test_long_round_once_the_queue_holds_p0_prompts():
    p = TailBatchingPolicy(1, 2, max_tokens=64)  # launches 2 prompts x 3 responses
    fresh = iter(range(100))
    p.plan_step(fresh)
    _report(p, [(0, 0), (0, 1)])  # prompt 0 completes first: prompt 1 is deferred
    p.finish_step()
    assert p.queue == (1,) and p.next_round() == "long"
    plan = p.plan_step(fresh)
    assert plan.round == "long" and plan.prompt_ids == (1,)
    assert [r.num_responses for r in plan.requests] == [2]  # exactly R0, no over-provisioning
    assert plan.max_tokens == 64  # the same length cap as the short rounds
    d = _report(p, [(2, 1), (2, 0)])
    assert all(x.keep for x in d) and d[1].round_complete and d[1].abort == () and d[1].deferred == ()
    batch = p.finish_step()
    assert batch.round == "long" and batch.prompt_ids == (1,) and p.queue == ()
    assert batch.metrics["tail/long_round"] == 1.0 and batch.metrics["tail/aborted_responses"] == 0.0
    assert p.counts["long_rounds"] == 1 and p.counts["short_rounds"] == 1


def test_dynamic_sampling_drops_zero_variance_prompts_from_the_queue():
    def short_round(dynamic, rewards):
        p = TailBatchingPolicy(1, 3, eta_prompts=3.0, eta_responses=2.0, dynamic_sampling=dynamic)
        p.plan_step(iter("xyz"))  # 3 prompts x 6 responses; x completes, y and z are deferred
        _report(p, [(1, 0), (1, 1), (2, 3), (0, 0), (0, 1), (0, 5)])
        return p, p.finish_step(rewards)

    rewards = {1: [1.0, 1.0], 2: [0.0]}  # y: zero variance; z: one reward, no evidence
    p, batch = short_round(True, rewards)
    assert batch.prompt_ids == ("x",) and batch.dropped == ("y",) and batch.queued == ("z",)
    assert p.queue == ("z",) and p.counts["dropped"] == 1
    assert batch.metrics["tail/dropped_prompts"] == 1.0
    p, batch = short_round(False, rewards)  # off: rewards are ignored
    assert batch.dropped == () and p.queue == ("y", "z")
    p, batch = short_round(True, {1: [1.0, 0.0]})  # y has variance: queued
    assert batch.dropped == () and p.queue == ("y", "z")


@pytest.mark.parametrize(
    "rewards, exc, match",
    [
        ({7: [1.0]}, ValueError, "not part of step"),
        ({1: [1.0, 1.0, 1.0]}, ValueError, "only 2 responses"),
        ({1: [1.0, math.inf]}, ValueError, "finite"),
        ({1: [1.0, math.nan]}, ValueError, "NaN"),
        ({1: "11"}, TypeError, "sequence"),
        ([1.0], TypeError, "mapping"),
    ],
)
def test_bad_rewards_raise(rewards, exc, match):
    p = TailBatchingPolicy(1, 3, eta_prompts=3.0, eta_responses=2.0, dynamic_sampling=True)
    p.plan_step(iter("xyz"))
    _report(p, [(1, 0), (1, 1), (0, 0), (0, 1), (0, 2)])
    with pytest.raises(exc, match=match):
        p.finish_step(rewards)


def test_misuse_raises_clear_errors():
    p = TailBatchingPolicy(2, 2)
    with pytest.raises(ValueError, match="no step is running"):
        p.finish_step()
    with pytest.raises(TypeError, match="iterator"):
        p.plan_step([1, 2, 3, 4])  # a list would restart at every step
    with pytest.raises(ValueError, match="unknown request"):
        p.on_response_finished(0, 0)
    p.plan_step(iter(range(10)))
    with pytest.raises(ValueError, match="still running"):
        p.plan_step(iter(range(10)))
    with pytest.raises(ValueError, match="response_id"):
        p.on_response_finished(0, 3)
    p.on_response_finished(0, 0)
    with pytest.raises(ValueError, match="already reported"):
        p.on_response_finished(0, 0)
    with pytest.raises(ValueError, match="request_id"):
        p.on_response_finished(True, 0)
    with pytest.raises(ValueError, match="not complete: 0 of 2"):
        p.finish_step()
    _report(p, [(0, 1), (1, 0), (1, 1)])
    p.finish_step()
    assert p.on_response_finished(2, 0).stale  # a late report of the finished round


def test_running_out_of_fresh_prompts_loses_nothing():
    p = TailBatchingPolicy(2, 1)  # needs 3 fresh prompts
    with pytest.raises(ValueError, match="ran out of prompts"):
        p.plan_step(iter([10, 11]))
    assert p.replay == (10, 11) and p.current_round is None
    plan = p.plan_step(iter([12]))
    assert plan.prompt_ids == (10, 11, 12)


# ----------------------------------------------------------------------------- epoch sampler


def test_epoch_sampler_is_a_permutation_per_epoch_and_resumes():
    s = EpochSampler(5, seed=3)
    ids = [next(s) for _ in range(15)]
    for e in range(3):
        assert sorted(s.split(i)[1] for i in ids[5 * e : 5 * e + 5]) == list(range(5))
        assert {s.split(i)[0] for i in ids[5 * e : 5 * e + 5]} == {e}
    t = EpochSampler(5, seed=3)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert [next(t) for _ in range(7)] == [next(s) for _ in range(7)]
    assert [next(EpochSampler(5, seed=3)) for _ in range(1)] == ids[:1]  # deterministic
    with pytest.raises(ValueError, match="seed"):
        EpochSampler(5, seed=4).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="num_prompts"):
        EpochSampler(0)


# ----------------------------------------------------------------------------- the property test


class RandomOrderEngineDouble:
    """TEST DOUBLE of a rollout engine, for scheduler tests only: it generates nothing.

    ``launch`` registers every response of a plan as running; ``next_finished`` reports one of
    them as finished, chosen at random (so response lengths are random); ``abort`` stops
    responses, but each aborted one may still be reported once, late (the race between an
    abort and a response that was already finishing, which real engines have).
    """

    def __init__(self, rng: random.Random, late_prob: float) -> None:
        self.rng, self.late_prob = rng, late_prob
        self.running: list[tuple[int, int]] = []
        self.late: list[tuple[int, int]] = []

    def launch(self, plan) -> None:
        self.running += [(r.request_id, k) for r in plan.requests for k in range(r.num_responses)]

    def abort(self, request_ids) -> None:
        ids = set(request_ids)
        stopped = [x for x in self.running if x[0] in ids]
        self.running = [x for x in self.running if x[0] not in ids]
        self.late += [x for x in stopped if self.rng.random() < self.late_prob]

    def next_finished(self) -> tuple[int, int]:
        pool = self.late if self.late and (not self.running or self.rng.random() < 0.3) else self.running
        return pool.pop(self.rng.randrange(len(pool)))


def _restore(policy, sampler, cfg, transport):
    """A new process: a fresh policy and sampler loaded from the checkpoint of the old ones."""
    state = {"policy": policy.state_dict(), "sampler": sampler.state_dict()}
    state = json.loads(json.dumps(state)) if transport == "json" else pickle.loads(pickle.dumps(state))
    new_policy = TailBatchingPolicy(cfg["P0"], cfg["R0"], **cfg["kw"])
    new_policy.load_state_dict(state["policy"])
    new_sampler = EpochSampler(cfg["N"], seed=cfg["seed"])
    new_sampler.load_state_dict(state["sampler"])
    return new_policy, new_sampler, state["policy"]


def _check_conservation(policy):
    c = policy.counts
    assert c["drawn"] == c["trained"] + c["dropped"] + c["queued"] + c["replay"] + c["in_round"]


@given(
    data=st.data(),
    P0=st.integers(1, 4),
    R0=st.integers(1, 3),
    eta_p=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
    eta_r=st.sampled_from([1.0, 1.25, 2.0]),
    dynamic=st.booleans(),
    N=st.integers(1, 9),
    steps=st.integers(1, 14),
)
def test_tail_batching_trains_every_prompt_exactly_once(data, P0, R0, eta_p, eta_r, dynamic, N, steps):
    rng = data.draw(st.randoms(use_true_random=False), label="finish order")
    p_ckpt = data.draw(st.sampled_from([0.0, 0.2, 0.5]), label="checkpoint probability")
    cfg = {
        "P0": P0,
        "R0": R0,
        "N": N,
        "seed": 0,
        "kw": {"eta_prompts": eta_p, "eta_responses": eta_r, "dynamic_sampling": dynamic, "max_tokens": 32},
    }
    policy = TailBatchingPolicy(P0, R0, **cfg["kw"])
    sampler = EpochSampler(N, seed=0)
    trained: list[int] = []
    dropped: list[int] = []
    restores = 0

    def run_step(random_order: bool):
        nonlocal policy, sampler, restores
        expected = "long" if len(policy.queue) >= P0 else "short"
        plan = policy.plan_step(sampler)
        assert plan.round == expected and plan.max_tokens == 32
        want = (P0, R0) if expected == "long" else (policy.launch_prompts, policy.launch_responses)
        assert (len(plan.requests), {r.num_responses for r in plan.requests}) == (want[0], {want[1]})
        engine = RandomOrderEngineDouble(rng if random_order else random.Random(0), 0.3)
        engine.launch(plan)
        finished: dict[int, list[int]] = {r.request_id: [] for r in plan.requests}
        while True:
            _check_conservation(policy)
            if random_order and rng.random() < p_ckpt / 4:  # crash and restore inside the round
                old_ids = [r.request_id for r in plan.requests]
                policy, sampler, state = _restore(policy, sampler, cfg, rng.choice(["json", "pickle"]))
                restores += 1
                # the rolled-back round is waiting to be launched again, nothing lost
                held = state["queue"] if plan.round == "long" else state["replay"]
                assert tuple(held[: len(plan.requests)]) == plan.prompt_ids
                assert policy.on_response_finished(rng.choice(old_ids), 0).stale
                _check_conservation(policy)
                return None
            rid, resp = engine.next_finished()
            d = policy.on_response_finished(rid, resp)
            assert not d.stale
            finished[rid].append(resp)
            engine.abort(d.abort)
            if d.round_complete:
                break
        for _ in range(rng.randrange(3) if random_order else 0):  # reports racing the aborts
            if engine.running or engine.late:
                rid, resp = engine.next_finished()
                finished[rid].append(resp)
                late = policy.on_response_finished(rid, resp)
                assert not (late.keep or late.stale or late.round_complete or late.abort)
        rewards = {rid: [float(rng.random() < 0.5) for _ in fin] for rid, fin in finished.items()}
        batch = policy.finish_step(rewards)
        # one round type, P0 x R0, the first R0 finished of each kept prompt, nothing repeated
        assert batch.round == plan.round
        assert set(batch.request_ids) <= {r.request_id for r in plan.requests}
        assert len(batch.requests) == P0 and len(set(batch.request_ids)) == P0
        for req, resps in zip(batch.requests, batch.responses):
            assert list(resps) == finished[req.request_id][:R0]
        assert Counter(batch.prompt_ids) + Counter(batch.queued) + Counter(batch.dropped) == Counter(
            plan.prompt_ids
        )
        if plan.round == "long":
            assert batch.queued == batch.dropped == ()
        if not dynamic:
            assert batch.dropped == ()
        assert batch.metrics["tail/queue_length"] == len(policy.queue)
        assert batch.metrics["tail/long_round"] == float(plan.round == "long")
        trained.extend(batch.prompt_ids)
        dropped.extend(batch.dropped)
        _check_conservation(policy)
        return batch

    for _ in range(steps):
        run_step(random_order=True)
        if rng.random() < p_ckpt:  # restore between steps: the queue survives
            queue, replay, counts = policy.queue, policy.replay, policy.counts
            policy, sampler, _ = _restore(policy, sampler, cfg, rng.choice(["json", "pickle"]))
            restores += 1
            assert (policy.queue, policy.replay, policy.counts) == (queue, replay, counts)

    c = policy.counts
    event(f"long rounds: {min(c['long_rounds'], 2)}+, restores: {min(restores, 2)}+")
    event(f"dropped by dynamic sampling: {c['dropped'] > 0}, discarded late: {c['discarded_responses'] > 0}")
    # nothing lost, nothing duplicated: every drawn prompt is trained, dropped or still held
    drawn = policy.counts["drawn"]
    reference = EpochSampler(N, seed=0)
    assert Counter(trained + dropped + list(policy.queue) + list(policy.replay)) == Counter(
        next(reference) for _ in range(drawn)
    )
    assert policy.counts["trained"] == len(trained) and policy.counts["dropped"] == len(dropped)

    # run on (in a fixed finish order) until epoch 0 is resolved: each of its prompts trained
    # exactly once, or dropped by dynamic sampling, and never both
    for _ in range(60 * (N + P0)):
        resolved = [i for i in trained + dropped if sampler.split(i)[0] == 0]
        if len(resolved) == N:
            break
        run_step(random_order=False)
    epoch0_trained = [i for i in trained if i < N]
    epoch0_dropped = [i for i in dropped if i < N]
    assert sorted(epoch0_trained + epoch0_dropped) == list(range(N))
    assert len(set(epoch0_trained)) == len(epoch0_trained)
    if not dynamic:
        assert epoch0_dropped == []


def test_restored_counts_must_be_consistent():
    p = TailBatchingPolicy(2, 2)
    state = p.state_dict()
    bad = copy.deepcopy(state)
    bad["queue"] = [1]
    with pytest.raises(ValueError, match="inconsistent counts"):
        TailBatchingPolicy(2, 2).load_state_dict(bad)
    with pytest.raises(ValueError, match="configuration"):
        TailBatchingPolicy(2, 3).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        TailBatchingPolicy(2, 2).load_state_dict({"config": state["config"]})


def test_restoring_an_older_checkpoint_never_reuses_request_ids():
    p = TailBatchingPolicy(1, 1)
    fresh = iter(range(100))
    old = p.state_dict()
    plan = p.plan_step(fresh)  # request ids 0, 1 in flight
    p.load_state_dict(old)
    assert p.on_response_finished(plan.requests[0].request_id, 0).stale
    assert p.plan_step(fresh).requests[0].request_id == 2


# ----------------------------------------------------------------------------- adaptive timeout


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lam": 0.0}, "lam"),
        ({"lam": math.inf}, "lam"),
        ({"lam": "1.5"}, "lam"),
        ({"t_min": -1.0}, "t_min"),
        ({"t_max": 0.0}, "t_max"),
        ({"t_max": math.inf}, "t_max"),
        ({"t_min": 5.0, "t_max": 4.0}, "t_max"),
        ({"t_min": math.nan}, "t_min"),
    ],
)
def test_adaptive_timeout_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveTimeout(**kwargs)


def test_adaptive_timeout_bad_observations():
    t = AdaptiveTimeout()
    with pytest.raises(ValueError, match="run_seconds"):
        t.observe("p", -1.0, correct=True)
    with pytest.raises(ValueError, match="run_seconds"):
        t.observe("p", math.nan, correct=True)
    with pytest.raises(TypeError, match="correct"):
        t.observe("p", 1.0, correct=1)
    with pytest.raises(TypeError, match="problem_id"):
        t.timeout(["p"])


def test_adaptive_timeout_is_t_max_before_any_correct_solution():
    t = AdaptiveTimeout(lam=2.0, t_min=1.0, t_max=10.0)
    assert t.timeout("p") == 10.0 and t.anchor("p") is None
    assert t.observe("p", 0.5, correct=False) == 10.0  # wrong answers never set the anchor
    assert t.observe("p", 0.5, correct=True) == 1.0 and t.anchor("p") == 0.5


@given(
    lam=st.floats(0.1, 5),
    t_min=st.floats(0, 10),
    span=st.floats(0.1, 60),
    runs=st.lists(
        st.tuples(st.sampled_from(["a", "b", ("c", 1)]), st.floats(0, 100), st.booleans()), max_size=20
    ),
)
def test_adaptive_timeout_formula(lam, t_min, span, runs):
    t_max = t_min + span
    t = AdaptiveTimeout(lam=lam, t_min=t_min, t_max=t_max)
    for pid, secs, ok in runs:
        before = t.timeout(pid)
        after = t.observe(pid, secs, correct=ok)
        assert t_min <= after <= t_max
        if not ok:
            assert after == before
    for pid in ["a", "b", ("c", 1), "never"]:
        correct = [s for q, s, ok in runs if q == pid and ok]
        expected = min(max(t_min, lam * max(correct)), t_max) if correct else t_max
        assert t.timeout(pid) == expected
        assert t.anchor(pid) == (max(correct) if correct else None)
    u = AdaptiveTimeout(lam=lam, t_min=t_min, t_max=t_max)
    u.load_state_dict(pickle.loads(pickle.dumps(t.state_dict())))
    assert [u.timeout(k) for k in ["a", "b", ("c", 1), "never"]] == [
        t.timeout(k) for k in ["a", "b", ("c", 1), "never"]
    ]
    with pytest.raises(ValueError, match="lam"):
        AdaptiveTimeout(lam=lam + 1, t_min=t_min, t_max=t_max).load_state_dict(t.state_dict())

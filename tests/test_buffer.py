"""rollkit.buffer: the freshness-bounded sample buffer (async ratio of ROLL Flash / RollArt)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rollkit.buffer import Batch, SampleBuffer, off_policy_loss_inputs, staleness_metrics
from rollkit.registry import POLICY_LOSSES


def _filled(batch_size=2, async_ratio=1.0, n=None, **kw):
    """A buffer with ``n`` (default: all free slots) requests reserved and put (payload = id)."""
    buf = SampleBuffer(batch_size, async_ratio=async_ratio, **kw)
    for rid in buf.reserve(buf.free_slots if n is None else n):
        buf.put(rid, rid)
    return buf


def _unchanged(buf, fn, match):
    """``fn()`` raises ValueError matching ``match`` and leaves the buffer's state unchanged."""
    before = buf.state_dict()
    with pytest.raises(ValueError, match=match):
        fn()
    assert buf.state_dict() == before


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2.0}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"batch_size": 2, "async_ratio": -0.5}, "async_ratio"),
        ({"batch_size": 2, "async_ratio": float("nan")}, "async_ratio"),
        ({"batch_size": 2, "async_ratio": math.inf}, "async_ratio"),
        ({"batch_size": 2, "async_ratio": "1"}, "async_ratio"),
        ({"batch_size": 2, "async_ratio": True}, "async_ratio"),
        ({"batch_size": 2, "group_size": 0}, "group_size"),
        ({"batch_size": 4, "max_in_flight": 3}, "max_in_flight"),
        ({"batch_size": 2, "initial_version": 1.0}, "initial_version"),
    ],
)
def test_bad_configuration_names_the_argument(kwargs, match):
    bs = kwargs.pop("batch_size")
    with pytest.raises(ValueError, match=match):
        SampleBuffer(bs, **kwargs)


@pytest.mark.parametrize(
    "batch_size, alpha, in_flight, min_back, cap",
    [
        (3, 0, 3, 0, 3),
        (3, 1, 6, 1, 3),
        (4, 1.5, 10, 2, 2),
        (3, 1.5, 8, 2, 1),  # ceil(7.5) = 8, floor(1.5) = 1
        (10, 0.3, 13, 1, 3),  # 1.3 * 10 is 13.000000000000002 in floats: the bound is exact
        (20, 4.35, 107, 5, 7),  # 0.35 * 20 is 6.99999... in floats: the cap is exact
        (4, 0.25, 5, 1, 1),
    ],
)
def test_default_bounds_are_exact(batch_size, alpha, in_flight, min_back, cap):
    buf = SampleBuffer(batch_size, async_ratio=alpha, initial_version=7)
    assert buf.max_in_flight == in_flight  # ceil((1 + alpha) * B)
    assert buf.min_version == 7 - min_back  # n - ceil(alpha)
    assert buf.oldest_cap == cap  # floor(frac(alpha) * B), or B for an integer alpha


# ----------------------------------------------------------------------------- admission control


def test_in_flight_bound_counts_running_and_held():
    buf = SampleBuffer(2, async_ratio=0.5)  # ceil(1.5 * 2) = 3
    assert buf.can_start(3) and not buf.can_start(4)
    a = buf.reserve(2)
    buf.put(a[0], "x")  # held still counts
    assert buf.in_flight == 2 and buf.free_slots == 1
    _unchanged(buf, lambda: buf.reserve(2), "only 1 free")
    b = buf.reserve(1)
    assert not buf.can_start()
    buf.abort(b)  # an abort frees a slot
    assert buf.can_start()
    buf.put(a[1], "y")
    assert buf.get_batch().samples == ["x", "y"]
    # trained requests keep their slots until the new weights: ceil(alpha * B) = 1 may run
    assert buf.in_flight == 0 and buf.free_slots == 1
    _unchanged(buf, lambda: buf.reserve(2), "consumed at this version=2")
    buf.reserve(1)
    buf.set_version(1)
    assert buf.free_slots == 2
    assert buf.reserve(0) == []


def test_slots_freed_by_training_start_fresh_requests():
    """Without the per-version release, alpha = 0.5 could fill every slot with requests of the
    oldest version (a batch may use only floor(0.5 B) of them) and never form a batch."""
    buf = SampleBuffer(2, async_ratio=0.5)  # 3 slots, at most 1 from version n - 1 per batch
    for n in range(6):
        while buf.can_start():
            buf.reserve(1)
        for rid in buf.running_ids():
            buf.put(rid, rid)
        batch = buf.get_batch()
        assert batch is not None, f"no batch at version {n}"
        assert batch.staleness.get(1, 0) <= 1 and set(batch.staleness) <= {0, 1}
        assert buf.in_flight <= 1  # ceil(0.5 * 2) carried over
        buf.set_version(n + 1)


def test_request_ids_increase_and_record_the_starting_version():
    buf = SampleBuffer(2, async_ratio=2)
    assert buf.reserve(2) == [0, 1]
    buf.set_version(1)
    assert buf.reserve(1) == [2]
    for r in (0, 1, 2):
        buf.put(r, r)
    batch = buf.get_batch()
    assert batch.start_versions == [0, 0] and batch.version == 1 and batch.staleness == {1: 2}


# ----------------------------------------------------------------------------- bad input


def test_put_errors_name_the_problem_and_change_nothing():
    buf = SampleBuffer(2, async_ratio=1, group_size=2)
    a, b, c = buf.reserve(3)
    buf.put(a, ["s0", "s1"])
    _unchanged(buf, lambda: buf.put(99, ["s", "s"]), "unknown request id 99")
    _unchanged(buf, lambda: buf.put(-1, ["s", "s"]), "unknown request id -1")
    _unchanged(buf, lambda: buf.put(a, ["s", "s"]), "not running .*finished and held")
    _unchanged(buf, lambda: buf.put(b, ["only one"]), "expected 2 samples")
    _unchanged(buf, lambda: buf.put(b, "ab"), "list or tuple")
    _unchanged(buf, lambda: buf.put(1.0, ["s", "s"]), "request_id: expected an int")
    buf.abort(c)
    _unchanged(buf, lambda: buf.put(c, ["s", "s"]), "not running .*consumed, aborted or expired")
    buf.put(b, ("t0", "t1"))
    assert buf.stats()["produced"] == 2


def test_abort_is_atomic():
    buf = SampleBuffer(2, async_ratio=1)
    a, b, c = buf.reserve(3)
    buf.put(c, "done")
    _unchanged(buf, lambda: buf.abort([a, 42]), "unknown request id 42")
    _unchanged(buf, lambda: buf.abort([a, c]), "finished and held")
    _unchanged(buf, lambda: buf.abort([a, a]), "repeated")
    _unchanged(buf, lambda: buf.abort("a"), "request_ids: expected an int")
    buf.abort(a)  # a single int works too
    buf.abort(torch.tensor([b]))  # and a tensor of ids
    assert buf.stats()["aborted"] == 2 and buf.running_ids() == []


def test_set_version_must_increase():
    buf = SampleBuffer(2, initial_version=3)
    _unchanged(buf, lambda: buf.set_version(3), "version: must increase, got 3 after 3")
    _unchanged(buf, lambda: buf.set_version(2), "must increase")
    _unchanged(buf, lambda: buf.set_version(4.0), "version: expected an int")
    assert buf.set_version(6) == [] and buf.version == 6  # several steps at once


# ----------------------------------------------------------------------------- the freshness rule


def test_integer_ratio_trains_up_to_alpha_versions_old_and_expires_older():
    buf = SampleBuffer(2, async_ratio=1)
    v0 = buf.reserve(4)
    for r in v0[:3]:
        buf.put(r, r)
    assert buf.get_batch().samples == [0, 1]
    assert buf.set_version(1) == []  # version 0 is 1 old: still allowed, 3 keeps running
    v1 = buf.reserve(2)
    buf.put(v0[3], 3)
    buf.put(v1[0], 4)
    batch = buf.get_batch()
    assert batch.samples == [2, 3] and batch.staleness == {1: 2}  # oldest first
    assert buf.set_version(2) == []  # nothing of version 0 left
    buf.put(v1[1], 5)
    assert buf.get_batch().samples == [4, 5]
    # a version-1 request still running at version 3 is aborted; a finished one is dropped
    r_run, r_done = buf.reserve(2)
    assert buf.set_version(3) == []  # started at 2: 1 old
    r_old = buf.reserve(1)[0]  # started at 3
    buf.put(r_done, "x")
    assert buf.set_version(5) == [r_run, r_old]  # started at 2 and 3 < 5 - 1
    assert not buf.is_running(r_run) and not buf.is_running(r_old)
    s = buf.stats()
    assert s["aborted"] == 2 and s["dropped_stale"] == 1 and s["held"] == 0


def test_fractional_ratio_caps_the_oldest_version():
    # alpha = 1.5, B = 4 at version n = 2: versions 1, 2 freely, version 0 at most 2 per batch
    buf = SampleBuffer(4, async_ratio=1.5)
    old = buf.reserve(4)
    buf.set_version(1)
    mid = buf.reserve(1)
    buf.set_version(2)
    for r in old + mid:
        buf.put(r, r)
    assert buf.num_ready() == 3 and buf.get_batch() is None  # 2 of version 0 + 1 of version 1
    new = buf.reserve(1)
    buf.put(new[0], new[0])
    batch = buf.get_batch()
    assert batch.request_ids == [0, 1, 4, 5]
    assert batch.staleness == {0: 1, 1: 1, 2: 2}
    assert max(batch.staleness) <= math.ceil(1.5) and batch.staleness[2] <= math.floor(0.5 * 4)
    # the two version-0 requests left over the cap expire at version 3
    assert buf.set_version(3) == [] and buf.stats()["dropped_stale"] == 2


def test_fractional_ratio_below_one():
    # alpha = 0.5, B = 2: the previous version may fill at most floor(0.5 * 2) = 1 batch slot
    buf = SampleBuffer(4, async_ratio=0.5)  # 6 slots, at most 2 from version n - 1
    prev = buf.reserve(6)
    for r in prev:
        buf.put(r, r)
    assert buf.get_batch().request_ids == [0, 1, 2, 3]
    buf.set_version(1)
    assert buf.get_batch() is None and buf.num_ready() == 2  # only 2 of version 0 may be used
    new = buf.reserve(4)
    buf.put(new[3], "late-started, early-finished")
    buf.put(new[0], "n0")
    batch = buf.get_batch()
    assert batch.request_ids == [4, 5, 6, 9] and batch.staleness == {0: 2, 1: 2}


def test_async_ratio_zero_trains_nothing_from_the_previous_version():
    buf = SampleBuffer(2, async_ratio=0)
    assert buf.max_in_flight == 2
    a, b = buf.reserve(2)
    buf.put(a, "a")
    assert buf.set_version(1) == [b]  # a version-0 request cannot be trained at 1: aborted
    assert buf.stats()["dropped_stale"] == 1  # and the finished one is dropped
    _unchanged(buf, lambda: buf.put(b, "late"), "not running")
    c, d = buf.reserve(2)
    buf.put(d, "d")
    buf.put(c, "c")
    batch = buf.get_batch()
    assert batch.samples == ["c", "d"] and batch.staleness == {0: 2}  # reservation order


def test_abort_expiring_releases_the_oldest_version_after_the_batch():
    buf = SampleBuffer(2, async_ratio=1, max_in_flight=6)
    _unchanged(buf, buf.abort_expiring, "no batch drawn yet at version 0")
    v0 = buf.reserve(4)
    buf.set_version(1)
    for r in v0[:2]:
        buf.put(r, r)
    v1 = buf.reserve(2)
    buf.put(v1[0], "fresh")
    buf.put(v1[1], "fresh2")
    assert buf.get_batch().request_ids == [0, 1]
    # 2 and 3 (version 0 = n - 1) can no longer be trained after this version's batch
    assert buf.abort_expiring() == [2, 3]
    assert buf.stats()["held"] == 2 and buf.free_slots == 2
    buf.set_version(2)
    _unchanged(buf, buf.abort_expiring, "no batch drawn yet at version 2")


def test_expiry_drops_finished_stale_samples():
    buf = _filled(2, async_ratio=1)  # 4 held at version 0
    buf.get_batch()
    buf.set_version(2)
    s = buf.stats()
    assert s["dropped_stale"] == 2 and s["consumed"] == 2 and s["held"] == 0 and s["produced"] == 4


# ----------------------------------------------------------------------------- batches and groups


def test_groups_are_consumed_whole_with_tensors():
    buf = SampleBuffer(2, async_ratio=1, group_size=3)
    a, b = buf.reserve(2)
    buf.set_version(1)
    c = buf.reserve(1)[0]
    buf.put(c, [f"c{j}" for j in range(3)])
    buf.put(b, [f"b{j}" for j in range(3)])
    batch = buf.get_batch()
    assert isinstance(batch, Batch)
    assert batch.samples == ["b0", "b1", "b2", "c0", "c1", "c2"]
    assert torch.equal(batch.policy_version, torch.tensor([0, 0, 0, 1, 1, 1]))
    assert torch.equal(batch.group_ids, torch.tensor([b, b, b, c, c, c]))
    assert batch.policy_version.dtype == torch.int64
    assert buf.running_ids() == [a] and buf.running_ids(max_version=-1) == []


def test_stats_and_staleness_histograms():
    buf = SampleBuffer(2, async_ratio=2)
    ids = buf.reserve(6)
    for r in ids:
        buf.put(r, r)
    buf.get_batch()
    buf.set_version(2)
    buf.get_batch()
    s = buf.stats()
    assert s["staleness"] == {2: 2} and s["staleness_total"] == {0: 2, 2: 2}
    assert s["batches"] == 2 and s["consumed"] == 4 and s["held"] == 2 and s["in_flight"] == 2
    m = staleness_metrics(s["staleness_total"])
    assert m["staleness/mean"] == 1.0 and m["staleness/max"] == 2.0 and m["staleness/on_policy_frac"] == 0.5
    assert m["staleness/count/0"] == 2.0 and m["staleness/count/2"] == 2.0
    assert staleness_metrics({})["staleness/mean"] == 0.0
    with pytest.raises(ValueError, match="staleness"):
        staleness_metrics({-1: 2})


# ----------------------------------------------------------------------------- checkpoints


def test_state_dict_round_trips_exactly_through_torch_save():
    buf = SampleBuffer(2, async_ratio=1.5, group_size=2)
    ids = buf.reserve(4)
    buf.put(ids[0], [torch.ones(2), torch.zeros(3)])
    buf.put(ids[1], [torch.ones(1), torch.ones(1)])
    assert buf.get_batch().request_ids == ids[:2]
    buf.set_version(1)
    buf.put(ids[2], [torch.arange(2), torch.arange(3)])
    buf.abort([ids[3]])
    sd = buf.state_dict()
    f = io.BytesIO()
    torch.save(sd, f)
    f.seek(0)
    loaded = torch.load(f, weights_only=True)  # plain Python + tensors
    new = SampleBuffer(2, async_ratio=1.5, group_size=2)
    new.load_state_dict(loaded)
    assert new.stats() == buf.stats() and new.version == buf.version
    sd2 = new.state_dict()
    assert sd2["held"][0][0] == sd["held"][0][0]
    assert all(torch.equal(x, y) for x, y in zip(sd2["held"][0][2], sd["held"][0][2]))
    # both continue identically
    for b in (buf, new):
        b.put(b.reserve(1)[0], [torch.ones(1), torch.ones(1)])
    assert buf.get_batch().request_ids == new.get_batch().request_ids


def test_load_state_dict_validates_before_changing_anything():
    buf = _filled(2, async_ratio=1, n=3)
    good = buf.state_dict()
    other = SampleBuffer(3, async_ratio=1)
    _unchanged(other, lambda: other.load_state_dict(good), "config")
    target = SampleBuffer(2, async_ratio=1)
    bad = {**good, "counts": {**good["counts"], "produced": 7}}
    _unchanged(target, lambda: target.load_state_dict(bad), "produced != consumed")
    bad = {**good, "held": good["held"] + [[0, 0, [0]]]}
    _unchanged(target, lambda: target.load_state_dict(bad), "appears twice")
    bad = {**good, "held": [[99, 0, [0]]]}
    _unchanged(target, lambda: target.load_state_dict(bad), "next_id")
    bad = {**good, "version": 5}  # held version 0 would be stale at 5
    _unchanged(target, lambda: target.load_state_dict(bad), "outside")
    bad = dict(good)
    del bad["running"]
    _unchanged(target, lambda: target.load_state_dict(bad), "missing")
    target.load_state_dict(good)
    assert target.state_dict() == good


# ----------------------------------------------------------------------------- async ratio 0 == sync


def _gen(prompt: int, version: int) -> tuple[int, int]:
    """A deterministic stand-in for generation: the sample depends on the prompt and on the
    weights version that started it (a test double for the engine, not a mock of the buffer)."""
    return (prompt, version)


@settings(max_examples=40, deadline=None)
@given(
    batch_size=st.integers(1, 4),
    group_size=st.integers(1, 3),
    steps=st.integers(1, 4),
    data=st.data(),
)
def test_async_ratio_zero_reproduces_the_synchronous_trainer(batch_size, group_size, steps, data):
    """Any interleaving of starts and (out-of-order) finishes with async_ratio=0 trains exactly
    the samples of the synchronous loop (generate a batch of the next prompts, train, bump)."""
    reference = []
    for n in range(steps):
        prompts = range(n * batch_size, (n + 1) * batch_size)
        reference.append([_gen(p, n) for p in prompts for _ in range(group_size)])

    buf = SampleBuffer(batch_size, async_ratio=0, group_size=group_size)
    next_prompt, prompt_of, trained = 0, {}, []
    while len(trained) < steps:
        running = buf.running_ids()
        choices = (["start"] if buf.can_start() else []) + (["finish"] if running else [])
        action = data.draw(st.sampled_from([*choices, "train"]))
        if action == "start":
            (rid,) = buf.reserve(1)
            prompt_of[rid], next_prompt = next_prompt, next_prompt + 1
        elif action == "finish":
            rid = data.draw(st.sampled_from(running))
            sample = _gen(prompt_of[rid], buf.version)
            buf.put(rid, [sample] * group_size if group_size > 1 else sample)
        else:
            batch = buf.get_batch()
            if batch is None:
                assert buf.num_ready() < batch_size
                continue
            assert batch.staleness == {0: batch_size}
            trained.append(batch.samples)
            assert buf.set_version(buf.version + 1) == []
    assert trained == reference


# ----------------------------------------------------------------------------- off-policy losses


def _loss_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(3, 4, generator=g)).requires_grad_(True)
    beh = -torch.rand(3, 4, generator=g)
    prox = -torch.rand(3, 4, generator=g)
    adv = torch.randn(3, generator=g)
    mask = torch.rand(3, 4, generator=g) > 0.2
    return lp, adv, mask, beh, prox


@pytest.mark.parametrize("name", ["decoupled-ppo", "decoupled_ppo", "tis"])
def test_two_policy_losses_get_proximal_as_old_and_behavior_separately(name):
    lp, adv, mask, beh, prox = _loss_tensors()
    inp = off_policy_loss_inputs(name, lp, adv, mask, beh, proximal_logprobs=prox)
    assert inp["old_logprobs"] is prox and inp["behavior_logprobs"] is beh and inp["logprobs"] is lp
    fn = POLICY_LOSSES.get(name)
    assert torch.equal(fn(**inp).loss, fn(lp, prox, adv, mask, beh).loss)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        off_policy_loss_inputs(name, lp, adv, mask, beh)


@pytest.mark.parametrize("name", ["cispo", "topr", "ppo", "grpo"])
def test_single_ratio_losses_take_the_ratio_against_the_behavior_policy(name):
    lp, adv, mask, beh, prox = _loss_tensors(1)
    inp = off_policy_loss_inputs(name, lp, adv, mask, beh, proximal_logprobs=prox)
    assert inp["old_logprobs"] is beh and "behavior_logprobs" not in inp
    fn = POLICY_LOSSES.get(name)
    out = fn(**inp)
    assert torch.equal(out.loss, fn(lp, beh, adv, mask).loss)
    assert out.loss.shape == (3, 4)


def test_off_policy_loss_inputs_bad_input():
    lp, adv, mask, beh, _ = _loss_tensors()
    with pytest.raises(KeyError, match="no-such-loss"):
        off_policy_loss_inputs("no-such-loss", lp, adv, mask, beh)
    with pytest.raises(ValueError, match="loss: expected"):
        off_policy_loss_inputs(None, lp, adv, mask, beh)
    with pytest.raises(ValueError, match="behavior_logprobs"):
        off_policy_loss_inputs("cispo", lp, adv, mask, beh.tolist())


# ----------------------------------------------------------------------------- stateful property test

ALPHAS = {0: (0, 0), 0.5: (1, 0.5), 1: (1, 0), 1.5: (2, 0.5), 2: (2, 0), 2.25: (3, 0.25)}  # ceil, frac


class BufferMachine(RuleBasedStateMachine):
    """Random interleavings of reserve / put / abort / get_batch / set_version / abort_expiring /
    checkpoint-restore, checked against an explicit model of where every request is."""

    @initialize(
        batch_size=st.integers(1, 4),
        alpha=st.sampled_from(sorted(ALPHAS)),
        group_size=st.integers(1, 2),
        extra=st.none() | st.integers(0, 2),
    )
    def setup(self, batch_size, alpha, group_size, extra):
        self.cfg = {
            "batch_size": batch_size,
            "async_ratio": alpha,
            "group_size": group_size,
            "max_in_flight": None if extra is None else batch_size + extra,
        }
        self.buf = SampleBuffer(batch_size, **{k: v for k, v in self.cfg.items() if k != "batch_size"})
        self.B, self.G = batch_size, group_size
        self.k, self.frac = ALPHAS[alpha]
        self.bound = math.ceil((1 + alpha) * batch_size) if extra is None else batch_size + extra
        self.version, self.next_id, self.batches_here = 0, 0, 0
        self.start: dict[int, int] = {}
        self.running: set[int] = set()
        self.held: set[int] = set()
        self.consumed: list[int] = []
        self.dropped: set[int] = set()
        self.aborted: set[int] = set()
        self.produced: set[int] = set()

    def _payload(self, rid):
        return [(rid, j) for j in range(self.G)]

    # -- producer
    @rule(n=st.integers(0, 3))
    def reserve(self, n):
        free = self.bound - len(self.running) - len(self.held) - self.batches_here * self.B
        if n > free:
            _unchanged(self.buf, lambda: self.buf.reserve(n), "free slots")
            return
        ids = self.buf.reserve(n)
        assert ids == list(range(self.next_id, self.next_id + n))
        self.next_id += n
        for rid in ids:
            self.start[rid] = self.version
            self.running.add(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def put(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        p = self._payload(rid)
        self.buf.put(rid, p if self.G > 1 else p[0])
        self.running.remove(rid)
        self.held.add(rid)
        self.produced.add(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.running)), min_size=1, unique=True))
        self.buf.abort(ids)
        self.running -= set(ids)
        self.aborted |= set(ids)

    @rule(data=st.data())
    def produce(self, data):
        """A fast producer: start requests in every free slot, finish all but a few of the running."""
        self.reserve(self.bound - len(self.running) - len(self.held) - self.batches_here * self.B)
        if self.running:
            keep = data.draw(st.lists(st.sampled_from(sorted(self.running)), unique=True))
            for rid in sorted(self.running - set(keep)):
                p = self._payload(rid)
                self.buf.put(rid, p if self.G > 1 else p[0])
                self.running.remove(rid)
                self.held.add(rid)
                self.produced.add(rid)

    @rule()
    def train_step(self):
        """The trainer's protocol: draw this version's batch, then move to the next version."""
        self.get_batch()
        self.set_version(1)

    @rule(data=st.data())
    def bad_put(self, data):
        done = self.held | set(self.consumed) | self.dropped | self.aborted
        not_running = [*sorted(done), self.next_id + 3]
        rid = data.draw(st.sampled_from(not_running))
        _unchanged(self.buf, lambda: self.buf.put(rid, self._payload(rid)), "request_id")

    # -- trainer
    @rule()
    def get_batch(self):
        n, lo = self.version, self.version - self.k
        eligible = sorted(self.held, key=lambda r: (self.start[r], r))
        cap = math.floor(self.frac * self.B) if self.frac else self.B
        expected, at_lo = [], 0
        for rid in eligible:
            if len(expected) == self.B:
                break
            if self.start[rid] == lo:
                if at_lo == cap:
                    continue
                at_lo += 1
            expected.append(rid)
        over_cap = self.frac and sum(self.start[r] == lo for r in self.held) > cap
        event("get_batch: " + ("oldest version over the cap" if over_cap else "within the cap"))
        batch = self.buf.get_batch()
        event(f"get_batch: {'None' if batch is None else 'a batch'}")
        if len(expected) < self.B:
            assert batch is None
            return
        assert batch is not None and batch.request_ids == expected
        # the freshness rule, stated directly
        ages = [n - self.start[r] for r in batch.request_ids]
        assert all(0 <= a <= self.k for a in ages)
        if self.frac:
            assert ages.count(self.k) <= math.floor(self.frac * self.B)
            assert all(a <= math.floor(self.k - self.frac) or a == self.k for a in ages)
        assert batch.staleness == {a: ages.count(a) for a in sorted(set(ages))}
        assert batch.samples == [s for r in batch.request_ids for s in self._payload(r)]
        assert batch.policy_version.tolist() == [
            self.start[r] for r in batch.request_ids for _ in range(self.G)
        ]
        assert not set(batch.request_ids) & set(self.consumed)  # never twice
        self.consumed += batch.request_ids
        self.held -= set(batch.request_ids)
        self.batches_here += 1

    def _expire(self, max_version):
        gone_running = sorted(r for r in self.running if self.start[r] <= max_version)
        gone_held = {r for r in self.held if self.start[r] <= max_version}
        self.running -= set(gone_running)
        self.aborted |= set(gone_running)
        self.held -= gone_held
        self.dropped |= gone_held
        return gone_running

    @rule(step=st.integers(1, 3))
    def set_version(self, step):
        m = self.version + step
        expected = self._expire(m - self.k - 1)
        assert self.buf.set_version(m) == expected
        self.version, self.batches_here = m, 0

    @rule()
    def abort_expiring(self):
        if self.batches_here == 0:
            _unchanged(self.buf, self.buf.abort_expiring, "no batch drawn yet")
            return
        assert self.buf.abort_expiring() == self._expire(self.version - self.k)

    @rule(through_bytes=st.booleans())
    def checkpoint_restore(self, through_bytes):
        sd = self.buf.state_dict()
        if through_bytes:
            f = io.BytesIO()
            torch.save(sd, f)
            f.seek(0)
            sd = torch.load(f, weights_only=True)
        new = SampleBuffer(self.B, **{k: v for k, v in self.cfg.items() if k != "batch_size"})
        new.load_state_dict(sd)
        assert new.state_dict() == self.buf.state_dict()
        assert new.stats() == self.buf.stats()
        self.buf = new

    # -- invariants, checked after every step
    @invariant()
    def counts_match_the_model(self):
        s = self.buf.stats()
        assert s["reserved"] == self.next_id
        assert s["produced"] == len(self.produced)
        assert s["consumed"] == len(self.consumed) == len(set(self.consumed))
        assert s["dropped_stale"] == len(self.dropped)
        assert s["aborted"] == len(self.aborted)
        assert s["held"] == len(self.held) and s["running"] == len(self.running)
        assert s["version"] == self.version
        # conservation: every produced request is consumed once, dropped, or still held
        assert s["produced"] == s["consumed"] + s["dropped_stale"] + s["held"]
        assert s["reserved"] == s["produced"] + s["aborted"] + s["running"]
        assert self.produced == set(self.consumed) | self.dropped | self.held
        assert not (set(self.consumed) & self.dropped) and not (
            self.held & (set(self.consumed) | self.dropped)
        )
        assert sum(s["staleness_total"].values()) == s["consumed"]

    @invariant()
    def in_flight_is_bounded(self):
        in_flight = len(self.running) + len(self.held)
        assert self.buf.in_flight == in_flight <= self.bound
        assert in_flight + self.batches_here * self.B <= self.bound
        assert self.buf.free_slots == self.bound - in_flight - self.batches_here * self.B

    @invariant()
    def nothing_older_than_the_window_is_kept(self):
        lo = self.version - self.k
        assert all(self.start[r] >= lo for r in self.running | self.held)
        assert self.buf.running_ids() == sorted(self.running)

    def teardown(self):
        if not hasattr(self, "buf"):
            return
        # drain: far enough ahead everything still held expires; nothing is lost or duplicated
        self.buf.set_version(self.version + self.k + 1)
        s = self.buf.stats()
        assert s["held"] == 0 and s["running"] == 0 and s["in_flight"] == 0
        assert s["produced"] == s["consumed"] + s["dropped_stale"]
        assert s["reserved"] == s["produced"] + s["aborted"]


BufferMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_buffer_state_machine = BufferMachine.TestCase

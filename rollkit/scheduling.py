r"""Rollout scheduling policies of RollPacker: tail batching and the adaptive reward timeout.

Both come from RollPacker (Gao et al. 2025, "RollPacker: Mitigating Long-Tail Rollouts for
Fast, Synchronous RL Post-Training", arXiv:2509.21009, NSDI '26; code:
``github.com/Farrrrland/RollPacker``, built on ``alibaba/ROLL``). Both are pure bookkeeping
(no engine, no threads, no I/O, no clock) with an explicit, checkpointable state: the trainer
drives them and carries out their decisions in its own rollout engine and reward workers.

**Tail batching** (:class:`TailBatchingPolicy`). A step trains on :math:`P_0` prompts with
:math:`R_0` responses each. With the over-provisioning factors :math:`\eta_P, \eta_R \ge 1`
(the paper's :math:`\eta = 1.25` for both):

1. **Short round** (the long-prompt queue holds fewer than :math:`P_0` prompts at the start of
   the step): launch :math:`\lceil\eta_P P_0\rceil` fresh prompts, each asking for
   :math:`\lceil\eta_R R_0\rceil` responses. A prompt keeps the first :math:`R_0` responses that
   finish (it *completes*; its other responses are aborted); the round keeps the first
   :math:`P_0` prompts that complete. The moment the :math:`P_0`-th prompt completes, every
   other response still running is aborted and the prompts that had not completed go to the
   **long-prompt queue** (the prompt only: their partial responses are discarded).
2. **Long round** (the queue holds at least :math:`P_0` prompts at the start of the step):
   take the :math:`P_0` oldest queued prompts, exactly :math:`R_0` responses each, no
   over-provisioning: every response is kept.
3. Both rounds use the same length cap (``max_tokens``). With ``dynamic_sampling`` on (DAPO's
   filter of zero-variance groups), a prompt that would be queued is dropped instead when the
   rewards of its responses that finished before the abort all agree (at least two of them),
   and counted as ``dropped``.

A batch is therefore always :math:`P_0 \times R_0` responses of one round type, and, with
prompts drawn from an epoch iterator such as :class:`EpochSampler`, every prompt drawn is
trained on exactly once (or counted as dropped by dynamic sampling), across checkpoints.

**Adaptive timeout** (:class:`AdaptiveTimeout`). A code-execution reward runs the test cases
of a response with the timeout

.. math::

    T = \min\big(\max(T_\text{min},\ \lambda\, T_\text{anchor}),\ T_\text{max}\big)

where :math:`T_\text{anchor}` is the longest run time seen so far among the *correct*
solutions of that problem (the paper keys it per test case: use a ``(problem, test)`` key for
that), with the paper's :math:`\lambda = 1.5`, :math:`T_\text{min} = 2` s and
:math:`T_\text{max} = 30` s. Before any correct solution of a problem has been seen,
:math:`T = T_\text{max}` (no evidence, so the fixed timeout of the baseline; RollPacker's code
falls back to its fixed 30 s the same way).

>>> policy = TailBatchingPolicy(2, 2)                 # P0 = 2 prompts x R0 = 2 responses
>>> plan = policy.plan_step(iter(range(100)))          # short round: 3 prompts x 3 responses
>>> plan.round, [(r.request_id, r.prompt_id, r.num_responses) for r in plan.requests]
('short', [(0, 0, 3), (1, 1, 3), (2, 2, 3)])
>>> for rid, resp in [(1, 0), (2, 1), (0, 0)]:
...     d = policy.on_response_finished(rid, resp)   # kept, nothing to abort yet
>>> d = policy.on_response_finished(1, 2)              # prompt 1 has R0 = 2: abort its 3rd
>>> d.prompt_completed, d.round_complete, d.abort
(True, False, (1,))
>>> d = policy.on_response_finished(2, 0)              # the P0-th prompt completes
>>> d.round_complete, d.abort, d.deferred              # abort the rest; prompt 0 -> queue
(True, (2, 0), (0,))
>>> batch = policy.finish_step()
>>> batch.prompt_ids, batch.responses, policy.queue
((1, 2), ((0, 2), (1, 0)), (0,))
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

from rollkit.validation import check_int, check_scalar

__all__ = [
    "AdaptiveTimeout",
    "Decision",
    "EpochSampler",
    "PromptRequest",
    "RoundPlan",
    "TailBatch",
    "TailBatchingPolicy",
]

RoundType = Literal["short", "long"]

_COUNTS = (
    "drawn",
    "trained",
    "dropped",
    "deferred",
    "short_rounds",
    "long_rounds",
    "launched_responses",
    "aborted_responses",
    "discarded_responses",
)


def _positive_int(name: str, value: object) -> int:
    v = check_int(name, value)
    if v < 1:
        raise ValueError(f"{name}: must be an int >= 1, got {v}")
    return v


def _eta(name: str, value: object) -> Fraction:
    """``value`` as the exact fraction of the decimal written (``1.1`` is 11/10), ``>= 1``."""
    x = check_scalar(name, value)
    if not math.isfinite(x) or x < 1:
        raise ValueError(f"{name}: must be a finite number >= 1 (1 = no over-provisioning), got {value!r}")
    return Fraction(repr(x))


def _ceil(eta: Fraction, n: int) -> int:
    """:math:`\\lceil \\eta n\\rceil`, exact (``1.1 * 10`` is 11, not the float 11.000000000000002)."""
    return math.ceil(eta * n)


# --------------------------------------------------------------------------- epoch iterator


class EpochSampler:
    """An endless, checkpointable iterator over the prompts of a data set, epoch after epoch.

    Yields prompt ids ``epoch * num_prompts + index`` (ints), ``index`` the prompt's position in
    the data set: the same prompt in two epochs has two ids, so a scheduler can tell them apart,
    and :meth:`split` recovers ``(epoch, index)``. Each epoch is a permutation of
    ``range(num_prompts)``, shuffled with a generator seeded by ``(seed, epoch)`` (so the order
    depends on nothing but those two), or in data-set order with ``shuffle=False``. The state is
    two ints (``epoch``, ``position``).

    >>> s = EpochSampler(3, shuffle=False)
    >>> [next(s) for _ in range(5)]
    [0, 1, 2, 3, 4]
    >>> s.split(4)                     # epoch 1, prompt 1 of the data set
    (1, 1)
    >>> t = EpochSampler(3, shuffle=False)
    >>> t.load_state_dict(s.state_dict())
    >>> next(t) == next(s) == 5
    True
    """

    def __init__(self, num_prompts: int, *, shuffle: bool = True, seed: int = 0) -> None:
        self.num_prompts = _positive_int("num_prompts", num_prompts)
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle: expected a bool, got {type(shuffle).__name__}")
        self.shuffle = shuffle
        self.seed = check_int("seed", seed)
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(self.num_prompts))
            if self.shuffle:
                random.Random(f"rollkit.EpochSampler/{self.seed}/{self.epoch}").shuffle(order)
            self._order = order
        return self._order

    def __iter__(self) -> EpochSampler:
        return self

    def __next__(self) -> int:
        pid = self.epoch * self.num_prompts + self._epoch_order()[self.position]
        self.position += 1
        if self.position == self.num_prompts:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return pid

    def split(self, prompt_id: int) -> tuple[int, int]:
        """``(epoch, index)`` of an id this sampler yields."""
        pid = check_int("prompt_id", prompt_id)
        if pid < 0:
            raise ValueError(f"prompt_id: must be >= 0, got {pid}")
        return divmod(pid, self.num_prompts)

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_prompts": self.num_prompts,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; ``num_prompts``, ``shuffle`` and ``seed`` must match."""
        if not isinstance(state, Mapping):
            raise ValueError(f"state: expected a mapping, got {type(state).__name__}")
        for key in ("num_prompts", "shuffle", "seed"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"state: {key} is {state.get(key)!r} in the checkpoint but {getattr(self, key)!r} here"
                )
        epoch = check_int("state['epoch']", state.get("epoch"))
        position = check_int("state['position']", state.get("position"))
        if epoch < 0 or not 0 <= position < self.num_prompts:
            raise ValueError(f"state: epoch {epoch} / position {position} out of range")
        self.epoch, self.position, self._order = epoch, position, None


# --------------------------------------------------------------------------- tail batching


@dataclass(frozen=True)
class PromptRequest:
    """One prompt launched in a round.

    Attributes:
        request_id: unique over the policy's life (also across rounds, checkpoints and
            re-launches of the same prompt): the key of :meth:`TailBatchingPolicy.on_response_finished`
            and of the ``abort`` lists.
        prompt_id: the caller's prompt id (opaque: any value, e.g. an :class:`EpochSampler` id).
        num_responses: responses to sample for it, numbered ``0 .. num_responses - 1``.
    """

    request_id: int
    prompt_id: Any
    num_responses: int


@dataclass(frozen=True)
class RoundPlan:
    """What to launch for a step (from :meth:`TailBatchingPolicy.plan_step`).

    Attributes:
        step: the step number (0-based, advanced by ``finish_step``).
        round: ``"short"`` (over-provisioned fresh prompts) or ``"long"`` (queued prompts).
        requests: the prompts to launch with their request ids and response counts.
        prompts_to_keep: :math:`P_0`.
        responses_to_keep: :math:`R_0`.
        max_tokens: the length cap of every response, the same in both rounds (``None``: the
            engine's own).
    """

    step: int
    round: RoundType
    requests: tuple[PromptRequest, ...]
    prompts_to_keep: int
    responses_to_keep: int
    max_tokens: int | None

    @property
    def prompt_ids(self) -> tuple[Any, ...]:
        return tuple(r.prompt_id for r in self.requests)

    @property
    def num_responses(self) -> int:
        """Responses launched in all."""
        return sum(r.num_responses for r in self.requests)


@dataclass(frozen=True)
class Decision:
    """What to do after a response finished (from :meth:`TailBatchingPolicy.on_response_finished`).

    Attributes:
        request_id, response_id: the response reported.
        keep: the response is one of the batch's :math:`P_0 \\times R_0`. A response that
            finishes after its prompt completed, after its prompt was deferred, or after the
            round completed is not kept (it raced the abort).
        prompt_completed: this response was its prompt's :math:`R_0`-th kept one.
        round_complete: this response completed the :math:`P_0`-th prompt: the batch is
            full; call ``finish_step``.
        abort: request ids whose still-running responses the engine should abort now (the
            completed prompt's surplus responses; when the round completes, every other
            request with responses still running as well).
        deferred: when the round completes, the prompt ids that had not completed (in launch
            order): they go to the long-prompt queue at ``finish_step`` unless dynamic
            sampling drops them.
        stale: the request belongs to an earlier round (or a round rolled back by a
            checkpoint restore): ignore the response.
    """

    request_id: int
    response_id: int
    keep: bool = False
    prompt_completed: bool = False
    round_complete: bool = False
    abort: tuple[int, ...] = ()
    deferred: tuple[Any, ...] = ()
    stale: bool = False


@dataclass(frozen=True)
class TailBatch:
    """The step's training batch (from :meth:`TailBatchingPolicy.finish_step`).

    Attributes:
        step: the step number.
        round: ``"short"`` or ``"long"``: every prompt of the batch comes from that round.
        requests: the :math:`P_0` completed requests, in completion order.
        responses: for each request, the ids of its :math:`R_0` kept responses, in finish order.
        queued: prompt ids added to the long-prompt queue at this step.
        dropped: prompt ids dropped by dynamic sampling at this step (never trained).
        metrics: ``tail/long_round`` (1.0 for a long round), ``tail/queue_length`` (after this
            step), ``tail/aborted_responses`` (launched but not reported finished when the step
            ended), ``tail/discarded_responses`` (finished but not kept),
            ``tail/deferred_prompts``, ``tail/dropped_prompts``, ``tail/launched_prompts``,
            ``tail/launched_responses``.
    """

    step: int
    round: RoundType
    requests: tuple[PromptRequest, ...]
    responses: tuple[tuple[int, ...], ...]
    queued: tuple[Any, ...]
    dropped: tuple[Any, ...]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def prompt_ids(self) -> tuple[Any, ...]:
        return tuple(r.prompt_id for r in self.requests)

    @property
    def request_ids(self) -> tuple[int, ...]:
        return tuple(r.request_id for r in self.requests)


class _Round:
    """The state of the round in progress (never part of a checkpoint: see ``state_dict``)."""

    def __init__(self, plan: RoundPlan) -> None:
        self.plan = plan
        self.first_id = plan.requests[0].request_id
        self.by_id = {r.request_id: r for r in plan.requests}
        self.finished: dict[int, set[int]] = {r.request_id: set() for r in plan.requests}
        self.kept: dict[int, list[int]] = {r.request_id: [] for r in plan.requests}
        self.completed: list[int] = []
        self.complete = False

    def running(self, rid: int) -> bool:
        return len(self.finished[rid]) < self.by_id[rid].num_responses


class TailBatchingPolicy:
    r"""RollPacker's tail batching as an event-driven state machine (rules: module docstring).

    Args:
        prompts_per_step: :math:`P_0 \ge 1`, prompts per training batch.
        responses_per_prompt: :math:`R_0 \ge 1`, responses per prompt (the GRPO group size).
        eta_prompts: :math:`\eta_P \ge 1`; a short round launches
            :math:`\lceil\eta_P P_0\rceil` prompts (exact on the decimal given: ``1.1`` is
            :math:`11/10`). Paper default 1.25.
        eta_responses: :math:`\eta_R \ge 1`; a short-round prompt asks for
            :math:`\lceil\eta_R R_0\rceil` responses. Paper default 1.25.
        dynamic_sampling: drop, rather than queue, deferred prompts whose finished responses'
            rewards (passed to :meth:`finish_step`) have zero variance.
        max_tokens: the length cap reported in every :class:`RoundPlan` (both rounds).

    The trainer's loop, one step::

        plan = policy.plan_step(sampler)               # what to launch
        engine.launch(plan.requests, max_tokens=plan.max_tokens)
        while True:
            rid, resp = engine.next_finished()
            d = policy.on_response_finished(rid, resp)
            engine.abort(d.abort)                      # surplus / everything else
            if d.round_complete:
                break
        batch = policy.finish_step(rewards)            # P0 x R0 of one round; metrics

    ``prompt_ids`` are opaque to the policy; ``request_id`` s are its own (unique for its whole
    life), so a prompt launched twice (re-launched from the queue, or the same data-set prompt
    in two epochs) never mixes up the reports. Conservation, at every moment and across
    ``state_dict`` / ``load_state_dict``: ``drawn == trained + dropped + queued + replay +
    in_round`` (the :attr:`counts`, in prompts).

    >>> p = TailBatchingPolicy(4, 8)
    >>> p.launch_prompts, p.launch_responses        # ceil(1.25 * 4), ceil(1.25 * 8)
    (5, 10)
    >>> TailBatchingPolicy(3, 3).launch_prompts     # ceil(3.75)
    4
    """

    def __init__(
        self,
        prompts_per_step: int,
        responses_per_prompt: int,
        *,
        eta_prompts: float = 1.25,
        eta_responses: float = 1.25,
        dynamic_sampling: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        self.prompts_per_step = _positive_int("prompts_per_step", prompts_per_step)
        self.responses_per_prompt = _positive_int("responses_per_prompt", responses_per_prompt)
        self._eta_p = _eta("eta_prompts", eta_prompts)
        self._eta_r = _eta("eta_responses", eta_responses)
        if not isinstance(dynamic_sampling, bool):
            raise ValueError(f"dynamic_sampling: expected a bool, got {type(dynamic_sampling).__name__}")
        self.dynamic_sampling = dynamic_sampling
        self.max_tokens = None if max_tokens is None else _positive_int("max_tokens", max_tokens)
        self.launch_prompts = _ceil(self._eta_p, self.prompts_per_step)
        self.launch_responses = _ceil(self._eta_r, self.responses_per_prompt)
        self._queue: deque[Any] = deque()
        self._replay: deque[Any] = deque()
        self._round: _Round | None = None
        self._step = 0
        self._next_id = 0
        self._counts = dict.fromkeys(_COUNTS, 0)

    # ------------------------------------------------------------------ read-only views

    @property
    def eta_prompts(self) -> float:
        return float(self._eta_p)

    @property
    def eta_responses(self) -> float:
        return float(self._eta_r)

    @property
    def step(self) -> int:
        """The current step number (the next or running round's)."""
        return self._step

    @property
    def queue(self) -> tuple[Any, ...]:
        """The long-prompt queue, oldest first."""
        return tuple(self._queue)

    @property
    def replay(self) -> tuple[Any, ...]:
        """Fresh prompts of a short round rolled back by a checkpoint restore; the next short
        round launches them before drawing new ones."""
        return tuple(self._replay)

    @property
    def current_round(self) -> RoundPlan | None:
        """The plan of the round in progress, ``None`` between steps."""
        return None if self._round is None else self._round.plan

    @property
    def counts(self) -> dict[str, int]:
        """Cumulative counts: prompts ``drawn`` from the fresh source, ``trained`` (in a batch),
        ``dropped`` (dynamic sampling), ``deferred`` (sent to the queue, a prompt once per
        deferral), ``short_rounds`` / ``long_rounds``, and responses ``launched_responses`` /
        ``aborted_responses`` / ``discarded_responses``; plus the current ``queued``,
        ``replay`` and ``in_round`` prompt counts."""
        out = dict(self._counts)
        out["queued"] = len(self._queue)
        out["replay"] = len(self._replay)
        out["in_round"] = 0 if self._round is None else len(self._round.plan.requests)
        return out

    # ------------------------------------------------------------------ the step

    def next_round(self) -> RoundType:
        """The type of the next round: ``"long"`` iff the queue holds at least :math:`P_0` prompts."""
        return "long" if len(self._queue) >= self.prompts_per_step else "short"

    def plan_step(self, fresh: Iterator[Any]) -> RoundPlan:
        """Start a step: a long round if the queue holds :math:`\\ge P_0` prompts, else a short one.

        ``fresh`` is an *iterator* of prompt ids (an :class:`EpochSampler`, ``iter(ids)``): a
        short round takes :math:`\\lceil\\eta_P P_0\\rceil` prompts, first from :attr:`replay`
        then from ``next(fresh)`` (never more than it needs); a long round does not touch it.
        """
        if self._round is not None:
            raise ValueError(f"plan_step: step {self._step} is still running; call finish_step first")
        if isinstance(fresh, (str, bytes)) or not isinstance(fresh, Iterator):
            raise TypeError(
                f"fresh: expected an iterator of prompt ids (EpochSampler, iter(ids)), got "
                f"{type(fresh).__name__} (a list would restart at every step)"
            )
        if self.next_round() == "long":
            kind: RoundType = "long"
            prompts = [self._queue.popleft() for _ in range(self.prompts_per_step)]
            n_resp = self.responses_per_prompt
        else:
            kind = "short"
            prompts = []
            while self._replay and len(prompts) < self.launch_prompts:
                prompts.append(self._replay.popleft())
            while len(prompts) < self.launch_prompts:
                try:
                    prompts.append(next(fresh))
                except StopIteration:
                    self._replay.extendleft(reversed(prompts))  # nothing is lost
                    raise ValueError(
                        f"fresh: ran out of prompts: a short round needs {self.launch_prompts}, "
                        f"got {len(prompts)} (kept for the next plan_step; use an endless "
                        f"iterator such as EpochSampler)"
                    ) from None
                self._counts["drawn"] += 1
            n_resp = self.launch_responses
        requests = tuple(PromptRequest(self._next_id + i, pid, n_resp) for i, pid in enumerate(prompts))
        self._next_id += len(requests)
        plan = RoundPlan(
            step=self._step,
            round=kind,
            requests=requests,
            prompts_to_keep=self.prompts_per_step,
            responses_to_keep=self.responses_per_prompt,
            max_tokens=self.max_tokens,
        )
        self._round = _Round(plan)
        return plan

    def on_response_finished(self, request_id: int, response_id: int) -> Decision:
        """Record that response ``response_id`` of request ``request_id`` finished.

        Returns the :class:`Decision` (keep it? abort what? is the batch full?). A request of an
        earlier round gives ``stale=True``; an id never issued, a response id out of range, or
        the same response twice raises ``ValueError``.
        """
        rid = check_int("request_id", request_id)
        resp = check_int("response_id", response_id)
        if rid < 0 or rid >= self._next_id:
            raise ValueError(f"request_id: unknown request {rid} (ids so far: 0..{self._next_id - 1})")
        rnd = self._round
        if rnd is None or rid < rnd.first_id:
            return Decision(rid, resp, stale=True)
        req = rnd.by_id[rid]
        if not 0 <= resp < req.num_responses:
            raise ValueError(
                f"response_id: request {rid} has responses 0..{req.num_responses - 1}, got {resp}"
            )
        if resp in rnd.finished[rid]:
            raise ValueError(f"response_id: response {resp} of request {rid} was already reported")
        rnd.finished[rid].add(resp)
        kept = rnd.kept[rid]
        if rnd.complete or len(kept) >= self.responses_per_prompt:
            return Decision(rid, resp)  # raced the abort: discarded
        kept.append(resp)
        if len(kept) < self.responses_per_prompt:
            return Decision(rid, resp, keep=True)
        rnd.completed.append(rid)
        abort = [rid] if rnd.running(rid) else []
        deferred: tuple[Any, ...] = ()
        if len(rnd.completed) == self.prompts_per_step:
            rnd.complete = True
            done = set(rnd.completed)
            others = [r for r in rnd.plan.requests if r.request_id not in done]
            abort += [r.request_id for r in others if rnd.running(r.request_id)]
            deferred = tuple(r.prompt_id for r in others)
        return Decision(
            rid,
            resp,
            keep=True,
            prompt_completed=True,
            round_complete=rnd.complete,
            abort=tuple(abort),
            deferred=deferred,
        )

    def finish_step(self, rewards_by_request: Mapping[int, Sequence[float]] | None = None) -> TailBatch:
        """End the step once the round is complete: queue (or drop) the deferred prompts and
        return the batch.

        ``rewards_by_request`` (used only with ``dynamic_sampling``) maps request ids of this
        round to the rewards of their finished responses; a deferred prompt with at least two
        rewards, all equal, is dropped instead of queued. Other requests' entries are ignored.
        """
        rnd = self._round
        if rnd is None:
            raise ValueError("finish_step: no step is running; call plan_step first")
        if not rnd.complete:
            raise ValueError(
                f"finish_step: the round is not complete: {len(rnd.completed)} of "
                f"{self.prompts_per_step} prompts have {self.responses_per_prompt} finished responses"
            )
        rewards = self._check_rewards(rnd, rewards_by_request)
        done = set(rnd.completed)
        queued, dropped = [], []
        for r in rnd.plan.requests:
            if r.request_id in done:
                continue
            rew = rewards.get(r.request_id, ())
            if self.dynamic_sampling and len(rew) >= 2 and max(rew) == min(rew):
                dropped.append(r.prompt_id)
            else:
                queued.append(r.prompt_id)
        self._queue.extend(queued)
        launched = rnd.plan.num_responses
        finished = sum(len(s) for s in rnd.finished.values())
        kept = self.prompts_per_step * self.responses_per_prompt
        c = self._counts
        c["trained"] += len(done)
        c["dropped"] += len(dropped)
        c["deferred"] += len(queued) + len(dropped)
        c["short_rounds" if rnd.plan.round == "short" else "long_rounds"] += 1
        c["launched_responses"] += launched
        c["aborted_responses"] += launched - finished
        c["discarded_responses"] += finished - kept
        by_id = rnd.by_id
        batch = TailBatch(
            step=self._step,
            round=rnd.plan.round,
            requests=tuple(by_id[rid] for rid in rnd.completed),
            responses=tuple(tuple(rnd.kept[rid]) for rid in rnd.completed),
            queued=tuple(queued),
            dropped=tuple(dropped),
            metrics={
                "tail/long_round": float(rnd.plan.round == "long"),
                "tail/queue_length": float(len(self._queue)),
                "tail/aborted_responses": float(launched - finished),
                "tail/discarded_responses": float(finished - kept),
                "tail/deferred_prompts": float(len(queued)),
                "tail/dropped_prompts": float(len(dropped)),
                "tail/launched_prompts": float(len(rnd.plan.requests)),
                "tail/launched_responses": float(launched),
            },
        )
        self._round = None
        self._step += 1
        return batch

    def _check_rewards(
        self, rnd: _Round, rewards: Mapping[int, Sequence[float]] | None
    ) -> dict[int, list[float]]:
        if rewards is None:
            return {}
        if not isinstance(rewards, Mapping):
            raise TypeError(f"rewards_by_request: expected a mapping, got {type(rewards).__name__}")
        out = {}
        for key, values in rewards.items():
            rid = check_int("rewards_by_request key", key)
            if rid not in rnd.by_id:
                raise ValueError(f"rewards_by_request: request {rid} is not part of step {self._step}")
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                raise TypeError(
                    f"rewards_by_request[{rid}]: expected a sequence of numbers, got {type(values).__name__}"
                )
            vals = [check_scalar(f"rewards_by_request[{rid}]", v) for v in values]
            if not all(math.isfinite(v) for v in vals):
                raise ValueError(f"rewards_by_request[{rid}]: rewards must be finite, got {vals}")
            if len(vals) > len(rnd.finished[rid]):
                raise ValueError(
                    f"rewards_by_request[{rid}]: {len(vals)} rewards but only "
                    f"{len(rnd.finished[rid])} responses of request {rid} finished"
                )
            out[rid] = vals
        return out

    # ------------------------------------------------------------------ checkpoints

    def _config(self) -> dict[str, Any]:
        return {
            "prompts_per_step": self.prompts_per_step,
            "responses_per_prompt": self.responses_per_prompt,
            "eta_prompts": str(self._eta_p),
            "eta_responses": str(self._eta_r),
            "dynamic_sampling": self.dynamic_sampling,
            "max_tokens": self.max_tokens,
        }

    def state_dict(self) -> dict[str, Any]:
        """The whole state as plain Python (ints, strs, lists, dicts; prompt ids as given).

        Taken during a round, it *rolls the round back*: the running round's prompts are
        recorded as not launched (a long round's back at the front of the queue, a short
        round's in :attr:`replay`), since the engine's requests do not survive a restart.
        The live policy is not changed.
        """
        queue, replay = list(self._queue), list(self._replay)
        if self._round is not None:
            ids = list(self._round.plan.prompt_ids)
            if self._round.plan.round == "long":
                queue = ids + queue
            else:
                replay = ids + replay
        return {
            "config": self._config(),
            "step": self._step,
            "next_request_id": self._next_id,
            "queue": queue,
            "replay": replay,
            "counts": dict(self._counts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (validated entirely before anything changes; the
        configuration must match). A round in progress here is abandoned: its requests, and
        any request id below the restored ``next_request_id``, report ``stale`` from now on
        (request ids never go backwards, even when restoring an older checkpoint in the same
        process)."""
        if not isinstance(state, Mapping):
            raise ValueError(f"state: expected a mapping, got {type(state).__name__}")
        missing = [
            k for k in ("config", "step", "next_request_id", "queue", "replay", "counts") if k not in state
        ]
        if missing:
            raise ValueError(f"state: missing entries {missing}")
        if dict(state["config"]) != self._config():
            raise ValueError(
                f"state: the checkpoint's configuration {dict(state['config'])} differs from this "
                f"policy's {self._config()}"
            )
        step = check_int("state['step']", state["step"])
        next_id = check_int("state['next_request_id']", state["next_request_id"])
        if step < 0 or next_id < 0:
            raise ValueError(f"state: step ({step}) and next_request_id ({next_id}) must be >= 0")
        for key in ("queue", "replay"):
            if not isinstance(state[key], (list, tuple)):
                raise ValueError(f"state['{key}']: expected a list, got {type(state[key]).__name__}")
        counts_in = state["counts"]
        if not isinstance(counts_in, Mapping) or set(counts_in) != set(_COUNTS):
            raise ValueError(f"state['counts']: expected the keys {list(_COUNTS)}")
        counts = {k: check_int(f"state['counts'][{k!r}]", counts_in[k]) for k in _COUNTS}
        if any(v < 0 for v in counts.values()):
            raise ValueError(f"state['counts']: counts must be >= 0, got {counts}")
        held = len(state["queue"]) + len(state["replay"])
        if counts["drawn"] != counts["trained"] + counts["dropped"] + held:
            raise ValueError(
                f"state: inconsistent counts: drawn {counts['drawn']} != trained {counts['trained']} "
                f"+ dropped {counts['dropped']} + queued/replay {held}"
            )
        self._queue = deque(state["queue"])
        self._replay = deque(state["replay"])
        self._round = None
        self._step = step
        self._next_id = max(next_id, self._next_id)
        self._counts = counts


# --------------------------------------------------------------------------- adaptive timeout


class AdaptiveTimeout:
    r"""RollPacker's adaptive timeout of code execution: :math:`T = \min(\max(T_\text{min},
    \lambda T_\text{anchor}), T_\text{max})`.

    Args:
        lam: :math:`\lambda > 0`, slack over the anchor (paper: 1.5).
        t_min: :math:`T_\text{min} \ge 0` seconds, floor of the timeout (paper: 2).
        t_max: :math:`T_\text{max}` seconds, finite, :math:`\ge T_\text{min}` and :math:`> 0`:
            the ceiling, and the timeout of a problem with no correct solution seen yet
            (paper: 30, the fixed timeout it replaces).

    :math:`T_\text{anchor}` of a problem is the longest ``run_seconds`` passed to
    :meth:`observe` with ``correct=True`` for it; incorrect runs (wrong answers, timeouts) never
    move it. Problem ids are any hashable values (a problem id, or ``(problem, test_case)`` as
    in the paper).

    >>> t = AdaptiveTimeout()
    >>> t.timeout("p1")                      # nothing correct seen yet: T_max
    30.0
    >>> t.observe("p1", 4.0, correct=True)   # 1.5 * 4
    6.0
    >>> t.observe("p1", 3.0, correct=True)   # the anchor is the longest correct run
    6.0
    >>> t.observe("p2", 0.1, correct=True)   # floored at T_min
    2.0
    >>> t.observe("p3", 25.0, correct=True)  # capped at T_max
    30.0
    """

    def __init__(self, *, lam: float = 1.5, t_min: float = 2.0, t_max: float = 30.0) -> None:
        lam_f = check_scalar("lam", lam)
        if not math.isfinite(lam_f) or lam_f <= 0:
            raise ValueError(f"lam: must be a finite number > 0, got {lam!r}")
        t_min_f = check_scalar("t_min", t_min)
        if not math.isfinite(t_min_f) or t_min_f < 0:
            raise ValueError(f"t_min: must be a finite number of seconds >= 0, got {t_min!r}")
        t_max_f = check_scalar("t_max", t_max)
        if not math.isfinite(t_max_f) or t_max_f <= 0:
            raise ValueError(f"t_max: must be a finite number of seconds > 0, got {t_max!r}")
        if t_max_f < t_min_f:
            raise ValueError(f"t_max: must be >= t_min ({t_min_f}), got {t_max_f}")
        self.lam, self.t_min, self.t_max = lam_f, t_min_f, t_max_f
        self._anchor: dict[Hashable, float] = {}

    def _key(self, problem_id: object) -> Hashable:
        try:
            hash(problem_id)
        except TypeError:
            raise TypeError(f"problem_id: expected a hashable id, got {type(problem_id).__name__}") from None
        return problem_id  # type: ignore[return-value]

    def anchor(self, problem_id: Hashable) -> float | None:
        """:math:`T_\\text{anchor}` of the problem, ``None`` before a correct run was seen."""
        return self._anchor.get(self._key(problem_id))

    def timeout(self, problem_id: Hashable) -> float:
        """The timeout, in seconds, for the next run of the problem's tests."""
        a = self._anchor.get(self._key(problem_id))
        if a is None:
            return self.t_max
        return min(max(self.t_min, self.lam * a), self.t_max)

    def observe(self, problem_id: Hashable, run_seconds: float, *, correct: bool) -> float:
        """Record a finished run; returns the problem's new timeout."""
        key = self._key(problem_id)
        secs = check_scalar("run_seconds", run_seconds)
        if not math.isfinite(secs) or secs < 0:
            raise ValueError(f"run_seconds: must be a finite number >= 0, got {run_seconds!r}")
        if not isinstance(correct, bool):
            raise TypeError(f"correct: expected a bool, got {type(correct).__name__}")
        if correct and secs > self._anchor.get(key, -1.0):
            self._anchor[key] = secs
        return self.timeout(key)

    def __len__(self) -> int:
        """Number of problems with an anchor."""
        return len(self._anchor)

    def state_dict(self) -> dict[str, Any]:
        return {"lam": self.lam, "t_min": self.t_min, "t_max": self.t_max, "anchors": dict(self._anchor)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; ``lam``, ``t_min`` and ``t_max`` must match."""
        if not isinstance(state, Mapping):
            raise ValueError(f"state: expected a mapping, got {type(state).__name__}")
        for key in ("lam", "t_min", "t_max"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"state: {key} is {state.get(key)!r} in the checkpoint but {getattr(self, key)!r} here"
                )
        anchors = state.get("anchors")
        if not isinstance(anchors, Mapping):
            raise ValueError(f"state['anchors']: expected a mapping, got {type(anchors).__name__}")
        out = {}
        for k, v in anchors.items():
            secs = check_scalar(f"state['anchors'][{k!r}]", v)
            if not math.isfinite(secs) or secs < 0:
                raise ValueError(f"state['anchors'][{k!r}]: must be a finite number >= 0, got {v!r}")
            out[self._key(k)] = secs
        self._anchor = out

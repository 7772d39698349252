r"""A freshness-bounded sample buffer for asynchronous RL (the async ratio of ROLL Flash / RollArt).

In asynchronous RL the rollout engines keep generating while the trainer updates the weights,
so a sample may be *started* by an older policy than the one that trains on it. The buffer
records, for every request, the ``policy_version`` that started it, and bounds the staleness
with the **async ratio** :math:`\alpha \ge 0` (``async_ratio``) of ROLL Flash (Lu et al. 2025,
"Part II: ROLL Flash -- Accelerating RLVR and Agentic Training with Asynchrony",
arXiv:2510.11345) and RollArt (Gao et al. 2025, arXiv:2512.22560), both built on
``alibaba/ROLL``. With the trainer at version :math:`n`, :math:`k = \lceil\alpha\rceil`,
:math:`f = \alpha - \lfloor\alpha\rfloor` and batch size :math:`B`:

.. math::

    \text{a sample started at version } v \text{ may be trained at } n
        \iff n - k \le v \le n,
    \qquad
    \#\{\text{requests of the batch with } v = n - k\} \le
        \begin{cases} \lfloor f B \rfloor & f > 0 \\ B & f = 0 \end{cases}

* **Freshness.** Every trained sample was started by a policy at most :math:`\lceil\alpha\rceil`
  versions old: versions :math:`n - \lfloor\alpha\rfloor \ldots n` freely and, when
  :math:`\alpha` is fractional, the oldest allowed version :math:`n - \lceil\alpha\rceil` for
  at most :math:`\lfloor f B\rfloor` requests of each batch (so only the fraction :math:`f` of
  a batch is :math:`\lceil\alpha\rceil` versions old). ``alpha = 1.5``, ``B = 4``: versions
  ``n - 1`` and ``n`` freely, at most 2 requests of version ``n - 2``. ``alpha = 0``: only
  version ``n`` (the synchronous trainer).
* **Expiry.** ``set_version(m)`` aborts the running requests and drops (counted as
  ``dropped_stale``) the finished ones with :math:`v < m - \lceil\alpha\rceil`: they can never
  be trained again. ROLL aborts them one step earlier, as soon as version ``n``'s batch is drawn
  (its ``ReplayBuffer.gc``): :meth:`SampleBuffer.abort_expiring` does that.
* **In-flight bound.** A request occupies one of ``max_in_flight`` slots (default
  :math:`\lceil(1 + \alpha) B\rceil`) from ``reserve`` until it is aborted or dropped as
  stale or, if it is trained, until the next ``set_version``:
  :math:`\mathrm{running} + \mathrm{held} + \mathrm{consumed\ at\ this\ version}
  \le \mathrm{max\_in\_flight}`, and ``reserve`` refuses more. So at most
  :math:`\lceil(1 + \alpha) B\rceil` requests are in flight (running or finished and not
  consumed), and once the version's batch is drawn at most :math:`\lceil\alpha B\rceil` are,
  until the new weights arrive: the slots freed by training start fresh requests under the new
  version. This is ROLL's budget (``ReplayBuffer``: running + completed below
  :math:`\lceil\alpha B\rceil + B` per step); freeing the slots at consumption instead could
  fill the buffer with requests of the oldest version, of which a batch may only use
  :math:`\lfloor f B\rfloor`, and deadlock the trainer.
* **Conservation.** Every finished request is consumed exactly once or dropped as stale:
  ``produced == consumed + dropped_stale + held`` and
  ``reserved == produced + aborted + running`` at all times, across ``state_dict`` /
  ``load_state_dict``.

Units: ``batch_size`` and every count are in **requests** (prompts); a request yields
``group_size`` samples (a GRPO group) that are admitted and consumed together, so a batch holds
``batch_size * group_size`` samples. Sample payloads are opaque (a dict, a TensorDict, ...).

The buffer is pure bookkeeping: no threads, no I/O, no engine. The trainer drives it (see
``docs/async.md``): the producer calls ``reserve`` / ``put`` / ``abort``, the trainer
``get_batch`` / ``set_version`` and aborts, in its engine, the ids that ``set_version`` returns.

>>> buf = SampleBuffer(2, async_ratio=1.0)          # 2 requests per batch, at most 4 in flight
>>> ids = buf.reserve(4)                             # started by version 0
>>> for rid in ids:
...     buf.put(rid, f"sample-{rid}")
>>> buf.get_batch().samples                          # oldest first
['sample-0', 'sample-1']
>>> buf.set_version(1)                               # nothing to abort: version 0 is 1 old
[]
>>> batch = buf.get_batch()
>>> batch.samples, batch.staleness                   # {n - v: requests}
(['sample-2', 'sample-3'], {1: 2})
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from rollkit.registry import POLICY_LOSSES
from rollkit.validation import check_int, check_scalar, check_tensor

__all__ = ["Batch", "SampleBuffer", "off_policy_loss_inputs", "staleness_metrics"]

_COUNTS = ("reserved", "produced", "consumed", "dropped_stale", "aborted", "batches")


@dataclass(frozen=True)
class Batch:
    """A training batch drawn by :meth:`SampleBuffer.get_batch`.

    Attributes:
        samples: ``batch_size * group_size`` payloads, the ``group_size`` samples of a request
            contiguous, requests oldest first (by start version, then request id).
        request_ids: ``[batch_size]`` ids of the requests, in batch order.
        start_versions: ``[batch_size]`` version that started each request.
        version: the trainer version ``n`` the batch was drawn at.
        group_size: samples per request.
        staleness: ``{n - v: number of requests}``, sorted by staleness.
    """

    samples: list[Any]
    request_ids: list[int]
    start_versions: list[int]
    version: int
    group_size: int
    staleness: dict[int, int]

    @property
    def policy_version(self) -> Tensor:
        """``[batch_size * group_size]`` int64: the start version of each sample (the
        ``policy_version`` batch key)."""
        return torch.tensor(self.start_versions, dtype=torch.int64).repeat_interleave(self.group_size)

    @property
    def group_ids(self) -> Tensor:
        """``[batch_size * group_size]`` int64: the request id of each sample (the ``group_ids``
        key for group-wise estimators such as GRPO)."""
        return torch.tensor(self.request_ids, dtype=torch.int64).repeat_interleave(self.group_size)


def _ratio(name: str, value: object) -> Fraction:
    """``value`` as an exact fraction of the decimal the user wrote (``1.3`` -> 13/10)."""
    x = check_scalar(name, value)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
    return Fraction(repr(x))


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    v = check_int(name, value)
    if v < minimum:
        raise ValueError(f"{name}: must be an int >= {minimum}, got {v}")
    return v


class SampleBuffer:
    r"""Freshness-bounded, transactional, checkpointable buffer of rollout requests.

    Args:
        batch_size: requests (prompts) per training batch, ``>= 1``.
        async_ratio: :math:`\alpha \ge 0`, may be fractional. ``0`` is synchronous training.
        group_size: samples per request (GRPO group size), ``>= 1``; ``put`` takes a sequence
            of exactly ``group_size`` samples when it is ``> 1``.
        max_in_flight: number of request slots (running + finished-and-held + consumed at
            the current version); default
            :math:`\lceil(1 + \alpha)\,\mathrm{batch\_size}\rceil`; must be ``>= batch_size``.
        initial_version: the trainer's version at the start (``0``: the initial weights).

    The rule (module docstring): at trainer version :math:`n`, :meth:`get_batch` takes requests
    started at :math:`v \in [n - \lceil\alpha\rceil, n]`, oldest first (by ``(v, request id)``),
    at most :math:`\lfloor (\alpha - \lfloor\alpha\rfloor)\,B \rfloor` of them from
    :math:`v = n - \lceil\alpha\rceil` when :math:`\alpha` is fractional (the fraction is
    computed exactly on the decimal given, ``Fraction(repr(alpha))``). With ``async_ratio=0``
    and the synchronous schedule (reserve ``batch_size``, finish them all, ``get_batch``,
    ``set_version(n + 1)``) it returns exactly the reserved requests in reservation order.

    Every method validates its input before changing anything: on error the state is
    unchanged and a ``ValueError`` names the argument.

    >>> buf = SampleBuffer(4, async_ratio=1.5)        # at most ceil(2.5 * 4) = 10 in flight
    >>> old = buf.reserve(4)                           # started by version 0
    >>> buf.set_version(1); buf.set_version(2)         # version 0 is now n - 2 = n - ceil(1.5)
    []
    []
    >>> new = buf.reserve(4)                           # started by version 2
    >>> for rid in old + new:
    ...     buf.put(rid, rid)
    >>> batch = buf.get_batch()
    >>> batch.samples, batch.staleness                 # at most floor(0.5 * 4) = 2 from version 0
    ([0, 1, 4, 5], {0: 2, 2: 2})
    >>> buf.set_version(3)                             # 2 and 3 (version 0) expire unconsumed
    []
    >>> buf.stats()["dropped_stale"], buf.stats()["held"]
    (2, 2)
    """

    def __init__(
        self,
        batch_size: int,
        *,
        async_ratio: float = 1.0,
        group_size: int = 1,
        max_in_flight: int | None = None,
        initial_version: int = 0,
    ) -> None:
        self._batch_size = _positive_int("batch_size", batch_size)
        self._alpha = _ratio("async_ratio", async_ratio)
        self._group_size = _positive_int("group_size", group_size)
        default = math.ceil((1 + self._alpha) * self._batch_size)
        if max_in_flight is None:
            self._max_in_flight = default
        else:
            self._max_in_flight = _positive_int("max_in_flight", max_in_flight, self._batch_size)
        self._version = check_int("initial_version", initial_version)
        self._reset_state()

    def _reset_state(self) -> None:
        self._next_id = 0
        self._batches_at_version = 0
        self._running: dict[int, int] = {}  # request id -> start version
        self._held: dict[int, tuple[int, list[Any]]] = {}  # request id -> (start version, samples)
        self._counts = dict.fromkeys(_COUNTS, 0)
        self._staleness_total: dict[int, int] = {}
        self._last_staleness: dict[int, int] = {}

    # ------------------------------------------------------------------ configuration

    @property
    def batch_size(self) -> int:
        """Requests per batch."""
        return self._batch_size

    @property
    def async_ratio(self) -> float:
        r""":math:`\alpha`."""
        return float(self._alpha)

    @property
    def group_size(self) -> int:
        """Samples per request."""
        return self._group_size

    @property
    def max_in_flight(self) -> int:
        """Bound on running + finished-and-held requests."""
        return self._max_in_flight

    @property
    def version(self) -> int:
        """The trainer's current version ``n``."""
        return self._version

    @property
    def min_version(self) -> int:
        r"""Oldest start version :meth:`get_batch` may take now: :math:`n - \lceil\alpha\rceil`."""
        return self._version - math.ceil(self._alpha)

    @property
    def oldest_cap(self) -> int:
        r"""Requests of version :attr:`min_version` a batch may hold:
        :math:`\lfloor (\alpha - \lfloor\alpha\rfloor) B\rfloor` if :math:`\alpha` is fractional,
        else ``batch_size``."""
        frac = self._alpha - math.floor(self._alpha)
        return math.floor(frac * self._batch_size) if frac else self._batch_size

    # ------------------------------------------------------------------ producer side

    @property
    def in_flight(self) -> int:
        """Running plus finished-and-held requests."""
        return len(self._running) + len(self._held)

    @property
    def free_slots(self) -> int:
        """How many more requests :meth:`reserve` accepts now: ``max_in_flight`` minus running,
        held and consumed-at-this-version requests (a trained request's slot frees at the next
        :meth:`set_version`)."""
        return self._max_in_flight - self.in_flight - self._batches_at_version * self._batch_size

    def can_start(self, n: int = 1) -> bool:
        """Whether ``n`` more requests may start now (admission control)."""
        return _positive_int("n", n, 0) <= self.free_slots

    def reserve(self, n: int = 1) -> list[int]:
        """Start ``n`` requests under the current version; returns their ids (increasing ints).

        Raises ``ValueError`` if ``n`` exceeds :attr:`free_slots` (nothing is reserved then).
        """
        n = _positive_int("n", n, 0)
        if n > self.free_slots:
            raise ValueError(
                f"n: cannot reserve {n} requests, only {self.free_slots} free slots "
                f"(max_in_flight={self._max_in_flight}, in flight={self.in_flight}, consumed at this "
                f"version={self._batches_at_version * self._batch_size})"
            )
        ids = list(range(self._next_id, self._next_id + n))
        for rid in ids:
            self._running[rid] = self._version
        self._next_id += n
        self._counts["reserved"] += n
        return ids

    def _check_running(self, name: str, rid: object) -> int:
        rid = check_int(name, rid)
        if rid in self._running:
            return rid
        if rid < 0 or rid >= self._next_id:
            raise ValueError(f"{name}: unknown request id {rid} (ids so far: 0..{self._next_id - 1})")
        state = "finished and held" if rid in self._held else "consumed, aborted or expired"
        raise ValueError(
            f"{name}: request {rid} is not running (it is {state}); "
            "check is_running() first when results can race with aborts"
        )

    def put(self, request_id: int, sample: Any) -> None:
        """A request finished: hold its sample(s) for :meth:`get_batch`.

        ``sample`` is one opaque payload when ``group_size == 1``, else a list / tuple of exactly
        ``group_size`` payloads (the request's group). The request must be running: a double
        ``put``, an unknown id or an aborted / expired request raises ``ValueError``.
        """
        rid = self._check_running("request_id", request_id)
        if self._group_size == 1:
            samples = [sample]
        else:
            if not isinstance(sample, (list, tuple)):
                raise ValueError(
                    f"sample: group_size={self._group_size}, expected a list or tuple of "
                    f"{self._group_size} samples, got {type(sample).__name__}"
                )
            if len(sample) != self._group_size:
                raise ValueError(
                    f"sample: expected {self._group_size} samples (group_size), got {len(sample)}"
                )
            samples = list(sample)
        self._held[rid] = (self._running.pop(rid), samples)
        self._counts["produced"] += 1

    def abort(self, request_ids: int | Iterable[int]) -> None:
        """Abort running requests (their slots free up; counted as ``aborted``).

        All ids are checked first: an unknown, finished or repeated id raises and nothing is
        aborted. To discard a request whose result the caller does not want (e.g. a filtered
        group), abort it instead of putting it.
        """
        if isinstance(request_ids, Tensor):
            ids = request_ids.reshape(-1).tolist()
        elif isinstance(request_ids, Iterable) and not isinstance(request_ids, (str, bytes)):
            ids = list(request_ids)
        else:
            ids = [request_ids]
        checked = [self._check_running("request_ids", rid) for rid in ids]
        if len(set(checked)) != len(checked):
            raise ValueError(f"request_ids: contains repeated ids {sorted(checked)}")
        for rid in checked:
            del self._running[rid]
        self._counts["aborted"] += len(checked)

    def is_running(self, request_id: int) -> bool:
        """Whether ``request_id`` is running (reserved, not yet put, aborted or expired)."""
        return check_int("request_id", request_id) in self._running

    def running_ids(self, max_version: int | None = None) -> list[int]:
        """Ids of the running requests (started at ``<= max_version`` if given), increasing."""
        if max_version is None:
            return sorted(self._running)
        mv = check_int("max_version", max_version)
        return sorted(r for r, v in self._running.items() if v <= mv)

    # ------------------------------------------------------------------ trainer side

    def _expire(self, max_version: int) -> list[int]:
        """Abort running and drop held requests started at ``<= max_version``."""
        aborted = sorted(r for r, v in self._running.items() if v <= max_version)
        dropped = [r for r, (v, _) in self._held.items() if v <= max_version]
        for rid in aborted:
            del self._running[rid]
        for rid in dropped:
            del self._held[rid]
        self._counts["aborted"] += len(aborted)
        self._counts["dropped_stale"] += len(dropped)
        return aborted

    def set_version(self, version: int) -> list[int]:
        r"""The trainer moved to ``version`` (> the current one; several steps at once allowed).

        Requests started at :math:`v < \mathrm{version} - \lceil\alpha\rceil` can never be
        trained again: the running ones are aborted (counted as ``aborted``; their ids are
        returned, increasing, for the caller to abort in its engine) and the finished ones are
        dropped (counted as ``dropped_stale``).
        """
        m = check_int("version", version)
        if m <= self._version:
            raise ValueError(f"version: must increase, got {m} after {self._version}")
        aborted = self._expire(m - math.ceil(self._alpha) - 1)
        self._version = m
        self._batches_at_version = 0
        return aborted

    def abort_expiring(self) -> list[int]:
        r"""Release the oldest allowed version early, once this version's batch is drawn.

        After :meth:`get_batch` at version :math:`n`, requests started at
        :math:`v \le n - \lceil\alpha\rceil` will be stale at :math:`n + 1`: abort the running
        ones (ids returned) and drop the finished ones now, so that their slots start fresh
        requests while the trainer trains (ROLL's ``ReplayBuffer.gc``). Only valid after at
        least one batch was drawn at the current version (``ValueError`` otherwise): call it
        after the version's last :meth:`get_batch`.
        """
        if self._batches_at_version == 0:
            raise ValueError(
                f"abort_expiring: no batch drawn yet at version {self._version}; requests of "
                f"version {self.min_version} may still be trained (call it after get_batch)"
            )
        return self._expire(self.min_version)

    def _select(self) -> list[int]:
        """Request ids get_batch would take now (may be fewer than batch_size)."""
        lo, cap = self.min_version, self.oldest_cap
        picked: list[int] = []
        at_lo = 0
        for rid, (v, _) in sorted(self._held.items(), key=lambda kv: (kv[1][0], kv[0])):
            if len(picked) == self._batch_size:
                break
            if v == lo:
                if at_lo == cap:
                    continue
                at_lo += 1
            picked.append(rid)
        return picked

    def num_ready(self) -> int:
        """Requests :meth:`get_batch` could take now (at most ``batch_size``)."""
        return len(self._select())

    def get_batch(self) -> Batch | None:
        """Consume ``batch_size`` finished requests under the freshness rule, oldest first.

        Returns ``None`` (and changes nothing) while fewer than ``batch_size`` eligible requests
        are held. Several batches may be drawn at one version; the cap on the oldest version
        applies to each batch.
        """
        picked = self._select()
        if len(picked) < self._batch_size:
            return None
        samples: list[Any] = []
        versions: list[int] = []
        hist: dict[int, int] = {}
        for rid in picked:
            v, group = self._held.pop(rid)
            samples.extend(group)
            versions.append(v)
            hist[self._version - v] = hist.get(self._version - v, 0) + 1
        hist = dict(sorted(hist.items()))
        for k, c in hist.items():
            self._staleness_total[k] = self._staleness_total.get(k, 0) + c
        self._staleness_total = dict(sorted(self._staleness_total.items()))
        self._last_staleness = dict(hist)
        self._counts["consumed"] += len(picked)
        self._counts["batches"] += 1
        self._batches_at_version += 1
        return Batch(samples, picked, versions, self._version, self._group_size, hist)

    # ------------------------------------------------------------------ metrics and state

    def stats(self) -> dict[str, Any]:
        """Counters (in requests) and staleness histograms, as plain Python values.

        ``reserved``, ``produced`` (put), ``consumed``, ``dropped_stale``, ``aborted``
        (explicit and by expiry), ``batches``: cumulative. ``running``, ``held``, ``in_flight``
        (= running + held), ``version``: current. ``staleness``: ``{n - v: requests}`` of the
        last batch; ``staleness_total``: summed over all batches. Invariants:
        ``produced == consumed + dropped_stale + held`` and
        ``reserved == produced + aborted + running``.
        """
        out: dict[str, Any] = dict(self._counts)
        out.update(
            running=len(self._running),
            held=len(self._held),
            in_flight=self.in_flight,
            version=self._version,
            staleness=dict(self._last_staleness),
            staleness_total=dict(self._staleness_total),
        )
        return out

    def _config(self) -> dict[str, Any]:
        return {
            "batch_size": self._batch_size,
            "async_ratio": float(self._alpha),
            "group_size": self._group_size,
            "max_in_flight": self._max_in_flight,
        }

    def state_dict(self) -> dict[str, Any]:
        """The whole state as plain Python (ints, lists, dicts) plus the opaque payloads.

        New containers; the payloads themselves are shared, not copied (like a module's
        ``state_dict`` shares its tensors). ``torch.save``-able when the payloads are.
        """
        return {
            "config": self._config(),
            "version": self._version,
            "next_id": self._next_id,
            "batches_at_version": self._batches_at_version,
            "running": [[r, v] for r, v in sorted(self._running.items())],
            "held": [[r, v, list(s)] for r, (v, s) in sorted(self._held.items())],
            "counts": dict(self._counts),
            "staleness_total": dict(self._staleness_total),
            "last_staleness": dict(self._last_staleness),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`. The configuration must match this buffer's.

        The whole state is validated before anything changes (``ValueError`` naming the
        offending entry). In a new process the running requests have no engine behind them:
        abort them (``abort(running_ids())``) or resubmit them, keeping their ids and versions.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"state: expected a mapping, got {type(state).__name__}")
        missing = [
            k
            for k in (
                "config",
                "version",
                "next_id",
                "batches_at_version",
                "running",
                "held",
                "counts",
                "staleness_total",
                "last_staleness",
            )
            if k not in state
        ]
        if missing:
            raise ValueError(f"state: missing entries {missing}")
        config = dict(state["config"])
        if config != self._config():
            raise ValueError(f"state['config']: {config} does not match this buffer's {self._config()}")
        version = check_int("state['version']", state["version"])
        next_id = _positive_int("state['next_id']", state["next_id"], 0)
        batches_at_version = _positive_int("state['batches_at_version']", state["batches_at_version"], 0)
        lo = version - math.ceil(self._alpha)

        def _entry(what: str, rid: object, v: object) -> tuple[int, int]:
            rid = _positive_int(f"{what} request id", rid, 0)
            v = check_int(f"{what} version", v)
            if rid >= next_id:
                raise ValueError(f"{what}: request id {rid} >= next_id {next_id}")
            if not lo <= v <= version:
                raise ValueError(f"{what}: request {rid} has version {v} outside [{lo}, {version}]")
            return rid, v

        running: dict[int, int] = {}
        for item in state["running"]:
            rid, v = _entry("state['running']", *item)
            if rid in running:
                raise ValueError(f"state['running']: request {rid} appears twice")
            running[rid] = v
        held: dict[int, tuple[int, list[Any]]] = {}
        for item in state["held"]:
            rid, v = _entry("state['held']", item[0], item[1])
            samples = list(item[2])
            if rid in held or rid in running:
                raise ValueError(f"state['held']: request {rid} appears twice")
            if len(samples) != self._group_size:
                raise ValueError(
                    f"state['held']: request {rid} has {len(samples)} samples, not {self._group_size}"
                )
            held[rid] = (v, samples)
        counts = {k: _positive_int(f"state['counts'][{k!r}]", state["counts"].get(k), 0) for k in _COUNTS}
        if counts["produced"] != counts["consumed"] + counts["dropped_stale"] + len(held):
            raise ValueError("state['counts']: produced != consumed + dropped_stale + held")
        if counts["reserved"] != counts["produced"] + counts["aborted"] + len(running):
            raise ValueError("state['counts']: reserved != produced + aborted + running")
        if counts["reserved"] != next_id:
            raise ValueError(f"state['counts']: reserved {counts['reserved']} != next_id {next_id}")
        if len(running) + len(held) + batches_at_version * self._batch_size > self._max_in_flight:
            raise ValueError("state: running + held + consumed at this version > max_in_flight")

        def _hist(name: str) -> dict[int, int]:
            return {
                _positive_int(f"state[{name!r}] key", k, 0): _positive_int(f"state[{name!r}][{k}]", c, 0)
                for k, c in sorted(dict(state[name]).items())
            }

        staleness_total, last_staleness = _hist("staleness_total"), _hist("last_staleness")
        # validated: commit
        self._version, self._next_id, self._batches_at_version = version, next_id, batches_at_version
        self._running, self._held, self._counts = running, held, counts
        self._staleness_total, self._last_staleness = staleness_total, last_staleness

    def __repr__(self) -> str:
        return (
            f"SampleBuffer(batch_size={self._batch_size}, async_ratio={float(self._alpha)}, "
            f"group_size={self._group_size}, max_in_flight={self._max_in_flight}, version={self._version}, "
            f"running={len(self._running)}, held={len(self._held)})"
        )


def staleness_metrics(staleness: Mapping[int, int], prefix: str = "staleness/") -> dict[str, float]:
    r"""Summary of a staleness histogram ``{n - v: count}`` (a :class:`Batch`'s ``staleness``).

    ``mean`` :math:`= \sum_k k\,c_k / \sum_k c_k`, ``max``, ``on_policy_frac`` (share with
    :math:`k = 0`) and ``count/<k>`` per staleness; all ``0`` for an empty histogram.

    >>> staleness_metrics({0: 3, 2: 1})
    {'staleness/mean': 0.5, 'staleness/max': 2.0, 'staleness/on_policy_frac': 0.75, 'staleness/count/0': 3.0, 'staleness/count/2': 1.0}
    """
    hist = {check_int("staleness key", k): check_int("staleness count", c) for k, c in staleness.items()}
    if any(k < 0 for k in hist) or any(c < 0 for c in hist.values()):
        raise ValueError(f"staleness: keys and counts must be >= 0, got {dict(staleness)}")
    total = sum(hist.values())
    out = {
        f"{prefix}mean": sum(k * c for k, c in hist.items()) / total if total else 0.0,
        f"{prefix}max": float(max((k for k, c in hist.items() if c), default=0)),
        f"{prefix}on_policy_frac": hist.get(0, 0) / total if total else 0.0,
    }
    out.update({f"{prefix}count/{k}": float(c) for k, c in sorted(hist.items())})
    return out


def off_policy_loss_inputs(
    loss: str,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    behavior_logprobs: Tensor,
    proximal_logprobs: Tensor | None = None,
) -> dict[str, Tensor]:
    r"""Tensor arguments of a policy loss of ``rollkit.registry.POLICY_LOSSES`` for stale samples.

    ``behavior_logprobs`` ``[B, T]`` are the per-token log-probs the rollout engine reported
    while generating (the policy of the sample's start version, kept across weight updates when
    partial rollouts are resumed); ``proximal_logprobs`` ``[B, T]`` are the trainer's
    recomputation under the current weights before the update. The mapping, by the loss's
    registered ``in_keys``:

    * two-policy losses (a ``behavior_logprobs`` argument: ``"decoupled-ppo"``, ``"tis"``):
      ``old_logprobs = proximal_logprobs`` (trust region / target policy),
      ``behavior_logprobs = behavior_logprobs`` (importance weight :math:`\pi_{prox}/\mu`);
      ``proximal_logprobs`` is required.
    * single-ratio losses (``"cispo"``, ``"topr"``, ``"ppo"``, ...): ``old_logprobs =
      behavior_logprobs``, so the loss's own ratio :math:`\pi_\theta/\mu` (clipped, truncated
      or tapered) is the off-policy correction; ``proximal_logprobs`` is not used.

    Returns ``{argument: tensor}``; call ``POLICY_LOSSES.get(loss)(**inputs, **hyper)``. The
    losses are not duplicated here: they validate shapes themselves.

    >>> from rollkit.registry import POLICY_LOSSES
    >>> lp = torch.zeros(1, 2, requires_grad=True); beh = torch.full((1, 2), -0.5)
    >>> adv, m = torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool)
    >>> sorted(off_policy_loss_inputs("cispo", lp, adv, m, beh))
    ['advantages', 'logprobs', 'mask', 'old_logprobs']
    >>> inp = off_policy_loss_inputs("decoupled-ppo", lp, adv, m, beh, proximal_logprobs=lp.detach())
    >>> POLICY_LOSSES.get("decoupled-ppo")(**inp).loss.shape
    torch.Size([1, 2])
    """
    if not isinstance(loss, str):
        raise ValueError(f"loss: expected a policy loss name, got {type(loss).__name__}")
    entry = POLICY_LOSSES.entry(loss)
    for name, x in (("logprobs", logprobs), ("advantages", advantages), ("mask", mask)):
        check_tensor(name, x)
    check_tensor("behavior_logprobs", behavior_logprobs)
    out = {"logprobs": logprobs, "advantages": advantages, "mask": mask}
    if "behavior_logprobs" in entry.in_keys:
        if proximal_logprobs is None:
            raise ValueError(
                f"proximal_logprobs: loss {loss!r} takes the proximal policy as old_logprobs and "
                "behavior_logprobs separately; pass the trainer's recomputed log-probs"
            )
        out["old_logprobs"] = check_tensor("proximal_logprobs", proximal_logprobs)
        out["behavior_logprobs"] = behavior_logprobs
    else:
        out["old_logprobs"] = behavior_logprobs
    missing = [a for a, required in entry.tensor_args().items() if required and a not in out]
    if missing:
        raise ValueError(
            f"loss: {loss!r} needs tensor arguments {missing} that this mapping does not provide"
        )
    return out

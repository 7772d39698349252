"""The transport of ``rollout.weight_sync`` buckets / delta: gloo groups behind vLLM's
weight-transfer API, the receiving ends, and the sender.

- :class:`GlooGroup`: a torch.distributed gloo group of its own per engine (the trainer as rank
  0, the engine's workers after it) over a ``TCPStore`` rendezvous.
- :class:`Receiver`: the receiving end (a vLLM worker's, or an HF engine's): a bucket's bytes by
  broadcast (or, in the sender's process, the tensors themselves), patched tensors rebuilt from
  its copy, a patch for another version refused, every tensor digested; :meth:`Receiver.report`.
- ``GlooWeightTransferEngine`` (:func:`register`): the vLLM worker side, a subclass of vLLM 0.32's
  ``WeightTransferEngine`` registered in ``WeightTransferEngineFactory`` as
  :data:`~trainers.engines.weight_sync.BACKEND`: a :class:`Receiver` whose tensors go to the
  model's ``load_weights`` inside vLLM's layer-wise reload (the lifecycle of vLLM's own ``nccl``
  backend), the CPU backend's tied LM head re-packed after it.
- Targets, the control plane of one receiving engine: :class:`LLMTarget` (an in-process
  ``vllm.LLM``), :class:`EngineTarget` (an engine in a Ray actor), a server's
  ``trainers.engines.server_rollout.HTTPTarget`` and a Ray actor's
  ``trainers.ray.workers.RayActorTarget``.
- :class:`WeightPusher`: the sender. Buckets pipelined (the next one prepared while the engines
  load the last), two send buffers reused, one torch thread while another process receives,
  servers on this machine one after another, the others in parallel; delta's copy and version
  check; every worker's report checked against what was sent (:class:`WeightSyncError`).

docs/weight_sync.md has the whole story and the measured figures.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainers.engines.weight_sync import (
    BACKEND,
    DIGEST,
    MODES,
    Patch,
    SyncStats,
    WeightSyncError,
    apply_patch,
    digest,
    encode,
    first_difference,
    iter_buckets,
    pack_bucket,
    patch_meta,
    tensor_nbytes,
    unpack_bucket,
)

__all__ = [
    "EngineTarget",
    "GlooGroup",
    "LLMTarget",
    "Receiver",
    "Target",
    "WeightPusher",
    "refresh_tied_head",
    "register",
    "worker_forget",
    "worker_report",
]


class GlooGroup:
    """A torch.distributed gloo group of its own (a ``TCPStore`` rendezvous, not the default group):
    rank 0 is the trainer, ranks 1.. the rollout workers. Every call has the group's deadline."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, *, timeout_s: float,
                 store: Any = None) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=float(timeout_s))
        self.rank, self.world_size = int(rank), int(world_size)
        self.store = store if store is not None else self.open_store(host, port, rank, world_size, timeout_s)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("rollkit-weights", self.store), self.rank,
                                        self.world_size, timeout)

    @staticmethod
    def open_store(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
        """The rendezvous store: rank 0 listens (returns at once), the others connect to it."""
        import torch.distributed as dist

        return dist.TCPStore(host, int(port), int(world_size), is_master=int(rank) == 0,
                             timeout=datetime.timedelta(seconds=float(timeout_s)), wait_for_workers=False)

    def broadcast(self, t: Tensor) -> None:
        self.pg.broadcast(t, 0).wait()

    def close(self) -> None:
        self.pg = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]


# --------------------------------------------------------------------------- receiver (vLLM worker)


def _receiver_base() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


@dataclass
class GlooInitInfo:
    """What a worker needs to join the trainer's group: the store's address, its rank (offset
    plus its worker rank) and the group's size, a deadline, and the engine's name for errors."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0
    engine: str = "vllm"


@dataclass
class GlooUpdateInfo:
    """One bucket's metadata (:func:`pack_bucket`) plus the version it brings and, for patches,
    the version they apply to (``base``; -1: no patch in this bucket)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    nnz: list[int]
    nbytes: int
    version: int
    base: int = -1
    keep: bool = False  # keep a copy of what arrives (delta mode)
    digest: str = DIGEST  # the sender's digest algorithm (the receiver uses the same)
    patches: list[Patch] | None = None  # a receiver in the sender's process: the patches themselves


class Receiver:
    """The receiving end of ``buckets`` / ``delta``, whatever then loads the tensors (a vLLM
    worker's model, an HF engine's parameters): joins the trainer's gloo group, receives each
    bucket's bytes with a broadcast, rebuilds patched tensors from its copy of what it last
    received, refuses a patch for another version, and digests every tensor it hands on."""

    def __init__(self, name: str = "engine") -> None:
        self.name = name
        self.group: GlooGroup | None = None
        self.shadow: dict[str, Tensor] = {}
        self.shadow_version = -1
        self.digests: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self.version = -1
        self._pending = -1

    def join(self, info: GlooInitInfo, rank: int) -> None:
        self.name = info.engine
        if self.group is not None:
            self.group.close()
        self.group = GlooGroup(info.master_address, info.master_port, rank, info.world_size, timeout_s=info.timeout_s)

    def start(self) -> None:
        self.digests = {}
        self.seconds = dict.fromkeys(("wait", "rebuild", "load", "finish"), 0.0)

    def receive(self, info: GlooUpdateInfo) -> list[tuple[str, Tensor]]:
        """One bucket: ``(name, whole tensor)`` on CPU, in the bucket's order."""
        t0 = time.perf_counter()
        if info.patches is not None:  # the sender is in this process: nothing to move
            patches = info.patches
        else:
            if self.group is None:
                raise WeightSyncError(f"{self.name}: weight transfer not initialised (init_weight_transfer_engine first)")
            flat = torch.empty(int(info.nbytes), dtype=torch.uint8)
            self.group.broadcast(flat)
            patches = unpack_bucket(_bucket_meta(info), flat)
        t1 = time.perf_counter()
        self.seconds["wait"] += t1 - t0
        if info.base >= 0 and info.base != self.shadow_version:
            raise WeightSyncError(
                f"{self.name}: a delta update for version {info.version} applies to version "
                f"{info.base}, but this engine holds version {self.shadow_version}: send a full update"
            )
        out = []
        for p in patches:
            full = apply_patch(p, self.shadow.get(p.name))  # a patch updates the copy in place
            if info.keep:  # a dense tensor: a view of this bucket's fresh buffer, or of the sender's own
                self.shadow[p.name] = full if info.patches is None or p.indices is not None else full.clone()
            self.digests[p.name] = digest(full, info.digest)
            out.append((p.name, full))
        self._pending = int(info.version)
        self.seconds["rebuild"] += time.perf_counter() - t1
        return out

    def finish(self) -> None:
        self.version = self._pending
        self.shadow_version = self._pending if self.shadow else -1

    def report(self) -> dict[str, Any]:
        """The version and digests of the last sync, how many tensors are kept for delta, and
        where its time went (``seconds``: waiting for bytes, rebuilding and digesting, loading)."""
        return {"version": self.version, "digests": dict(self.digests), "kept": len(self.shadow),
                "seconds": dict(self.seconds)}

    def forget(self) -> None:
        """Drop the delta copy (the next patch is refused: the sender then sends dense)."""
        self.shadow.clear()
        self.shadow_version = -1

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


_ENGINE_CLS: type | None = None


def _engine_cls() -> type:
    """:class:`GlooWeightTransferEngine`, built on first use (it subclasses vLLM's base class, and
    vLLM is imported only where a vLLM engine runs)."""
    global _ENGINE_CLS
    if _ENGINE_CLS is not None:
        return _ENGINE_CLS
    base = _receiver_base()

    class _Gloo(base):  # type: ignore[misc, valid-type]
        """vLLM worker side of ``rollkit_gloo``: a :class:`Receiver` whose tensors go to the
        model's ``load_weights`` inside vLLM's layer-wise reload (the CPU backend's tied LM head
        re-packed after it)."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            super().__init__(config, vllm_config, device, model)
            self.receiver = Receiver("vllm")

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            rank = int(init_info.rank_offset) + int(getattr(self.parallel_config, "rank", 0) or 0)
            self.receiver.join(init_info, rank)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self.receiver.start()
            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:  # no accelerator sync on CPU
            self.receive_weights(self.parse_update_info(update_info))
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def receive_weights(self, info: GlooUpdateInfo) -> None:
            weights = self.receiver.receive(info)
            t0 = time.perf_counter()
            self.model.load_weights([(n, t.to(self.device)) for n, t in weights])
            self.receiver.seconds["load"] += time.perf_counter() - t0

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            t0 = time.perf_counter()
            finalize_layerwise_reload(self.model, self.model_config)
            _refresh_tied_head(self.model)
            self.receiver.seconds["finish"] = time.perf_counter() - t0
            self.receiver.finish()

        def report(self) -> dict[str, Any]:
            return self.receiver.report()

        def forget(self) -> None:
            self.receiver.forget()

        def shutdown(self) -> None:
            self.receiver.close()

    _Gloo.__name__ = _Gloo.__qualname__ = "GlooWeightTransferEngine"
    _ENGINE_CLS = _Gloo
    return _Gloo


def _bucket_meta(info: Any) -> dict[str, Any]:
    return {k: getattr(info, k) for k in ("names", "dtype_names", "shapes", "nnz")}


def refresh_tied_head(model: Any) -> bool:
    """Re-run the LM head's weight post-processing (vLLM's CPU backend packs its weight into a
    oneDNN / sgl-kernel handle, a copy: with tied embeddings the checkpoint has no
    ``lm_head.weight``, so a reload updates the embedding the head shares but leaves the packed
    copy stale). Returns whether there was a head to refresh."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is None or method is None:
        return False
    method.process_weights_after_loading(head)
    return True


def _refresh_tied_head(model: Any) -> None:
    """:func:`refresh_tied_head` where it is needed: vLLM's CPU backend and tied embeddings."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and getattr(model.config, "tie_word_embeddings", False):
        refresh_tied_head(model)


def __getattr__(name: str) -> Any:
    if name == "GlooWeightTransferEngine":
        return _engine_cls()
    raise AttributeError(name)


_REGISTER_LOCK = threading.Lock()


def register(name: str = BACKEND, engine_cls: type | None = None) -> None:
    """Register rollkit's backend (or ``engine_cls``, a test double) with vLLM's
    ``WeightTransferEngineFactory`` under ``name``; a second call is a no-op. Called by the vLLM
    rollout engine before it builds ``LLM`` and by rollkit's worker extension in server workers."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with _REGISTER_LOCK:
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, engine_cls or _engine_cls())


def worker_report(worker: Any) -> dict[str, Any]:
    """Worker-side (``collective_rpc``): what the rollkit backend of this worker loaded last."""
    eng = getattr(worker, "weight_transfer_engine", None)
    if eng is None or not hasattr(eng, "report"):
        return {"version": -1, "digests": {}, "kept": 0}
    return eng.report()


def worker_forget(worker: Any) -> bool:
    eng = getattr(worker, "weight_transfer_engine", None)
    if eng is not None and hasattr(eng, "forget"):
        eng.forget()
        return True
    return False


# --------------------------------------------------------------------------- sender (trainer)


class Target:
    """One receiving engine's control plane (the four weight-transfer calls plus its report):
    an in-process ``vllm.LLM`` or a server's HTTP routes. ``workers`` ranks join the group."""

    name: str = "engine"
    workers: int = 1
    #: the receiving workers run in the sender's process (an in-process ``vllm.LLM``): the bucket's
    #: tensors are handed over in the update call itself, no group, no copy through a socket
    local: bool = False
    #: the receiver runs on the sender's machine, on its cores (a local server): such targets take
    #: each bucket one after another, the others in parallel
    shares_cores: bool = False

    def init(self, init_info: dict[str, Any]) -> None: ...
    def start(self) -> None: ...
    def update(self, update_info: dict[str, Any]) -> None: ...
    def finish(self, version: int) -> None: ...
    def reports(self) -> list[dict[str, Any]]: ...
    def forget(self) -> None: ...


class LLMTarget(Target):
    """A ``vllm.LLM`` built with ``weight_transfer_config={"backend": "rollkit_gloo"}``."""

    def __init__(self, llm: Any, name: str = "vllm", workers: int = 1, local: bool = False) -> None:
        self.llm, self.name, self.workers, self.local = llm, name, workers, local

    def init(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start(self) -> None:
        self.llm.start_weight_update()

    def update(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish(self, version: int) -> None:
        self.llm.finish_weight_update(str(int(version)))

    def reports(self) -> list[dict[str, Any]]:
        return list(self.llm.collective_rpc("rollkit_weight_report"))  # rollkit's worker extension

    def forget(self) -> None:
        self.llm.collective_rpc("rollkit_weight_forget")


class EngineTarget(Target):
    """A rollout engine in this process as a target (what a Ray rollout actor offers train rank 0):
    a vLLM engine's ``LLM`` (its workers receive), or a :class:`Receiver` here whose tensors go
    to ``load`` (the HF engine's parameters). ``finished(version)`` runs after ``finish`` (the
    engine's bookkeeping: its version, prefix cache; -1: a failed sync, refuse to serve)."""

    def __init__(self, name: str, *, llm: Any = None, load: Callable[[list[tuple[str, Tensor]]], None] | None = None,
                 finished: Callable[[int], None] | None = None, workers: int = 1) -> None:
        if (llm is None) == (load is None):
            raise ValueError("EngineTarget: give llm (a vLLM engine) or load (tensors loaded here)")
        self.name, self.workers, self.finished = name, int(workers), finished
        self.llm = None if llm is None else LLMTarget(llm, name, workers)
        self.receiver = None if load is None else Receiver(name)
        self.load = load

    def init(self, init_info: dict[str, Any]) -> None:
        if self.llm is not None:
            return self.llm.init(init_info)
        assert self.receiver is not None
        info = GlooInitInfo(**init_info)
        self.receiver.join(info, int(info.rank_offset))

    def start(self) -> None:
        if self.llm is not None:
            return self.llm.start()
        assert self.receiver is not None
        self.receiver.start()

    def update(self, update_info: dict[str, Any]) -> None:
        if self.llm is not None:
            return self.llm.update(update_info)
        assert self.receiver is not None and self.load is not None
        self.load(self.receiver.receive(GlooUpdateInfo(**update_info)))

    def finish(self, version: int) -> None:
        if self.llm is not None:
            self.llm.finish(version)
        elif self.receiver is not None:
            self.receiver.finish()
        if self.finished is not None:
            self.finished(int(version))

    def reports(self) -> list[dict[str, Any]]:
        if self.llm is not None:
            return self.llm.reports()
        assert self.receiver is not None
        return [self.receiver.report()]

    def forget(self) -> None:
        if self.llm is not None:
            return self.llm.forget()
        assert self.receiver is not None
        self.receiver.forget()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WeightPusher:
    """The trainer's side of ``buckets`` / ``delta``.

    One gloo group per target (the trainer as rank 0, the target's workers 1..), opened on the
    first :meth:`push`, so that one engine failing does not break the others' transfer. Each push
    streams the weights bucket by bucket: per target, its ``update_weights`` control call and the
    broadcast run on two threads (the worker receives inside the call); then every target's report
    is checked against what was sent.

    Args:
        targets: the receiving engines (:class:`LLMTarget`, :class:`HTTPTarget`).
        mode: ``"buckets"`` or ``"delta"``.
        bucket_bytes: the most bytes of tensors in one bucket.
        dtype: the rollout's weight dtype (floating tensors are cast to it before sending).
        check: compare every worker's report (version and digests) with what was sent.
        timeout_s: the deadline of the rendezvous and of every broadcast and control call.
        host: the address the targets' workers reach this process at.
        strict: a target that fails fails the push (:class:`WeightSyncError`); ``False``: it is
            left out of the rest of the push and named in ``SyncStats.failed`` (the server engine
            drops it), and only a push that no target survives raises.
    """

    def __init__(
        self,
        targets: Sequence[Target],
        *,
        mode: str = "buckets",
        bucket_bytes: int = 64 << 20,
        dtype: torch.dtype | None = None,
        check: bool = True,
        timeout_s: float = 300.0,
        host: str = "127.0.0.1",
        strict: bool = True,
    ) -> None:
        if mode not in ("buckets", "delta"):
            raise ValueError(f"rollout.weight_sync must be one of {MODES} here, got {mode!r}")
        if not bucket_bytes > 0:
            raise ValueError(f"rollout.weight_bucket_mb must be > 0, got {bucket_bytes} bytes")
        if not targets:
            raise ValueError("WeightPusher: no targets")
        self.targets = list(targets)
        self.mode, self.bucket_bytes, self.dtype = mode, int(bucket_bytes), dtype
        self.check, self.timeout_s, self.host, self.strict = check, float(timeout_s), host, strict
        self.groups: dict[int, GlooGroup] = {}
        self._joined: set[int] = set()  # local targets, which need no group
        self._buffers: list[Tensor] = []  # two packed-bucket buffers, reused from bucket to bucket
        self.shadow: dict[str, Tensor] = {}
        self.shadow_version = -1
        self._pool = ThreadPoolExecutor(max_workers=3 * len(self.targets) + 2, thread_name_prefix="rollkit-sync")

    # ---------------------------------------------------------------- plumbing

    def _connect(self, targets: list[Target]) -> dict[Target, str]:
        failed: dict[Target, str] = {}
        pending = []
        for t in [t for t in targets if t.local]:
            self._joined.add(id(t))  # nothing to open
        for t in [t for t in targets if not t.local]:
            port = _free_port()
            world = 1 + t.workers
            # listening before the workers are told where: a worker that connects too early waits
            # out TCPStore's retry back-off (measured: 0.5 s)
            store = GlooGroup.open_store(self.host, port, 0, world, self.timeout_s)
            info = {"master_address": self.host, "master_port": port, "rank_offset": 1,
                    "world_size": world, "timeout_s": self.timeout_s, "engine": t.name}
            pending.append((t, port, self._pool.submit(t.init, info),
                            self._pool.submit(GlooGroup, self.host, port, 0, world, timeout_s=self.timeout_s, store=store)))
        for t, _, call, group in pending:
            try:
                call.result(timeout=self.timeout_s)
                self.groups[id(t)] = group.result(timeout=self.timeout_s)
            except BaseException as e:
                failed[t] = _why("init_weight_transfer_engine", e)
        return failed

    def _each(self, targets: list[Target], what: str, fn: Callable[[Target], Any]) -> dict[Target, str]:
        futs = [(t, self._pool.submit(fn, t)) for t in targets]
        failed: dict[Target, str] = {}
        for t, f in futs:
            try:
                f.result(timeout=self.timeout_s)
            except BaseException as e:
                failed[t] = _why(what, e)
        return failed

    def _fail(self, live: list[Target], failed: dict[Target, str], stats: SyncStats) -> None:
        for t, why in failed.items():
            if t in live:
                live.remove(t)
            stats.failed[t.name] = why
            group = self.groups.pop(id(t), None)
            if group is not None:
                group.close()
        if failed and (self.strict or not live):
            t, why = next(iter(failed.items()))
            raise WeightSyncError(f"{t.name}: {why}")

    # ---------------------------------------------------------------- the push

    def push(self, named: Iterable[tuple[str, Tensor]], version: int, *, full: bool = False) -> SyncStats:
        """Send ``named`` to every target as version ``version`` (``full``: dense even in delta
        mode). Returns the sync's :class:`SyncStats`; raises :class:`WeightSyncError` when a target
        fails (``strict``) or its report disagrees with what was sent.

        With a receiver in another process, this process's torch runs one intra-op thread meanwhile
        (restored after): the work here is copies and compares, bound by memory, while the
        receivers' processes need the cores;
        with torch's default threads the two spin against each other (measured on 2 cores with
        one server: 2.3 s per sync of SmolLM2-135M in float32, 1.2 s with one thread)."""
        threads = torch.get_num_threads()
        if any(not t.local for t in self.targets):
            torch.set_num_threads(1)
        try:
            return self._push(named, version, full)
        finally:
            torch.set_num_threads(threads)

    def _push(self, named: Iterable[tuple[str, Tensor]], version: int, full: bool) -> SyncStats:
        t0 = time.perf_counter()
        stats = SyncStats()
        live = list(self.targets)
        new = [t for t in live if id(t) not in self.groups and id(t) not in self._joined]
        if new:
            self._fail(live, self._connect(new), stats)
        delta = self.mode == "delta"
        base = self.shadow_version if (delta and not full and self.shadow and not new) else -1
        if base >= 0 and not self._hold(live, base):
            base = -1  # a receiver lost its copy or holds another version: everything dense
        stats.full = base < 0
        self._fail(live, self._each(live, "start_weight_update", lambda t: t.start()), stats)
        sent: dict[str, str] = {}
        try:
            self._stream(named, version, base, delta, stats, sent, live)
        except BaseException:
            self._end_failed(live)
            raise
        self._fail(live, self._each(live, "finish_weight_update", lambda t: t.finish(version)), stats)
        if delta:
            self.shadow_version = int(version)
        if self.check:
            bad = {}
            for t in live:
                try:
                    self.verify(t, version, sent)
                except WeightSyncError as e:
                    bad[t] = str(e)
            if bad:
                t, why = next(iter(bad.items()))
                raise WeightSyncError(why)  # never quietly: a target that loaded wrong weights fails the run
        self.targets = [t for t in self.targets if t in live or t.name not in stats.failed]
        stats.seconds = time.perf_counter() - t0
        return stats

    def _hold(self, live: list[Target], version: int) -> bool:
        """Whether every worker of every target holds its delta copy at ``version``."""
        try:
            return all(int(r.get("version", -1)) == version and int(r.get("kept", 0)) > 0
                       for t in live for r in t.reports())
        except Exception:
            return False

    def _stream(self, named: Iterable[tuple[str, Tensor]], version: int, base: int, delta: bool,
                stats: SyncStats, sent: dict[str, str], live: list[Target]) -> None:
        """Pipelined: while the targets receive and load bucket i, this thread prepares bucket i+1
        (cast, encode, digest, pack), so at most two buckets are alive at a time."""
        inflight: list[Any] = []
        held: Tensor | None = None  # the buffer of the bucket in flight
        for bucket in iter_buckets(named, self.bucket_bytes, self.dtype):
            patches = []
            for name, tensor in bucket:
                old = self.shadow.get(name) if base >= 0 else None
                patches.append(encode(name, tensor, old))
                stats.dense_bytes += tensor_nbytes(tensor)
                if delta:
                    if old is not None:
                        old.copy_(tensor)
                    else:
                        self.shadow[name] = tensor.clone()
                if self.check:
                    sent[name] = digest(tensor)
            stats.patched += sum(p.indices is not None for p in patches)
            remote = [t for t in live if not t.local]
            spare = self._buffers.pop(0) if self._buffers else None
            meta, flat = pack_bucket(patches, spare) if remote else (patch_meta(patches), None)
            has_patch = any(n >= 0 for n in meta["nnz"])
            info = {**meta, "version": int(version), "base": base if has_patch else -1, "keep": delta, "digest": DIGEST}
            size = sum(p.nbytes for p in patches)
            stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, 2 * size + (0 if flat is None else int(flat.numel())))
            self._land(inflight, live, stats)  # the previous bucket first: one broadcast at a time per group
            if held is not None:
                self._buffers.append(held)  # landed: its buffer is free again
            held = None if flat is None else (flat if flat._base is None else flat._base)
            # targets sharing this machine's cores take the bucket one after another (two CPU
            # servers loading at once spin against each other: measured 5x slower on 2 cores);
            # the others in parallel
            chains = [[t] for t in live if not t.shares_cores] + [[t for t in live if t.shares_cores]]
            inflight = [self._pool.submit(self._send, chain, info, patches, flat) for chain in chains if chain]
            stats.bytes += size * len(live)
            stats.tensors += len(patches)
            stats.buckets += 1
            del bucket, patches, flat
        self._land(inflight, live, stats)
        if held is not None:
            self._buffers.append(held)
        stats.dense_bytes *= max(1, len(live))

    def _send(self, chain: list[Target], info: dict[str, Any], patches: list[Patch], flat: Tensor | None) -> dict[Target, str]:
        """One bucket to each target of ``chain`` in turn (its ``update_weights`` call and the
        broadcast side by side; a local target gets the patches in the call); the failures."""
        failed: dict[Target, str] = {}
        for t in chain:
            if t.local:
                calls = [("update_weights", self._pool.submit(t.update, {**info, "patches": patches}))]
            else:
                calls = [("update_weights", self._pool.submit(t.update, info)),
                         ("the broadcast", self._pool.submit(self.groups[id(t)].broadcast, flat))]
            for what, f in calls:
                try:
                    f.result(timeout=self.timeout_s)
                except BaseException as e:  # recorded per target
                    failed.setdefault(t, _why(what, e))
        return failed

    def _land(self, inflight: list[Any], live: list[Target], stats: SyncStats) -> None:
        """Wait for a bucket's chains; a target that failed leaves ``live``."""
        failed: dict[Target, str] = {}
        for f in inflight:
            failed.update(f.result(timeout=self.timeout_s * max(1, len(live))))
        self._fail(live, failed, stats)

    def _end_failed(self, live: list[Target]) -> None:
        """After a stream failed half-way: end the targets' open updates (what they loaded is not
        a version: their engines must refuse to serve until the next sync) and forget the delta
        copies, so that the next sync is dense."""
        self._each(live, "finish_weight_update", lambda t: t.finish(-1))
        self.shadow.clear()
        self.shadow_version = -1

    def verify(self, target: Target, version: int, sent: dict[str, str]) -> None:
        """Every worker of ``target`` reports ``version`` and the digests that were sent."""
        for w, rep in enumerate(target.reports()):
            if int(rep.get("version", -1)) != int(version):
                raise WeightSyncError(
                    f"{target.name} (worker {w}): serves version {rep.get('version')} after the sync of version {version}"
                )
            got = rep.get("digests", {})
            bad = first_difference(sent, got)
            if bad is not None:
                why = "never arrived" if bad not in got else ("was not sent" if bad not in sent else "differs from what was sent")
                raise WeightSyncError(
                    f"{target.name} (worker {w}): version {version}: tensor {bad!r} {why} "
                    f"({sum(got.get(n) == d for n, d in sent.items())} of {len(sent)} tensors loaded as sent)"
                )

    def forget(self) -> None:
        """Forget the delta copies on both ends: the next push is dense."""
        self.shadow.clear()
        self.shadow_version = -1
        for t in self.targets:
            t.forget()

    def _close_groups(self) -> None:
        for g in self.groups.values():
            g.close()
        self.groups.clear()

    def close(self) -> None:
        self._close_groups()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _why(what: str, e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{what} failed: {type(e).__name__}: {text[:300]}"


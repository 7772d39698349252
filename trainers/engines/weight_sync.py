"""Weights from trainer to rollout: the modes, buckets, delta patches and their wire format,
digests, and the check after every sync (the transport: :mod:`trainers.engines.weight_transfer`).

``rollout.weight_sync`` picks the path a rollout engine's ``update_weights`` takes:

- ``reload`` (today's path): the engine gets the whole model at once (the in-process vLLM
  engine through ``reload_weights``, a server or a vLLM engine with worker processes as one
  safetensors file it re-reads).
- ``buckets``: the trainer's ``(name, tensor)`` stream is cut into buckets of
  ``rollout.weight_bucket_mb`` (:func:`iter_buckets`), each cast to the rollout's dtype, packed
  into one flat byte buffer (:func:`pack_bucket`) and broadcast over a torch.distributed **gloo**
  group to every vLLM worker, which loads it through vLLM's weight-transfer API
  (``start_weight_update`` / ``update_weights`` / ``finish_weight_update``, the checkpoint-format
  layer-wise reload vLLM's own ``nccl`` backend uses). The backend is rollkit's own
  (:mod:`trainers.engines.weight_transfer`), registered with vLLM's ``WeightTransferEngineFactory``
  under :data:`BACKEND`; it runs on CPU, so the protocol runs in CI. No process holds the whole model
  beyond what it already held: the trainer one bucket at a time (plus whatever its export
  gathers), the worker one bucket plus vLLM's own staging of a layer.
- ``delta``: as ``buckets``, but a tensor that was sent before travels as a sparse patch of the
  elements whose bits changed (:func:`encode`, flat ``int32``/``int64`` indices + values, in the
  rollout's dtype), a dense tensor where the patch would not be smaller. Exact: the receiver
  applies the patch to its copy of what it last received (:func:`apply_patch`) and loads the
  whole tensor, so the engine ends up bit-identical to a full update. Both ends keep one copy of
  the model in the rollout's dtype for this (the CPU backend packs its weights for oneDNN, so a
  patch cannot be written into vLLM's parameters in place). A patch names the version it applies
  to; a receiver at another version refuses it by name, and the sender then sends everything
  dense.

A receiver in the sender's own process (the in-process ``vllm.LLM``, ``Target.local``) takes the
bucket's tensors in the update call itself: the same calls, no group, no copy through a socket.

**The check** (``rollout.weight_check``, on by default): every receiver
digests what it loaded (xxh3-128 per tensor where ``xxhash`` is installed, else CRC-32:
:func:`digest`) and reports it with the version; the
sender compares with its own digests of what it sent, and a mismatch fails the sync with a
one-line error naming the engine, the version and the first tensor that differs
(:class:`WeightSyncError`). The probe (a few sampled tokens' log-probs from the rollout against
the trainer's, :func:`probe_gap`, run by the sync loops after every sync of any mode) catches
what a digest of the sent bytes cannot: weights that arrived but are not what the model serves.

Metrics of a sync (:class:`SyncStats`): ``sync/seconds``, ``sync/bytes`` (the buckets' tensor
bytes, over all engines), ``sync/dense_bytes`` (what a full update would move),
``sync/delta_frac`` (their ratio), ``sync/buckets``, ``sync/peak_bucket_bytes``; the loops add
``sync/probe_gap`` and ``time/probe``.

Example (the wire format without a transport)::

    >>> new, old = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 0.0, 3.0, 4.0])
    >>> meta, flat = pack_bucket([encode("w", new, old)])
    >>> meta["nnz"], flat.numel()   # one changed element: a 4-byte index, 4 bytes of padding, the value
    ([1], 12)
    >>> apply_patch(unpack_bucket(meta, flat)[0], old.clone()).tolist()
    [1.0, 2.0, 3.0, 4.0]
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from trainers.engines.base import SamplingParams, batch_logprobs, pack_generations, size_groups

__all__ = [
    "BACKEND",
    "DIGEST",
    "MODES",
    "PROBE_TEXT",
    "Patch",
    "SyncStats",
    "WeightSyncError",
    "apply_patch",
    "check_probe",
    "checked_weights",
    "digest",
    "encode",
    "first_difference",
    "iter_buckets",
    "pack_bucket",
    "patch_meta",
    "probe_gap",
    "tensor_nbytes",
    "unpack_bucket",
]

#: the name rollkit's transport is registered under in vLLM's ``WeightTransferEngineFactory``
BACKEND = "rollkit_gloo"
#: the values of ``rollout.weight_sync``
MODES = ("reload", "buckets", "delta")

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16,
                                                       torch.float64, torch.int64, torch.int32,
                                                       torch.int16, torch.int8, torch.uint8, torch.bool)}


class WeightSyncError(RuntimeError):
    """A sync that did not leave the rollout with the trainer's weights (digest, version or probe)."""


# --------------------------------------------------------------------------- buckets


def tensor_nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(
    named: Iterable[tuple[str, Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
) -> Iterator[list[tuple[str, Tensor]]]:
    """Cut a ``(name, tensor)`` stream into lists of at most ``bucket_bytes`` (a tensor larger than
    a bucket is a bucket of its own), each tensor detached, cast to ``dtype`` (floating tensors;
    ``None``: as given), on CPU and contiguous.

    The stream is consumed lazily: one bucket is materialised at a time, so a generator that
    gathers each tensor (ZeRO-3, FSDP2) holds one bucket, not a model.

    >>> [[n for n, _ in b] for b in iter_buckets([("a", torch.ones(2)), ("b", torch.ones(2)), ("c", torch.ones(8))], 16)]
    [['a', 'b'], ['c']]
    """
    if not bucket_bytes > 0:
        raise ValueError(f"rollout.weight_bucket_mb must be > 0, got {bucket_bytes} bytes")

    def cast(t: Tensor) -> Tensor:
        t = t.detach()
        return (t.to(dtype) if dtype is not None and t.is_floating_point() else t).to("cpu").contiguous()

    return size_groups(((n, cast(t)) for n, t in named), lambda nt: tensor_nbytes(nt[1]), bucket_bytes)


def checked_weights(
    named: Iterable[tuple[str, Tensor]],
    shapes: dict[str, tuple[int, ...]] | None,
    tied: bool,
) -> Iterator[tuple[str, Tensor]]:
    """An update's ``(name, tensor)`` stream checked against the checkpoint's names and ``shapes``
    (when known) as each tensor passes, a tied ``lm_head.weight`` dropped (it is the embedding):
    an unknown name is a ``KeyError``, a wrong shape a ``ValueError``, and at the stream's end a
    checkpoint tensor left out a ``KeyError``, each naming the tensor.

    >>> list(n for n, _ in checked_weights([("a", torch.ones(2)), ("lm_head.weight", torch.ones(2))], {"a": (2,)}, True))
    ['a']
    """
    seen: set[str] = set()
    for name, t in named:
        if name == "lm_head.weight" and tied:
            continue
        if shapes is not None:
            if name not in shapes:
                raise KeyError(f"update_weights: unknown parameter {name!r}")
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"update_weights: {name!r} has shape {list(t.shape)}, expected {list(shapes[name])}")
        seen.add(name)
        yield name, t
    if shapes is not None and (missing := sorted(set(shapes) - seen)):
        raise KeyError(f"update_weights: missing parameters {missing[:5]}{'...' if len(missing) > 5 else ''}")


# --------------------------------------------------------------------------- digests


def _bytes(t: Tensor) -> Any:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()


def _xxh3() -> Any:
    try:
        import xxhash
    except ImportError:  # the digest falls back to CRC-32 (standard library)
        return None
    return xxhash.xxh3_128


#: the digest both ends use: xxh3-128 where the ``xxhash`` package is installed (27 GB/s on the
#: 2-core EPYC here, against sha256's 1.8), else CRC-32 (zlib, 4 GB/s)
DIGEST = "xxh3" if _xxh3() is not None else "crc32"


def digest(t: Tensor, algorithm: str = DIGEST) -> str:
    """A digest of a tensor's bytes (its dtype's bit pattern, row-major): equal bits, equal
    digests; a changed, lost or stale tensor differs (it is a checksum against accidents, not an
    adversary). ``algorithm``: ``"xxh3"`` (xxh3-128, needs ``xxhash``), ``"crc32"`` or
    ``"sha256"``.

    >>> digest(torch.zeros(2)) == digest(torch.zeros(2)), digest(torch.zeros(2)) == digest(torch.ones(2))
    (True, False)
    """
    data = _bytes(t.to("cpu"))
    if algorithm == "xxh3":
        h = _xxh3()
        if h is None:
            raise WeightSyncError("weight sync: the sender digests with xxh3: install xxhash here too (pip install xxhash)")
        return "xxh3:" + h(data).hexdigest()
    if algorithm == "crc32":
        return f"crc32:{zlib.crc32(data):08x}"
    if algorithm == "sha256":
        return "sha256:" + hashlib.sha256(data).hexdigest()
    raise ValueError(f"digest: unknown algorithm {algorithm!r} (xxh3, crc32, sha256)")


def first_difference(mine: dict[str, str], theirs: dict[str, str]) -> str | None:
    """The first name (sorted) whose digest differs or that one side lacks; ``None``: equal."""
    for name in sorted(mine.keys() | theirs.keys()):
        if mine.get(name) != theirs.get(name):
            return name
    return None


# --------------------------------------------------------------------------- delta patches


@dataclass
class Patch:
    """One tensor on the wire: dense (``indices is None``: ``values`` is the flattened tensor) or a
    sparse patch (``values[i]`` replaces flat element ``indices[i]`` of the receiver's copy at
    version ``base``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: Tensor
    indices: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.values) + (0 if self.indices is None else tensor_nbytes(self.indices))


def _bits(t: Tensor) -> Tensor:
    """The tensor's bit pattern as an integer view (so ``-0.0 != 0.0`` and NaN == NaN of the same bits)."""
    flat = t.reshape(-1)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return flat.view(view) if t.dtype != torch.bool else flat.view(torch.uint8)


def encode(name: str, new: Tensor, old: Tensor | None) -> Patch:
    """The patch taking ``old`` to ``new`` (same shape and dtype): the flat indices whose bits
    differ and their new values; dense when there is no ``old`` or the patch (indices + values)
    would not be smaller than the tensor. ``int32`` indices below 2**31 elements, else ``int64``.

    >>> p = encode("w", torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 0.0, 3.0, 4.0]))
    >>> p.indices.tolist(), p.values.tolist()
    ([1], [2.0])
    """
    shape = tuple(new.shape)
    flat = new.reshape(-1)
    if old is None or tuple(old.shape) != shape or old.dtype != new.dtype:
        return Patch(name, shape, new.dtype, flat)
    idx_dtype = torch.int32 if flat.numel() < 2**31 else torch.int64
    changed = torch.ne(_bits(new), _bits(old))
    nnz = int(torch.count_nonzero(changed))
    per = new.element_size() + (4 if idx_dtype == torch.int32 else 8)
    if nnz * per >= tensor_nbytes(new):
        return Patch(name, shape, new.dtype, flat)
    idx = changed.nonzero().reshape(-1)
    return Patch(name, shape, new.dtype, flat[idx], idx.to(idx_dtype))


def apply_patch(patch: Patch, old: Tensor | None) -> Tensor:
    """The full tensor a patch describes: its values (dense), or ``old`` with the patch's elements
    replaced (``old`` is updated in place and returned)."""
    if patch.indices is None:
        return patch.values.reshape(patch.shape)
    if old is None or tuple(old.shape) != patch.shape or old.dtype != patch.dtype:
        raise WeightSyncError(
            f"weight sync: a patch for {patch.name!r} arrived, but the receiver holds no copy of it "
            f"with shape {list(patch.shape)} and dtype {patch.dtype}"
        )
    old.reshape(-1)[patch.indices.long()] = patch.values
    return old


# --------------------------------------------------------------------------- the wire format


def patch_meta(patches: Sequence[Patch]) -> dict[str, Any]:
    """:func:`pack_bucket`'s metadata without the bytes (a receiver in this process)."""
    return {"names": [p.name for p in patches], "dtype_names": [str(p.dtype).removeprefix("torch.") for p in patches],
            "shapes": [list(p.shape) for p in patches], "nnz": [-1 if p.indices is None else int(p.indices.numel())
                                                                for p in patches], "nbytes": 0}


def _align(pos: int) -> int:
    return (pos + 7) // 8 * 8


def pack_bucket(patches: Sequence[Patch], out: Tensor | None = None) -> tuple[dict[str, Any], Tensor]:
    """A bucket as ``(meta, flat)``: ``flat`` the bytes of every patch (indices then values) in
    order, each part at a multiple of 8 bytes (so every view of it is aligned), ``meta`` what the
    receiver needs to cut them apart (names, dtypes, shapes, ``nnz``: -1 for a dense tensor).
    ``out``: a ``uint8`` buffer to write into when it is large enough (``flat`` is then a view of
    it; a reused buffer saves the page faults of fresh memory), else a new one."""
    meta = patch_meta(patches)
    parts: list[tuple[int, Tensor]] = []
    size = 0
    for p in patches:
        if p.indices is not None:
            idx = p.indices.to(torch.int64 if p.indices.dtype == torch.int64 else torch.int32).reshape(-1)
            size = _align(size)
            parts.append((size, idx.view(torch.uint8)))
            size += parts[-1][1].numel()
        size = _align(size)
        parts.append((size, p.values.reshape(-1).contiguous().view(torch.uint8)))
        size += parts[-1][1].numel()
    flat = out[:size] if out is not None and out.numel() >= size else torch.empty(size, dtype=torch.uint8)
    pos = 0
    for at, part in parts:
        if at > pos:
            flat[pos:at].zero_()
        flat[at : at + part.numel()].copy_(part)
        pos = at + part.numel()
    meta["nbytes"] = int(size)
    return meta, flat


def unpack_bucket(meta: dict[str, Any], flat: Tensor) -> list[Patch]:
    """The inverse of :func:`pack_bucket` (views into ``flat``)."""
    out: list[Patch] = []
    pos = 0
    for name, dname, shape, nnz in zip(meta["names"], meta["dtype_names"], meta["shapes"], meta["nnz"], strict=True):
        dtype = _DTYPES[dname]
        numel = 1
        for s in shape:
            numel *= int(s)
        esize = torch.empty(0, dtype=dtype).element_size()
        idx = None
        if nnz >= 0:
            idx_dtype = torch.int32 if numel < 2**31 else torch.int64
            ib = nnz * (4 if idx_dtype == torch.int32 else 8)
            pos = _align(pos)
            idx = flat[pos : pos + ib].view(idx_dtype)
            pos += ib
            count = nnz
        else:
            count = numel
        pos = _align(pos)
        vals = flat[pos : pos + count * esize].view(dtype)
        pos += count * esize
        out.append(Patch(name, tuple(int(s) for s in shape), dtype, vals, idx))
    if pos != flat.numel():
        raise WeightSyncError(f"weight sync: a bucket of {flat.numel()} bytes holds {pos} bytes of tensors")
    return out


# --------------------------------------------------------------------------- what a sync did


@dataclass
class SyncStats:
    """What one sync did (``sync/*`` metrics)."""

    seconds: float = 0.0
    bytes: int = 0
    dense_bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    patched: int = 0
    full: bool = True
    peak_bucket_bytes: int = 0
    failed: dict[str, str] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        m = {
            "sync/seconds": self.seconds,
            "sync/bytes": float(self.bytes),
            "sync/dense_bytes": float(self.dense_bytes),
            "sync/delta_frac": self.bytes / self.dense_bytes if self.dense_bytes else 1.0,
            "sync/buckets": float(self.buckets),
            # the most bytes of buckets the sender held at once (the one in flight and the next, packed)
            "sync/peak_bucket_bytes": float(self.peak_bucket_bytes),
        }
        return m


# --------------------------------------------------------------------------- the probe

#: the probe's prompt: any text will do; fixed so that the gaps of a run compare
PROBE_TEXT = "Probe: 3 + 4 = 7, 12 + 5 ="


def probe_gap(rollout: Any, policy: Any, prompt_ids: Sequence[int], *, pad_token_id: int,
              tokens: int = 4, samples: int = 1, micro_batch_size: int = 8, seed: int = 1234) -> float:
    """The largest |log-prob difference| between what ``rollout`` reports for ``samples`` sampled
    continuations (``tokens`` each, temperature 1, untruncated) of ``prompt_ids`` and what
    ``policy`` (a train engine, or a Ray train group with ``batch_logprobs``) computes for them.

    Equal weights give the kernels' noise (about 1e-6 in float32 on CPU, measured); weights that
    did not arrive, or arrived mapped wrongly, give the distance between two models. The default
    (one sample of 4 tokens) costs 0.27 s per sync with SmolLM2-135M on the in-process vLLM engine
    (2-core EPYC; 0.58 s with 2 x 8 tokens), about 3% of the recipe's step."""
    gens = rollout.generate([list(prompt_ids)], SamplingParams(n=samples, max_tokens=tokens, temperature=1.0, seed=seed))
    b = pack_generations(gens, pad_token_id)
    lp = batch_logprobs(policy, b, temperature=1.0, micro_batch_size=micro_batch_size)
    gap = (lp.float() - b.old_logprobs.float()).abs() * b.response_mask
    return float(gap.max()) if gap.numel() else 0.0


def check_probe(gap: float, tol: float, *, engine: str, version: int) -> None:
    """A one-line :class:`WeightSyncError` when ``gap`` exceeds ``tol``."""
    if gap > tol:
        raise WeightSyncError(
            f"{engine}: after the sync of version {version} the rollout's log-probs differ from the trainer's "
            f"by {gap:.3g} (> rollout.weight_probe_tol={tol:g}): it does not serve the trainer's weights"
        )

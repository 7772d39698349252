"""Training state offloaded to the host between phases (``placement.offload_train``).

In a colocated run the rollout engine and the training engine share one device. While the
rollout generates, the training engine's weights, gradients, optimizer state and buffers need
not be on the device: :func:`offload` copies every such tensor's storage to the host and frees
the device storage in place (``untyped_storage().resize_(0)``, as FSDP frees its gathered
weights), :func:`onload` reallocates it and copies the bytes back. Working on storages rather
than tensors keeps every alias intact: a parameter that is a view into a flat buffer
(DeepSpeed ZeRO's partitions, FSDP2's sharded parameter data), a tied embedding, an optimizer
holding the parameter objects all see the restored bytes, bit for bit, with no reference to
re-point. A tensor read while offloaded has no storage and fails loudly.

On a CPU-only machine the device *is* the host: the "host copy" is still a separate storage and
the originals are emptied, so the move is tested on CPU. On CUDA the host copies are pinned.

    saved = offload(state_tensors(model, [optimizer]), device)   # device memory released
    ...                                                           # the rollout generates
    onload(saved)                                                 # the same bytes, same tensors

The engines wrap this in ``offload()`` / ``onload()`` methods (:class:`Offloadable`); the
roles call them around the update (:mod:`trainers.roles`). docs/engines.md ("Offloading the
training state").
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "HostCopy",
    "Offloadable",
    "offload",
    "onload",
    "reachable_tensors",
    "resident",
    "state_tensors",
]


@dataclass
class HostCopy:
    """The host copies of offloaded device storages: ``(device storage, host storage, nbytes)``."""

    device: torch.device
    entries: list[tuple[torch.UntypedStorage, torch.UntypedStorage, int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes moved to the host (what the device got back)."""
        return sum(n for _, _, n in self.entries)


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard (FSDP2), a plain tensor as it is."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, Tensor) else t


def _tensors_in(obj: Any) -> Iterator[Tensor]:
    """Tensors inside (nested) dicts / lists / tuples."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


def state_tensors(
    module: torch.nn.Module, optimizers: Iterable[Any] = (), extra: Iterable[Tensor] = ()
) -> list[Tensor]:
    """Every tensor of a training state: ``module``'s parameters, their gradients (where set)
    and buffers, each optimizer's per-parameter state (``exp_avg``, ``exp_avg_sq``, ``step``,
    ...), and ``extra`` (e.g. float32 master weights). DTensors give their local shard."""
    out: list[Tensor] = []
    for p in module.parameters():
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
        ds = getattr(p, "ds_tensor", None)  # DeepSpeed ZeRO-3's partition of the parameter
        if isinstance(ds, Tensor):
            out.append(ds)
    out.extend(module.buffers())
    for opt in optimizers:
        for state in getattr(opt, "state", {}).values():
            out.extend(_tensors_in(state))
    out.extend(extra)
    return [_local(t) for t in out]


#: modules whose objects :func:`reachable_tensors` walks into (besides plain containers)
_WALKED = ("deepspeed.", "torch.optim.")


def reachable_tensors(root: Any, *, max_depth: int = 6) -> list[Tensor]:
    """Tensors held by ``root`` (an optimizer wrapper such as DeepSpeed's ZeRO optimizer): its
    attributes, followed through lists, tuples, dicts and objects of DeepSpeed / torch.optim
    classes up to ``max_depth`` levels, so that flat buffers, partitions and gradient buckets
    that no module parameter names are found too."""
    seen: set[int] = set()
    out: list[Tensor] = []

    def walk(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > max_depth:
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            out.append(_local(obj))
            grad = obj.grad if obj.is_leaf else None
            if grad is not None:
                out.append(_local(grad))
        elif isinstance(obj, dict):
            for v in list(obj.values()):
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in list(obj):
                walk(v, depth + 1)
        elif not isinstance(obj, torch.nn.Module) and type(obj).__module__.startswith(_WALKED):
            for v in list(vars(obj).values()) if hasattr(obj, "__dict__") else []:
                walk(v, depth + 1)

    walk(root, 0)
    return out


def offload(tensors: Iterable[Tensor], device: torch.device | str) -> HostCopy:
    """Copy the storage of every tensor on ``device`` to the host and free it on the device
    (each storage once, however many tensors view it); returns what :func:`onload` restores.
    Tensors on other devices (already on the host next to a GPU) and empty storages are left
    alone. A storage that cannot be resized (memory-mapped) raises ``ValueError``."""
    device = torch.device(device)
    saved = HostCopy(device)
    seen: set[int] = set()
    pin = device.type == "cuda"
    for t in tensors:
        if t.device.type != device.type:
            continue
        s = t.untyped_storage()
        n, ptr = s.nbytes(), s.data_ptr()
        if n == 0 or ptr in seen:
            continue
        seen.add(ptr)
        if not s.resizable():
            raise ValueError(
                f"placement.offload_train: a {tuple(t.shape)} {t.dtype} tensor's storage cannot be "
                "released (not resizable, e.g. memory-mapped); load the model with a copy"
            )
        host = torch.UntypedStorage(n, device="cpu")
        host.copy_(s)
        saved.entries.append((s, host.pin_memory() if pin else host, n))
    for s, _, _ in saved.entries:
        s.resize_(0)
    if pin:
        torch.cuda.empty_cache()
    return saved


def onload(saved: HostCopy) -> None:
    """Undo :func:`offload`: reallocate every device storage and copy its bytes back (bit for
    bit), into the same storages, so every tensor and view sees them again."""
    for s, host, n in saved.entries:
        s.resize_(n)
        s.copy_(host)
    saved.entries.clear()


class Offloadable:
    """The ``offload()`` / ``onload()`` pair of a training engine, over what
    ``_offload_tensors()`` names (a mixin: the engine defines that method and ``device``).

    Both are idempotent. A method decorated with :func:`resident` onloads first, so a
    checkpoint or an export of an offloaded engine reads the real weights."""

    _host: HostCopy | None = None

    def _offload_tensors(self) -> list[Tensor]:  # pragma: no cover - every engine overrides it
        raise NotImplementedError

    @property
    def offloaded(self) -> bool:
        """Whether the training state is on the host (:meth:`offload` was called last)."""
        return self._host is not None

    def offload(self) -> None:
        """Move the weights, gradients, optimizer state and buffers to the host and release
        their device memory (no-op when already offloaded)."""
        if self._host is None:
            self._host = offload(self._offload_tensors(), self.device)  # type: ignore[attr-defined]

    def onload(self) -> None:
        """Bring the state back to the device, bit-identical (no-op when resident)."""
        if self._host is not None:
            host, self._host = self._host, None
            onload(host)


def resident(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an :class:`Offloadable` engine's method that reads or writes its state: an
    offloaded engine onloads first (and stays onloaded; the roles offload it again). Works on
    generator methods too (``export_weights``)."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def gen(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            self.onload()
            yield from method(self, *args, **kwargs)

        return gen

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.onload()
        return method(self, *args, **kwargs)

    return call

"""Input validation that fails early with a message naming the argument and the problem.

Every check raises :class:`ValueError` (never ``AssertionError``) and never modifies its input.
A value of the wrong *type* (not a tensor, a tensor of the wrong dtype, a string or a tensor
where a number is expected, a float where a ``dim`` is expected) raises
:class:`InvalidTypeError`, which is both a ``ValueError`` and a ``TypeError``: ``except
ValueError`` and ``except TypeError`` both catch it. Shape, dtype and device checks are free
(metadata only); the type of a scalar hyper-parameter is checked before its value, so
``eps="x"`` names ``eps`` instead of failing inside a comparison. Value checks (NaN/inf, empty masks, index ranges) read the data, which costs a
device synchronisation on a GPU; they can be switched off in a hot loop with
:func:`value_checks`::

    with rollkit.validation.value_checks(False):
        adv = grpo_advantages(rewards, group_ids)

Tensors on the ``meta`` device have no values: a value check that meets one raises a
``ValueError`` naming the argument (:func:`values_readable`). Inside ``value_checks(False)``
nothing is read, so the primitives whose arithmetic is data-independent run on ``meta`` for
shape inference; the ones that must read data (grouping by id) refuse it by name (see
``docs/concepts.md``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import operator
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from rollkit.keys import SPECS


class InvalidTypeError(ValueError, TypeError):
    """An argument of the wrong type or dtype, named in the message
    (``x: expected a floating-point tensor, got dtype torch.int64``).

    A ``ValueError`` (what every rollkit check has always raised) and a ``TypeError`` (what
    Python raises for a wrong type), so either ``except`` clause catches it.
    """


# A context variable, not a module global: ``value_checks(False)`` in one thread or asyncio
# task leaves the checks of the others on.
_VALUE_CHECKS: contextvars.ContextVar[bool] = contextvars.ContextVar("rollkit_value_checks", default=True)


@contextlib.contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Turn the data-reading checks (finite values, non-empty masks) on or off in a block.

    The setting is per thread / asyncio task (a :class:`contextvars.ContextVar`): switching
    the checks off in one thread does not affect the others.
    """
    token = _VALUE_CHECKS.set(bool(enabled))
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def value_checks_enabled() -> bool:
    """Whether the data-reading checks are on in the current thread / task."""
    return _VALUE_CHECKS.get()


def values_readable(name: str, x: Tensor) -> bool:
    """Whether a value check of ``x`` (argument ``name``) should run: False inside
    ``value_checks(False)``; raises ``ValueError`` naming the argument if ``x`` is on the
    ``meta`` device (it has no values to check). The guard of every data-reading check."""
    if not value_checks_enabled():
        return False
    if isinstance(x, Tensor) and x.is_meta:
        raise ValueError(
            f"{name}: is on the meta device, whose values cannot be checked; run under "
            "rollkit.validation.value_checks(False) for shape inference"
        )
    return True


def _shape(x: Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


def check_tensor(name: str, x: object) -> Tensor:
    """Raise unless ``x`` is a tensor."""
    if not isinstance(x, Tensor):
        raise InvalidTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def check_ndim(name: str, x: Tensor, ndim: int | Sequence[int]) -> None:
    """Raise unless ``x.ndim`` is ``ndim`` (or one of them)."""
    check_tensor(name, x)
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if x.ndim not in allowed:
        want = " or ".join(str(a) for a in allowed)
        raise ValueError(f"{name}: expected {want} dimensions, got shape {_shape(x)}")


def check_shape(name: str, x: Tensor, shape: Sequence[int | None]) -> None:
    """Raise unless ``x.shape`` matches ``shape`` (``None`` matches any size)."""
    check_tensor(name, x)
    if x.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, x.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(x.shape)}")


def check_same_device(name: str, x: Tensor, ref_name: str, ref: Tensor) -> None:
    """Raise unless ``x`` is on the device of ``ref`` (torch would fail inside an op, or, for
    some ops with a ``meta`` index, silently return uninitialised memory)."""
    check_tensor(name, x)
    if x.device != ref.device:
        raise ValueError(f"{name}: is on device {x.device} but {ref_name} is on {ref.device}")


def check_same_shape(name: str, x: Tensor, ref_name: str, ref: Tensor) -> None:
    """Raise unless ``x`` has the shape of ``ref`` and is on its device."""
    check_tensor(name, x)
    if x.shape != ref.shape:
        raise ValueError(f"{name}: shape {list(x.shape)} does not match {ref_name} shape {list(ref.shape)}")
    check_same_device(name, x, ref_name, ref)


def check_float(name: str, x: Tensor) -> None:
    """Raise unless ``x`` has a floating-point dtype."""
    check_tensor(name, x)
    if not x.is_floating_point():
        raise InvalidTypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")


def check_mask(name: str, mask: Tensor, like: Tensor | None = None, like_name: str = "") -> None:
    """Raise unless ``mask`` is a bool tensor (of the shape and device of ``like`` when given).

    Masks must be ``torch.bool``: a float or int mask is ambiguous (weights? 0/1?) and is
    rejected rather than guessed at. Convert with ``mask.bool()``.
    """
    check_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise InvalidTypeError(
            f"{name}: expected a torch.bool mask, got dtype {mask.dtype} (convert with .bool())"
        )
    if like is not None:
        check_same_shape(name, mask, like_name or "input", like)


def check_finite(name: str, x: Tensor) -> None:
    """Raise if ``x`` holds NaN or +/-inf (skipped inside ``value_checks(False)``)."""
    check_tensor(name, x)
    if not x.is_floating_point() or not values_readable(name, x):
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(bad.sum()) - n_nan
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(f"{name}: contains {n_nan} NaN and {n_inf} inf values (first at index {first})")


def check_finite_float(name: str, x: object, ndim: int | Sequence[int] | None = None) -> Tensor:
    """Raise unless ``x`` is a floating-point tensor (with ``ndim`` dimensions, when given) of
    finite values; the usual check of rewards, returns and advantages. The finiteness part is
    skipped inside ``value_checks(False)``. Returns ``x``."""
    x = check_tensor(name, x)
    if ndim is not None:
        check_ndim(name, x, ndim)
    check_float(name, x)
    check_finite(name, x)
    return x


def check_finite_under_mask(name: str, x: Tensor, mask: Tensor) -> None:
    """Raise if ``x`` holds NaN or +/-inf where ``mask`` is True (entries outside are ignored).

    For ``[B, T]`` token tensors whose padding may hold anything. Skipped inside
    ``value_checks(False)``. ``mask`` must be a bool tensor of the shape of ``x``.
    """
    check_tensor(name, x)
    check_mask("mask", mask, x, name)
    if values_readable(name, x) and values_readable("mask", mask):
        check_finite(name, torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)))


def check_nonempty(name: str, mask: Tensor) -> None:
    """Raise if ``mask`` selects nothing (skipped inside ``value_checks(False)``)."""
    if not values_readable(name, mask):
        return
    if mask.numel() == 0 or not bool(mask.any()):
        raise ValueError(f"{name}: mask selects no elements; a mean over nothing is undefined")


def check_group_ids(name: str, group_ids: Tensor, batch_size: int | None = None) -> None:
    """Raise unless ``group_ids`` is a 1-D integer tensor (of length ``batch_size``)."""
    check_tensor(name, group_ids)
    if group_ids.dtype.is_floating_point or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise InvalidTypeError(f"{name}: expected an integer tensor, got dtype {group_ids.dtype}")
    if group_ids.ndim != 1:
        raise ValueError(f"{name}: expected shape [B], got {list(group_ids.shape)}")
    if batch_size is not None and group_ids.shape[0] != batch_size:
        raise ValueError(f"{name}: has {group_ids.shape[0]} entries but the batch has {batch_size} samples")


def check_real(name: str, value: object) -> float:
    """Return a scalar hyper-parameter as a ``float``; raise unless it is a real number (int,
    float, numpy scalar; not bool, not a tensor, not a string). NaN and inf pass: the value
    checks that follow decide about them. The type check that every scalar check does first."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidTypeError(f"{name}: expected a number, got {type(value).__name__}")
    return float(value)


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """Raise unless a scalar hyper-parameter is a number > 0 (or >= 0); NaN fails."""
    v = check_real(name, value)
    ok = v >= 0 if allow_zero else v > 0
    if not ok:  # NaN fails too
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: must be {bound}, got {value}")


def check_positive_int(name: str, value: object, *, allow_zero: bool = False) -> int:
    """Return an integral hyper-parameter (a count, a length) as an ``int``; raise unless it is
    an int, or a float with an integral value (``4096.0``), that is > 0 (or >= 0). Rejects
    bool, NaN, inf, strings and tensors."""
    if isinstance(value, float) or (
        isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
    ):
        v = check_real(name, value)
        if not (math.isfinite(v) and v == int(v)):
            raise ValueError(f"{name}: must be an integer, got {value}")
        n = int(v)
    else:
        n = check_int(name, value)
    check_positive(name, n, allow_zero=allow_zero)
    return n


def check_scalar(name: str, value: object) -> float:
    """Return ``value`` as a ``float``; raise unless it is a real number that is not NaN.

    ``+/-inf`` is allowed (one-sided bounds); ``bool`` and tensors are rejected.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name}: expected a number, got {type(value).__name__}")
    if value != value:
        raise ValueError(f"{name}: must not be NaN")
    return float(value)


def check_int(name: str, value: object) -> int:
    """Return ``value`` as an ``int``; raise unless it is an integer (numpy ints too; not bool,
    not a tensor, not a float such as ``3.0``)."""
    if isinstance(value, (bool, Tensor)):
        raise InvalidTypeError(f"{name}: expected an int, got {type(value).__name__}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidTypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def check_dim(name: str, dim: object, ndim: int, *, tensor_name: str = "x") -> tuple[int, ...] | None:
    """Return a reduction ``dim`` argument as a sorted tuple of non-negative dimensions
    (``None`` stays ``None``: reduce everything); raise naming ``name`` unless it is ``None``,
    an int or a non-empty tuple / list of distinct ints, each in ``[-ndim, ndim)`` for the
    ``ndim``-dimensional tensor ``tensor_name`` (``[-1, 0]`` for a 0-dim one, as torch).

    A wrong type (``1.0``, ``"0"``, ``True``, a tensor) is an :class:`InvalidTypeError`; an
    out-of-range dim, a repeated one (``(0, -2)`` on a 2-D tensor) or an empty tuple (torch
    reads ``()`` as "every dimension", numpy as "none"; pass ``None``) a ``ValueError``.
    """
    if dim is None:
        return None
    items = list(dim) if isinstance(dim, (tuple, list)) else [dim]
    if isinstance(dim, (tuple, list)) and not items:
        raise ValueError(f"{name}: an empty tuple is ambiguous; pass None to reduce every dimension")
    n = max(int(ndim), 1)
    out: list[int] = []
    for d in items:
        if isinstance(d, (bool, Tensor)):
            raise InvalidTypeError(f"{name}: expected an int or a tuple of ints, got {type(d).__name__}")
        try:
            d = operator.index(d)
        except TypeError:
            raise InvalidTypeError(
                f"{name}: expected an int or a tuple of ints, got {type(d).__name__}"
            ) from None
        if not -n <= d < n:
            raise ValueError(
                f"{name}: {d} is out of range for {tensor_name} with {ndim} dimension(s) "
                f"(expected an int in [{-n}, {n - 1}])"
            )
        d %= n
        if d in out:
            raise ValueError(f"{name}: dimension {d} appears more than once in {dim!r}")
        out.append(d)
    return tuple(sorted(out))


def check_real_tensor(name: str, x: object) -> Tensor:
    """Raise unless ``x`` is a tensor of a real numeric dtype: floating-point or integer (not
    bool, not complex). Returns ``x``."""
    x = check_tensor(name, x)
    if x.is_complex() or x.dtype == torch.bool:
        raise InvalidTypeError(f"{name}: expected a float or integer tensor, got dtype {x.dtype}")
    return x


def check_int_tensor(name: str, x: object) -> None:
    """Raise unless ``x`` is a tensor of an integer dtype (not bool, float or complex)."""
    x = check_tensor(name, x)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise InvalidTypeError(f"{name}: expected an integer tensor, got dtype {x.dtype}")


def check_discount(name: str, value: object) -> float:
    """Return a discount factor (``gamma``, ``lambda``) as a ``float``; raise unless it is a real
    number (int or float, not bool) in ``[0, 1]`` (NaN fails)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name}: expected a float in [0, 1], got {type(value).__name__}")
    check_in_range(name, float(value), 0.0, 1.0)
    return float(value)


def check_in_range(name: str, value: float, low: float, high: float) -> None:
    """Raise unless ``value`` is a number with ``low <= value <= high`` (NaN fails)."""
    if not (low <= check_real(name, value) <= high):
        raise ValueError(f"{name}: must be in [{low}, {high}], got {value}")


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """Raise unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: must be one of {list(choices)}, got {value!r}")


def check_batch(batch: object, keys: Sequence[str]) -> None:
    """Check a dict / TensorDict batch: the keys exist and their shapes agree with ``rollkit.keys``.

    ``[B]`` keys must share the batch size and ``[B, T]`` keys must share ``T``; masks must be
    bool; integer keys must be integers.
    """
    sizes: dict[str, tuple[int, str]] = {}
    for key in keys:
        try:
            x = batch[key]  # type: ignore[index]
        except KeyError:
            raise ValueError(f"batch: missing key {key!r}") from None
        check_tensor(key, x)
        spec = SPECS.get(key)
        if spec is None:
            continue
        if x.ndim != len(spec.shape):
            want = "[" + ", ".join(spec.shape) + "]"
            raise ValueError(f"{key}: expected shape {want}, got {list(x.shape)}")
        for sym, size in zip(spec.shape, x.shape):
            if sym in sizes and sizes[sym][0] != size:
                other_size, other_key = sizes[sym]
                raise ValueError(
                    f"{key}: dimension {sym}={size} does not match {other_key} ({sym}={other_size})"
                )
            sizes.setdefault(sym, (size, key))
        if spec.dtype == "bool":
            check_mask(key, x)
        elif spec.dtype == "float":
            check_float(key, x)
        elif x.is_floating_point() or x.dtype == torch.bool:
            raise InvalidTypeError(f"{key}: expected an integer tensor, got dtype {x.dtype}")

"""Name -> primitive registries, so that configs and ablations pick primitives by string.

A registry is a convenience over the functions, never the only way in: every registered
object is also importable by its module path. Each entry records the standard batch keys its
tensor arguments read (``in_keys``: argument name -> key of :mod:`rollkit.keys`) and the keys
it writes (``out_keys``), which the TensorDict adapters of :mod:`rollkit.td` use. Tensor
arguments are the positional ones, plus the keyword-only ones that ``in_keys`` maps (an
optional tensor such as ``ppo``'s ``is_weights``: read from the batch when present, its
default otherwise); :meth:`Entry.missing_in_keys` lists the required ones without a key.

=====================  ==============================  ======================================
``REGISTRIES`` key     registry                        entries write
=====================  ==============================  ======================================
``"advantage"``        :data:`ADVANTAGE_ESTIMATORS`    ``advantages`` (and ``returns``)
``"reward"``           :data:`REWARD_TRANSFORMS`       shaped rewards
``"filter"``           :data:`FILTERS`                 ``keep`` ([B] bool)
``"policy_loss"``      :data:`POLICY_LOSSES`           ``loss`` ([B, T]) + metrics
``"kl"``               :data:`KL_ESTIMATORS`           ``kl`` ([B, T] per-token estimate)
``"aggregation"``      :data:`AGGREGATIONS`            ``loss_objective`` (scalar)
``"regularizer"``      :data:`REGULARIZERS`            ``kl_loss`` / ``entropy_loss`` + metrics
``"value_loss"``       :data:`VALUE_LOSSES`            ``value_loss`` ([B, T]) + metrics
``"is_correction"``    :data:`IS_CORRECTIONS`          ``is_weights`` ([B, T]), ``is_metrics``
=====================  ==============================  ======================================

    >>> from rollkit.registry import ADVANTAGE_ESTIMATORS
    >>> fn = ADVANTAGE_ESTIMATORS.get("grpo")          # doctest: +SKIP
    >>> sorted(ADVANTAGE_ESTIMATORS.names())[:3]       # doctest: +SKIP

Registries load the modules that populate them on first use, so ``import rollkit`` stays cheap.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "Entry",
    "UnknownNameError",
    "FILTERS",
    "IS_CORRECTIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "REGISTRIES",
    "REGULARIZERS",
    "REWARD_TRANSFORMS",
    "Registry",
    "VALUE_LOSSES",
    "tensor_args",
]


class UnknownNameError(ValueError, KeyError):
    """A name that is not registered: a ``ValueError`` (rollkit's error for bad input) whose
    one-line message names the argument and lists the valid names. It also subclasses
    ``KeyError`` so that ``except KeyError`` written against older versions still catches it;
    ``str()`` is the plain message (``KeyError`` would quote it).

    >>> from rollkit.registry import POLICY_LOSSES
    >>> POLICY_LOSSES.get("nope")    # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rollkit.registry.UnknownNameError: name: unknown policy loss 'nope'; known: cispo, ...
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError) as e:  # pragma: no cover - builtins without signatures
        raise ValueError(f"fn_or_name: cannot read the signature of {_fn_name(fn)}: {e}") from None


def tensor_args(fn: Callable[..., Any], keyed: Sequence[str] = ()) -> dict[str, bool]:
    """The tensor arguments of a primitive: ``{name: required}``, in signature order.

    By rollkit's convention tensor arguments are the positional(-or-keyword) parameters and
    hyper-parameters are keyword-only; a keyword-only parameter named in ``keyed`` (the
    entry's ``in_keys``, e.g. an optional ``kl`` tensor) counts as a tensor argument too.

    >>> def f(logprobs, mask=None, *, kl=None, eps=0.2): ...
    >>> tensor_args(f)
    {'logprobs': True, 'mask': False}
    >>> tensor_args(f, keyed=["kl"])
    {'logprobs': True, 'mask': False, 'kl': False}
    """
    out: dict[str, bool] = {}
    for p in _signature(fn).parameters.values():
        positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        if positional or (p.kind == p.KEYWORD_ONLY and p.name in keyed):
            out[p.name] = p.default is p.empty
    return out


@dataclass(frozen=True)
class Entry:
    """One registered primitive and how it maps onto batch keys.

    ``in_keys`` maps each tensor argument of ``fn`` to a batch key; ``out_keys`` names its
    outputs in order (a :class:`~rollkit.types.LossOutput` counts as one: its ``[B, T]`` loss).
    """

    name: str
    fn: Callable[..., Any]
    in_keys: Mapping[str, str] = field(default_factory=dict)
    out_keys: Sequence[str] = ()
    doc: str = ""

    def tensor_args(self) -> dict[str, bool]:
        """``{argument: required}`` for the tensor arguments of ``fn`` (see :func:`tensor_args`;
        keyword-only arguments named in ``in_keys`` count as tensor arguments)."""
        return tensor_args(self.fn, keyed=list(self.in_keys))

    def missing_in_keys(self) -> list[str]:
        """Required tensor arguments that ``in_keys`` gives no batch key (``[]``: complete).

        >>> Entry("f", lambda rewards, group_ids: rewards, {"rewards": "rewards"}).missing_in_keys()
        ['group_ids']
        """
        return [a for a, required in self.tensor_args().items() if required and a not in self.in_keys]

    def call(self, available: Mapping[str, Any], /, **kwargs: Any) -> Any:
        """Call ``fn`` with the tensors of ``available`` (batch key -> tensor) that its
        ``in_keys`` name, plus the hyper-parameters ``kwargs``.

        A key missing from ``available`` (or mapped to ``None``) leaves an optional argument at
        its default; a required argument without a tensor raises ``ValueError`` naming it.

        >>> e = Entry("f", lambda rewards, mask=None, *, scale=1.0: rewards * scale,
        ...           {"rewards": "rewards", "mask": "response_mask"})
        >>> e.call({"rewards": 2.0, "unused": 0}, scale=3.0)
        6.0
        >>> e.call({"mask": 1})
        Traceback (most recent call last):
        ...
        ValueError: f: no tensor for the required argument(s) ['rewards'] (in_keys {'rewards': 'rewards', 'mask': 'response_mask'}; available: ['mask'])
        """
        args = {a: available[k] for a, k in self.in_keys.items() if available.get(k) is not None}
        missing = [a for a, required in self.tensor_args().items() if required and a not in args]
        if missing:
            raise ValueError(
                f"{self.name}: no tensor for the required argument(s) {missing} (in_keys "
                f"{dict(self.in_keys)}; available: {sorted(k for k, v in available.items() if v is not None)})"
            )
        return self.fn(**args, **kwargs)


class Registry:
    """A named collection of primitives of one kind (``"advantage estimator"``, ...)."""

    def __init__(self, kind: str, modules: Sequence[str] = ()) -> None:
        self.kind = kind
        self._modules = tuple(modules)
        self._loaded = False
        self._entries: dict[str, Entry] = {}
        self._aliases: dict[str, str] = {}

    def register(
        self,
        name: str,
        fn: Callable[..., Any] | None = None,
        *,
        aliases: Sequence[str] = (),
        in_keys: Mapping[str, str] | None = None,
        out_keys: Sequence[str] = (),
    ):
        """Register ``fn`` under ``name``; usable as a decorator (``@REG.register("name")``)."""

        def decorator(f: Callable[..., Any]) -> Callable[..., Any]:
            params = _signature(f).parameters
            if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                unknown = [a for a in (in_keys or {}) if a not in params]
                if unknown:
                    raise ValueError(
                        f"in_keys: {unknown} are not parameters of {self.kind} {name!r} "
                        f"({_fn_name(f)}); its parameters: {list(params)}"
                    )
            for n in (name, *aliases):
                if n in self._entries or n in self._aliases:
                    raise ValueError(f"name: {n!r} is already registered as a {self.kind}")
            doc = (f.__doc__ or "").strip().splitlines()[0] if f.__doc__ else ""
            self._entries[name] = Entry(name, f, dict(in_keys or {}), tuple(out_keys), doc)
            for a in aliases:
                self._aliases[a] = name
            return f

        return decorator(fn) if fn is not None else decorator

    def _load(self) -> None:
        # ``_loading`` guards against re-entry while the modules import (they register into
        # this registry); ``_loaded`` is only set once every import succeeded, so a failed
        # import raises again on the next call instead of leaving an empty registry.
        if self._loaded or getattr(self, "_loading", False):
            return
        self._loading = True
        try:
            for m in self._modules:
                importlib.import_module(m)
        finally:
            self._loading = False
        self._loaded = True

    def entry(self, name: str) -> Entry:
        """The :class:`Entry` registered under ``name`` (or an alias of it); an unknown name
        raises :class:`UnknownNameError` (a ``ValueError``, and a ``KeyError``) listing the
        known names."""
        self._load()
        key = self._aliases.get(name, name) if isinstance(name, str) else name
        entry = self._entries.get(key) if isinstance(key, str) else None
        if entry is None:
            raise UnknownNameError(
                f"name: unknown {self.kind} {name!r}; known: {', '.join(sorted(self.names()))}"
            )
        return entry

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered under ``name``; an unknown name raises
        :class:`UnknownNameError` (a ``ValueError`` and a ``KeyError``) listing the known names."""
        return self.entry(name).fn

    def names(self) -> list[str]:
        """Registered names (aliases not included)."""
        self._load()
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self)} entries)"


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", ["rollkit.advantages"])
REWARD_TRANSFORMS = Registry("reward transform", ["rollkit.rewards"])
FILTERS = Registry("sample filter", ["rollkit.filters"])
POLICY_LOSSES = Registry("policy loss", ["rollkit.losses"])
KL_ESTIMATORS = Registry("KL estimator", ["rollkit.losses"])
AGGREGATIONS = Registry("aggregation mode", ["rollkit.losses"])
REGULARIZERS = Registry("regularizer loss", ["rollkit.losses"])
VALUE_LOSSES = Registry("value loss", ["rollkit.losses"])
IS_CORRECTIONS = Registry("importance-sampling correction", ["rollkit.losses"])

REGISTRIES: dict[str, Registry] = {
    "advantage": ADVANTAGE_ESTIMATORS,
    "reward": REWARD_TRANSFORMS,
    "filter": FILTERS,
    "policy_loss": POLICY_LOSSES,
    "kl": KL_ESTIMATORS,
    "aggregation": AGGREGATIONS,
    "regularizer": REGULARIZERS,
    "value_loss": VALUE_LOSSES,
    "is_correction": IS_CORRECTIONS,
}

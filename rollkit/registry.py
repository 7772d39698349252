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

Conventions (verl's): registering the same function object again under its name is a no-op (a
registration that runs twice, e.g. a notebook cell run again), while a *different* function
under a taken name raises ``ValueError``; an :class:`enum.Enum` member works wherever a name
does, standing for its ``.value``. :func:`check_kwargs` checks hyper-parameters against a
primitive's signature (the reference trainers check every ``*_kwargs`` field with it when they
parse their config).
"""

from __future__ import annotations

import enum
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
    "check_kwargs",
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


def check_kwargs(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any],
    *,
    field: str = "kwargs",
    name: str = "",
    kind: str = "function",
    supplied: Sequence[str] = (),
) -> None:
    """Check that ``fn(**supplied_tensors, **kwargs)`` takes every key of ``kwargs``, before it is
    called: a bad key raises a one-line ``ValueError`` naming ``field``, the key and the accepted
    keys.

    Accepted keys: the parameters of ``fn`` that can be passed by keyword, minus ``supplied``
    (the arguments the caller fills itself, e.g. the tensors a registry entry reads from the
    batch, which a key of ``kwargs`` would collide with); with ``**kwargs`` in the signature any
    other key is accepted too. ``name`` (default: ``fn``'s) and ``kind`` word the message.

    >>> def clip(logprobs, *, clip_low=0.2, clip_high=0.2): ...
    >>> check_kwargs(clip, {"clip_high": 0.28}, supplied=["logprobs"])
    >>> check_kwargs(clip, {"clip_hihg": 0.28}, field="algorithm.policy_loss_kwargs",
    ...              name="ppo", kind="policy loss", supplied=["logprobs"])
    Traceback (most recent call last):
    ...
    ValueError: algorithm.policy_loss_kwargs: ppo does not take 'clip_hihg' (unknown key for the policy loss clip; accepted: clip_high, clip_low)
    """
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{field}: expected a mapping of keyword arguments, got {kwargs!r}")
    params = _signature(fn).parameters.values()
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = sorted(p.name for p in params if p.kind in by_keyword and p.name not in supplied)
    listed = ", ".join(accepted) or "none"
    if var_kw:
        listed += f"{', ' if accepted else ''}any other keyword (**kwargs)"
    name = name or _fn_name(fn)
    clash = [k for k in kwargs if k in supplied]
    if clash:
        raise ValueError(
            f"{field}: {name} does not take {', '.join(map(repr, clash))} (read from the batch by the "
            f"{kind} {_fn_name(fn)}, not a hyper-parameter; accepted: {listed})"
        )
    bad = [] if var_kw else [k for k in kwargs if k not in accepted]
    if bad:
        keys = "keys" if len(bad) > 1 else "key"
        raise ValueError(
            f"{field}: {name} does not take {', '.join(map(repr, bad))} (unknown {keys} for the "
            f"{kind} {_fn_name(fn)}; accepted: {listed})"
        )


def _name(name: Any, what: str = "name") -> str:
    """``name`` as a registry key: an :class:`enum.Enum` member stands for its ``.value``."""
    key = name.value if isinstance(name, enum.Enum) else name
    if not isinstance(key, str) or not key:
        raise ValueError(f"{what}: expected a non-empty str or an Enum member with a str value, got {name!r}")
    return key


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
        name: str | enum.Enum,
        fn: Callable[..., Any] | None = None,
        *,
        aliases: Sequence[str | enum.Enum] = (),
        in_keys: Mapping[str, str] | None = None,
        out_keys: Sequence[str] = (),
    ):
        """Register ``fn`` under ``name``; usable as a decorator (``@REG.register("name")``).

        ``name`` and ``aliases`` may be :class:`enum.Enum` members (registered under their
        ``.value``). Registering the same function again under its name is a no-op (new aliases
        are added); a name or alias that another function holds raises ``ValueError``.

        >>> import enum
        >>> class Est(enum.Enum):
        ...     DOUBLE = "double"
        >>> reg = Registry("widget")
        >>> def double(x): return 2 * x
        >>> _ = reg.register(Est.DOUBLE, double)
        >>> _ = reg.register("double", double)          # again: a no-op
        >>> reg.get(Est.DOUBLE) is reg.get("double") is double
        True
        >>> reg.register("double", lambda x: 3 * x)
        Traceback (most recent call last):
        ...
        ValueError: name: 'double' is already registered as a widget (to double); register <lambda> under another name
        """

        def decorator(f: Callable[..., Any]) -> Callable[..., Any]:
            key, alias_keys = _name(name), [_name(a, "aliases") for a in aliases]
            params = _signature(f).parameters
            if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                unknown = [a for a in (in_keys or {}) if a not in params]
                if unknown:
                    raise ValueError(
                        f"in_keys: {unknown} are not parameters of {self.kind} {key!r} "
                        f"({_fn_name(f)}); its parameters: {list(params)}"
                    )
            doc = (f.__doc__ or "").strip().splitlines()[0] if f.__doc__ else ""
            self._add(Entry(key, f, dict(in_keys or {}), tuple(out_keys), doc), alias_keys)
            return f

        return decorator(fn) if fn is not None else decorator

    def _add(self, entry: Entry, aliases: Sequence[str]) -> None:
        """Add ``entry`` and its ``aliases``, all or nothing: the same function under its own
        name again (same ``in_keys`` / ``out_keys``) only adds new aliases; a taken name raises."""
        old = self._entries.get(entry.name)
        same = old is not None and old.fn is entry.fn
        keys = (dict(entry.in_keys), tuple(entry.out_keys))
        if same and (dict(old.in_keys), tuple(old.out_keys)) != keys:
            raise ValueError(
                f"name: {entry.name!r} is already registered as a {self.kind} ({_fn_name(entry.fn)}) with "
                f"in_keys {dict(old.in_keys)}, out_keys {list(old.out_keys)}; register it with the same ones"
            )
        for n in (entry.name, *aliases):
            owner = n if n in self._entries else self._aliases.get(n)
            if owner is not None and not (same and owner == entry.name):
                holder, new = _fn_name(self._entries[owner].fn), _fn_name(entry.fn)
                holder = f"another function named {holder}" if holder == new else holder  # e.g. reloaded
                raise ValueError(
                    f"name: {n!r} is already registered as a {self.kind} (to {holder}); "
                    f"register {new} under another name"
                )
        if not same:
            self._entries[entry.name] = entry
        for a in aliases:
            self._aliases[a] = entry.name

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

    def entry(self, name: str | enum.Enum) -> Entry:
        """The :class:`Entry` registered under ``name`` (or an alias of it); an unknown name
        raises :class:`UnknownNameError` (a ``ValueError``, and a ``KeyError``) listing the
        known names."""
        self._load()
        name = name.value if isinstance(name, enum.Enum) else name
        key = self._aliases.get(name, name) if isinstance(name, str) else name
        entry = self._entries.get(key) if isinstance(key, str) else None
        if entry is None:
            raise UnknownNameError(
                f"name: unknown {self.kind} {name!r}; known: {', '.join(sorted(self.names()))}"
            )
        return entry

    def get(self, name: str | enum.Enum) -> Callable[..., Any]:
        """The function registered under ``name``; an unknown name raises
        :class:`UnknownNameError` (a ``ValueError`` and a ``KeyError``) listing the known names."""
        return self.entry(name).fn

    def check_kwargs(self, name: str | enum.Enum, kwargs: Mapping[str, Any], field: str = "kwargs") -> None:
        """Check the hyper-parameters ``kwargs`` that :meth:`Entry.call` would pass to the entry
        ``name`` (:func:`check_kwargs`): its ``in_keys`` arguments and required tensor arguments
        come from the batch, so they are refused too. A bad key raises a one-line ``ValueError``
        naming ``field``, the key and the accepted keys; an unknown ``name`` raises
        :class:`UnknownNameError`.

        >>> from rollkit.registry import POLICY_LOSSES
        >>> POLICY_LOSSES.check_kwargs("ppo", {"clip_high": 0.28})
        >>> POLICY_LOSSES.check_kwargs("ppo", {"advantages": 1.0}, "algorithm.policy_loss_kwargs")
        Traceback (most recent call last):
        ...
        ValueError: algorithm.policy_loss_kwargs: ppo does not take 'advantages' (read from the batch by the policy loss ppo_clip, not a hyper-parameter; accepted: clip_high, clip_low, dual_clip, log_ratio_clamp)
        """
        e = self.entry(name)
        supplied = [*e.in_keys, *(a for a, required in e.tensor_args().items() if required)]
        shown = name.value if isinstance(name, enum.Enum) else name
        check_kwargs(e.fn, kwargs, field=field, name=str(shown), kind=self.kind, supplied=supplied)

    def names(self) -> list[str]:
        """Registered names (aliases not included)."""
        self._load()
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load()
        name = name.value if isinstance(name, enum.Enum) else name
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self)} entries)"


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", ["rollkit.advantages", "rollkit.critics"])
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

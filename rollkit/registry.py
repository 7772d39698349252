"""Name -> primitive registries, so that configs and ablations pick primitives by string.

A registry is a convenience over the functions, never the only way in: every registered
object is also importable by its module path. Each entry records the standard batch keys its
tensor arguments read (``in_keys``: argument name -> key of :mod:`rollkit.keys`) and the keys
it writes (``out_keys``), which the TensorDict adapters of :mod:`rollkit.td` use.

    >>> from rollkit.registry import ADVANTAGE_ESTIMATORS
    >>> fn = ADVANTAGE_ESTIMATORS.get("grpo")          # doctest: +SKIP
    >>> sorted(ADVANTAGE_ESTIMATORS.names())[:3]       # doctest: +SKIP

Registries load the modules that populate them on first use, so ``import rollkit`` stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "Entry",
    "FILTERS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "REGISTRIES",
    "REWARD_TRANSFORMS",
    "Registry",
]


@dataclass(frozen=True)
class Entry:
    """One registered primitive and how it maps onto batch keys."""

    name: str
    fn: Callable[..., Any]
    in_keys: Mapping[str, str] = field(default_factory=dict)
    out_keys: Sequence[str] = ()
    doc: str = ""


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
        if not self._loaded:
            self._loaded = True
            for m in self._modules:
                importlib.import_module(m)

    def entry(self, name: str) -> Entry:
        """The :class:`Entry` registered under ``name`` (or an alias of it)."""
        self._load()
        key = self._aliases.get(name, name)
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self.names()))}"
            ) from None

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered under ``name``; ``KeyError`` lists the known names."""
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

REGISTRIES: dict[str, Registry] = {
    "advantage": ADVANTAGE_ESTIMATORS,
    "reward": REWARD_TRANSFORMS,
    "filter": FILTERS,
    "policy_loss": POLICY_LOSSES,
    "kl": KL_ESTIMATORS,
    "aggregation": AGGREGATIONS,
}

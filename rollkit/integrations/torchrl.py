"""rollkit policy losses as torchrl ``LossModule`` s.

:class:`RollkitLossModule` runs an actor network on the batch (it writes the log-probs of the
taken tokens), then a rollkit policy loss and an aggregation, and returns a scalar TensorDict
with ``"loss_objective"`` plus the loss's metrics, the way torchrl's ``ClipPPOLoss`` and
``GRPOLoss`` do. The batch keys it reads are configurable with torchrl's ``set_keys``
(``loss.set_keys(advantages="adv")``), its ``_AcceptedKeys`` being rollkit's standard keys.

torchrl is an optional dependency (``pip install 'rollkit-rl[torchrl]'``); it is imported when
``RollkitLossModule`` is first accessed, not when this module is imported::

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tensordict.nn import TensorDictModule
    >>> from rollkit.integrations.torchrl import RollkitLossModule
    >>> class TokenLogProbs(torch.nn.Module):
    ...     def __init__(self, vocab=5, dim=4):
    ...         super().__init__()
    ...         self.emb, self.head = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab)
    ...     def forward(self, prev_tokens, tokens):       # [B, T], [B, T] -> [B, T]
    ...         logits = self.head(self.emb(prev_tokens))
    ...         return logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    >>> actor = TensorDictModule(TokenLogProbs(), in_keys=["prev_tokens", "tokens"], out_keys=["logprobs"])
    >>> loss_fn = RollkitLossModule(actor, "ppo", aggregation="token-mean", clip_low=0.2, clip_high=0.28)
    >>> g = torch.Generator().manual_seed(0)
    >>> tokens = torch.randint(0, 5, (3, 4), generator=g)
    >>> batch = TensorDict(
    ...     {
    ...         "prev_tokens": tokens.roll(1, dims=-1),
    ...         "tokens": tokens,
    ...         "old_logprobs": torch.full((3, 4), -1.6),
    ...         "advantages": torch.tensor([1.0, -0.5, 0.0]),
    ...         "response_mask": torch.tensor([[True] * 4, [True, True, False, False], [True] * 4]),
    ...     },
    ...     batch_size=[3],
    ... )
    >>> out = loss_fn(batch)
    >>> out["loss_objective"].shape, "clip_frac" in out.keys()
    (torch.Size([]), True)
    >>> out["loss_objective"].backward()

(the full, runnable example is in ``docs/tensordict.md`` and ``tests/test_interop_torchrl.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import field, make_dataclass
from typing import Any

from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor

from rollkit import keys as K
from rollkit.registry import POLICY_LOSSES
from rollkit.td import resolve, td_loss

__all__ = ["RollkitLossModule"]  # noqa: F822 (built lazily by the module __getattr__)

#: Batch keys a :class:`RollkitLossModule` reads, remappable with ``set_keys`` (each defaults to
#: itself): the standard keys of :mod:`rollkit.keys` a policy loss or aggregation can read.
_ACCEPTED_KEYS = (
    "logprobs",
    "old_logprobs",
    "behavior_logprobs",
    "ref_logprobs",
    "advantages",
    "response_mask",
    "values",
    "old_values",
    "returns",
    "rewards",
    "token_rewards",
    "group_ids",
    "sample_weights",
    "is_weights",
)

_INSTALL_HINT = "rollkit.integrations.torchrl needs torchrl: pip install 'rollkit-rl[torchrl]'"


def _require_torchrl():
    try:
        from torchrl.objectives import LossModule
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    return LossModule


#: torchrl's ``_AcceptedKeys``: every accepted key defaults to itself
_ACCEPTED_KEYS_CLASS = make_dataclass(
    "_AcceptedKeys", [(k, NestedKey, field(default=k)) for k in _ACCEPTED_KEYS]
)


class _RollkitLoss:
    """A rollkit policy loss (+ aggregation) as a torchrl ``LossModule``.

    ``forward(td)`` copies ``td`` (shallow: the input is never modified), runs
    ``actor_network`` on the copy to get the current log-probs of the taken tokens at
    ``tensor_keys.logprobs``, calls the policy loss with its tensor arguments read from the
    batch, aggregates the ``[B, T]`` loss over ``tensor_keys.response_mask`` and returns a
    ``TensorDict`` with ``batch_size=[]``: ``"loss_objective"`` (a scalar carrying the
    gradient) and the loss's metrics (detached scalars) under their rollkit names.

    Args:
        actor_network: a ``TensorDictModule`` (or ``TensorDictSequential`` /
            ``ProbabilisticTensorDictSequential``) that writes the taken tokens' log-probs at
            ``tensor_keys.logprobs``; or a callable ``td -> Tensor [B, T]`` (the log-probs) or
            ``td -> TensorDict``; or ``None`` when the batch already holds the log-probs.
        policy_loss: a name of :data:`rollkit.registry.POLICY_LOSSES` (``"ppo"``, ``"cispo"``,
            ...) or a function returning a :class:`rollkit.types.LossOutput`.
        aggregation: a name of :data:`rollkit.registry.AGGREGATIONS` or a function
            ``(loss [B, T], mask [B, T], ...) -> scalar``.
        aggregation_kwargs: keyword arguments of the aggregation (global normalisers:
            ``num_tokens``, ``num_seqs``, ``dp_size``...); assign
            ``module.aggregation_kwargs = {...}`` to change them between steps.
        in_keys: ``{argument name: standard key}`` overriding the policy loss's registered
            keys (the standard key is then mapped through ``tensor_keys``).
        **hyper: the policy loss's hyper-parameters (``clip_low=0.2, clip_high=0.28`` for
            ``"ppo"``...).

    Keys (``set_keys``): every standard key of :mod:`rollkit.keys` is an accepted key,
    defaulting to itself: ``logprobs``, ``old_logprobs``, ``behavior_logprobs``,
    ``ref_logprobs``, ``advantages``, ``response_mask``, ``values``, ``old_values``,
    ``returns``, ``rewards``, ``token_rewards``, ``group_ids``, ``sample_weights`` (optional
    per-sample weights of a registered aggregation) and ``is_weights`` (optional IS weights
    of ``"ppo"``). Optional keys are listed in ``in_keys`` and used when the batch has them.

    Differs from torchrl's ``ClipPPOLoss``/``GRPOLoss``: no entropy bonus or KL term is
    added here (compose them as further rollkit losses), the mask is rollkit's
    ``response_mask`` rather than torchrl's "auto" mask discovery, and the actor must
    produce log-probs of the taken tokens, not a distribution.
    """

    _AcceptedKeys = _ACCEPTED_KEYS_CLASS

    default_keys = _AcceptedKeys

    def __init__(
        self,
        actor_network: Callable[..., Any] | None = None,
        policy_loss: str | Callable[..., Any] = "ppo",
        *,
        aggregation: str | Callable[..., Any] = "token-mean",
        aggregation_kwargs: Mapping[str, Any] | None = None,
        in_keys: Mapping[str, str] | None = None,
        **hyper: Any,
    ) -> None:
        super().__init__()
        self.actor_network = actor_network
        self._policy_loss = policy_loss
        self._aggregation = aggregation
        self._arg_overrides = dict(in_keys or {})
        self._hyper = dict(hyper)
        self._aggregation_kwargs = dict(aggregation_kwargs or {})
        self._build()

    @property
    def functional(self) -> bool:
        return False

    @property
    def aggregation_kwargs(self) -> dict[str, Any]:
        return dict(self._aggregation_kwargs)

    @aggregation_kwargs.setter
    def aggregation_kwargs(self, value: Mapping[str, Any]) -> None:
        self._aggregation_kwargs = dict(value)
        self._build()

    def _key(self, standard: Any) -> Any:
        if isinstance(standard, str) and standard in self._AcceptedKeys.__dataclass_fields__:
            return getattr(self.tensor_keys, standard)
        return standard

    def _aggregation_keys(self) -> dict[str, Any]:
        """The aggregation's batch keys, mapped through ``tensor_keys`` (a registered
        aggregation reads ``mask`` and the optional ``weights``)."""
        if not isinstance(self._aggregation, str):
            return {"mask": self.tensor_keys.response_mask}
        entry = resolve(self._aggregation, "aggregation")
        return {a: self._key(k) for a, k in entry.in_keys.items() if k != K.LOSS}

    def _build(self) -> None:
        registry = POLICY_LOSSES if isinstance(self._policy_loss, str) else None
        entry = resolve(self._policy_loss, registry)
        standard = {**entry.in_keys, **self._arg_overrides}
        arg_keys = {a: self._key(k) for a, k in standard.items()}
        agg_registry = "aggregation" if isinstance(self._aggregation, str) else None
        self.loss = td_loss(
            self._policy_loss,
            registry=registry,
            aggregation=self._aggregation,
            aggregation_registry=agg_registry,
            in_keys=arg_keys,
            aggregation_in_keys=self._aggregation_keys(),
            aggregation_kwargs=self._aggregation_kwargs,
            loss_key="loss_objective",
            **self._hyper,
        )
        actor_in = list(getattr(self.actor_network, "in_keys", []) or [])
        produced = {self.tensor_keys.logprobs} if self.actor_network is not None else set()
        self._in_keys = list(dict.fromkeys([*actor_in, *(k for k in self.loss.in_keys if k not in produced)]))

    def _forward_value_estimator_keys(self, **kwargs: Any) -> None:
        # no value estimator: refresh the keys the loss reads
        self._build()

    @property
    def in_keys(self) -> list[Any]:
        return self._in_keys

    @in_keys.setter
    def in_keys(self, value: list[Any]) -> None:
        self._in_keys = list(value)

    @property
    def out_keys(self) -> list[Any]:
        return ["loss_objective"]

    @out_keys.setter
    def out_keys(self, value: list[Any]) -> None:  # set by TensorDictModuleBase
        pass

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        td = tensordict.copy()
        actor = self.actor_network
        if actor is not None:
            if isinstance(actor, TensorDictModuleBase):
                td = actor(td)
            else:
                result = actor(td)
                if isinstance(result, TensorDictBase):
                    td = result
                elif isinstance(result, Tensor):
                    td.set(self.tensor_keys.logprobs, result)
                else:
                    raise ValueError(
                        "actor_network: expected a Tensor of log-probs or a TensorDict, got "
                        f"{type(result).__name__}"
                    )
            if self.tensor_keys.logprobs not in td.keys(include_nested=True):
                raise ValueError(
                    f"actor_network: did not write the log-probs key {self.tensor_keys.logprobs!r}"
                )
        return self.loss(td)


@functools.lru_cache(maxsize=1)
def _build_class() -> type:
    """``RollkitLossModule``: :class:`_RollkitLoss` on torchrl's ``LossModule`` (torchrl is
    imported here, on first use)."""
    cls = type("RollkitLossModule", (_RollkitLoss, _require_torchrl()), {"__doc__": _RollkitLoss.__doc__})
    cls.__module__ = __name__
    return cls


def __getattr__(name: str) -> Any:
    if name == "RollkitLossModule":
        return _build_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

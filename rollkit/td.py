"""TensorDict adapters: run any rollkit primitive on a TensorDict batch by standard key names.

Every primitive takes plain tensors. :func:`td_module` wraps one (a function, or a name in one
of the registries of :mod:`rollkit.registry`) in a :class:`tensordict.nn.TensorDictModule` that
reads the tensor arguments from the batch under the keys of the registry entry (``in_keys``:
argument name -> batch key, overridable), calls the function with *keyword* arguments and
writes the results under ``out_keys``. The modules compose with
:class:`tensordict.nn.TensorDictSequential`: an advantage estimator, a policy loss and an
aggregation run as one pipeline over one batch::

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tensordict.nn import TensorDictSequential
    >>> from rollkit.td import td_module
    >>> pipe = TensorDictSequential(
    ...     td_module("grpo", registry="advantage", broadcast=True),       # [B] -> [B, T]
    ...     td_module("ppo", registry="policy_loss", clip_low=0.2, clip_high=0.28),
    ...     td_module("token-mean", registry="aggregation", out_keys=["loss_objective"]),
    ... )
    >>> td = TensorDict(
    ...     rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
    ...     group_ids=torch.tensor([7, 7, 3, 3]),
    ...     logprobs=torch.full((4, 2), -1.0, requires_grad=True),
    ...     old_logprobs=torch.full((4, 2), -1.0),
    ...     response_mask=torch.tensor([[True, True], [True, False], [True, True], [True, False]]),
    ...     batch_size=[4],
    ... )
    >>> out = pipe(td.copy())                      # .copy(): leave ``td`` untouched
    >>> sorted(out.keys()) == sorted([*td.keys(), "advantages", "loss", "loss_metrics", "loss_objective"])
    True
    >>> "advantages" in td
    False
    >>> # on-policy (ratio 1) the PPO token loss is -A, and token-mean averages it over 6 tokens
    >>> torch.allclose(out["loss_objective"], -out["advantages"].sum() / 6)
    True
    >>> out["loss_objective"].backward()           # a scalar in a [B] batch: stored as non-tensor

The real primitives are loaded by name the same way: ``td_module("grpo",
registry="advantage", eps=1e-6)``; keyword arguments that are not adapter options are the
primitive's hyper-parameters.

Conventions (one behaviour each):

* **Where outputs go.** A ``Tensor`` output whose leading dims equal the batch size (``[B]``,
  ``[B, T]``) is stored as a tensor. Anything else (a 0-dim scalar from an aggregation, the
  metrics ``dict`` of a :class:`~rollkit.types.LossOutput`) cannot live in a ``[B]`` batch as a
  tensor and is stored as :class:`tensordict.NonTensorData`: ``td[key]`` returns the tensor /
  dict unchanged (gradients included), and ``td[index]`` carries it along.
* **LossOutput.** The ``[B, T]`` loss goes to ``out_keys[0]``; the metrics dict to
  ``metrics_key`` (default: ``out_keys[1]`` when the entry declares two out keys, else
  ``f"{out_keys[0]}_metrics"``; ``None`` drops them). Use :func:`td_loss` for a scalar loss
  TensorDict (``batch_size=[]``) with the metrics as top-level entries, like torchrl's losses.
* **Tuples** (GAE's ``(advantages, returns)``) go to ``out_keys`` in order.
* **[B] outputs** are written with the batch shape; ``broadcast=True`` spreads every ``[B]``
  float output over the tokens of ``mask_key`` (zero outside the mask) with
  :func:`rollkit.ops.broadcast_to_tokens`.
* **Filters** write a ``[B]`` bool keep-mask (``"keep"``); :func:`apply_keep` selects the rows.
* **Mutation.** ``TensorDictModule`` writes its outputs into the TensorDict it is given: with the
  default ``inplace=True`` the declared ``out_keys`` are set (entries are replaced, no tensor
  of the batch is modified in place) and nothing else is touched. ``inplace=False`` returns a
  new TensorDict holding only the outputs (tensordict's semantics: ``batch_size=[]``);
  ``inplace="empty"`` a new one with the input's batch size and device. To keep the input
  intact but get inputs + outputs, call the module (or a ``TensorDictSequential``) on
  ``td.copy()``, a cheap shallow copy.
* **Missing keys** raise ``ValueError`` naming the key, the argument and the primitive, before
  the call. Optional tensor arguments (with a default) whose key is absent get their default.
  Shapes and dtypes are checked by the primitive's own validation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from torch import Tensor, nn

from rollkit.ops import broadcast_to_tokens
from rollkit.registry import REGISTRIES, Entry, Registry, _fn_name, _signature, tensor_args
from rollkit.types import LossOutput
from rollkit.validation import check_mask, check_shape

__all__ = [
    "KEEP",
    "PrimitiveModule",
    "TDLoss",
    "apply_keep",
    "missing_in_keys",
    "resolve",
    "tensor_args",
    "td_loss",
    "td_module",
]

KEEP = "keep"
"""Key under which filter adapters write their ``[B]`` bool keep-mask."""

_AUTO = "auto"


# --------------------------------------------------------------------------------------------
# Registry resolution and signature introspection
# --------------------------------------------------------------------------------------------


def _as_registry(registry: str | Registry | None) -> list[Registry]:
    if registry is None:
        return list(REGISTRIES.values())
    if isinstance(registry, Registry):
        return [registry]
    if isinstance(registry, str):
        if registry not in REGISTRIES:
            raise ValueError(f"registry: unknown registry {registry!r}; known: {sorted(REGISTRIES)}")
        return [REGISTRIES[registry]]
    raise ValueError(f"registry: expected a name, a Registry or None, got {type(registry).__name__}")


def resolve(fn_or_name: str | Callable[..., Any], registry: str | Registry | None = None) -> Entry:
    """The registry :class:`~rollkit.registry.Entry` of a name or function.

    A name is looked up in ``registry`` (a key of :data:`rollkit.registry.REGISTRIES`, a
    :class:`Registry`, or ``None`` for all of them; a name found in several registries, e.g.
    ``"grpo"``, must name its registry). A function registered somewhere gets its entry; an
    unregistered callable gets an entry with no keys (pass ``in_keys``/``out_keys``).

    >>> from rollkit.registry import Registry
    >>> REG = Registry("example")
    >>> _ = REG.register("double", lambda x: 2 * x, in_keys={"x": "rewards"}, out_keys=["y"])
    >>> resolve("double", REG).in_keys
    {'x': 'rewards'}
    """
    regs = _as_registry(registry)
    if isinstance(fn_or_name, str):
        found = [(r, r.entry(fn_or_name)) for r in regs if fn_or_name in r]
        if not found:
            where = regs[0].kind if len(regs) == 1 else "any registry"
            known = sorted({n for r in regs for n in r.names()})
            raise ValueError(f"fn_or_name: {fn_or_name!r} is not registered in {where}; known: {known}")
        if len(found) > 1:
            kinds = [k for k, r in REGISTRIES.items() if any(r is f[0] for f in found)]
            raise ValueError(
                f"fn_or_name: {fn_or_name!r} is registered in several registries {kinds}; "
                "pass registry=... to choose"
            )
        return found[0][1]
    if not callable(fn_or_name):
        raise ValueError(f"fn_or_name: expected a name or a callable, got {type(fn_or_name).__name__}")
    for r in regs:
        for name in r.names():
            e = r.entry(name)
            if e.fn is fn_or_name:
                return e
    return Entry(_fn_name(fn_or_name), fn_or_name, {}, ())


def missing_in_keys(entry: Entry) -> list[str]:
    """Required tensor arguments of ``entry.fn`` that ``entry.in_keys`` gives no batch key.

    An empty list means the entry's metadata is complete enough for :func:`td_module`.

    >>> from rollkit.registry import Entry
    >>> missing_in_keys(Entry("f", lambda rewards, group_ids: rewards, {"rewards": "rewards"}))
    ['group_ids']
    """
    return entry.missing_in_keys()


def _returns_loss_output(fn: Callable[..., Any]) -> bool:
    ann = _signature(fn).return_annotation
    if ann is LossOutput:
        return True
    return isinstance(ann, str) and "LossOutput" in ann


# --------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------


class _Call(nn.Module):
    """Maps the positional tensors of TensorDictModule back to keyword arguments."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        arg_names: Sequence[str],
        optional: set[str],
        hyper: Mapping[str, Any],
        *,
        loss_output: bool,
        keep_metrics: bool,
        n_out: int,
        broadcast: bool,
    ) -> None:
        super().__init__()
        self.fn = fn
        self.name = name
        self.arg_names = list(arg_names)
        self.optional = set(optional)
        self.hyper = dict(hyper)
        self.loss_output = loss_output
        self.keep_metrics = keep_metrics
        self.n_out = n_out
        self.broadcast = broadcast

    def forward(self, *tensors: Any) -> tuple[Any, ...]:
        n = len(self.arg_names)
        kwargs = {a: t for a, t in zip(self.arg_names, tensors[:n]) if not (t is None and a in self.optional)}
        out = self.fn(**kwargs, **self.hyper)
        if isinstance(out, LossOutput):
            if self.n_out == 1 and self.loss_output is False:
                raise ValueError(
                    f"{self.name}: returned a LossOutput but the adapter has one out key; pass "
                    "metrics_key='...' to keep its metrics or metrics_key=None to drop them"
                )
            outs: tuple[Any, ...] = (out.loss, out.metrics) if self.keep_metrics else (out.loss,)
        elif isinstance(out, Tensor):
            outs = (out,)
        elif isinstance(out, (tuple, list)):
            outs = tuple(out)
        else:
            outs = (out,)
        if len(outs) != self.n_out:
            raise ValueError(
                f"out_keys: {self.name} returned {len(outs)} output(s) but {self.n_out} out key(s) were given"
            )
        if self.broadcast:
            mask = tensors[n]
            outs = tuple(
                broadcast_to_tokens(o, mask)
                if isinstance(o, Tensor) and o.ndim == 1 and o.is_floating_point()
                else o
                for o in outs
            )
        return outs


class PrimitiveModule(TensorDictModule):
    """A :class:`~tensordict.nn.TensorDictModule` running one rollkit primitive; build it with
    :func:`td_module`.

    Differs from a plain ``TensorDictModule`` in three ways: the function is called with keyword
    arguments (``arg_keys`` maps argument names to batch keys), a missing required key raises a
    ``ValueError`` naming it before the call, and outputs that do not have the batch's leading
    shape (scalars, metric dicts) are stored as ``NonTensorData`` instead of failing.
    """

    def __init__(
        self,
        call: _Call,
        arg_keys: Mapping[str, Any],
        out_keys: Sequence[Any],
        *,
        mask_key: Any = None,
        inplace: bool | str = True,
    ) -> None:
        in_keys = [arg_keys[a] for a in call.arg_names]
        if mask_key is not None:
            in_keys.append(mask_key)
        super().__init__(call, in_keys=in_keys, out_keys=list(out_keys), inplace=inplace, strict=False)
        self.primitive = call.name
        self.arg_keys = dict(arg_keys)
        self._required = [(a, arg_keys[a]) for a in call.arg_names if a not in call.optional]
        if mask_key is not None:
            self._required.append(("mask (broadcast)", mask_key))

    def forward(self, tensordict: TensorDictBase | None = None, *args: Any, **kwargs: Any):
        if isinstance(tensordict, TensorDictBase):
            for arg, key in self._required:
                if key not in tensordict.keys(include_nested=True):
                    raise ValueError(
                        f"{self.primitive}: the batch has no key {key!r} (argument {arg!r}); "
                        f"keys present: {sorted(map(str, tensordict.keys()))}. "
                        "Add it or remap it with in_keys={...}"
                    )
        if tensordict is None:
            return super().forward(*args, **kwargs)
        return super().forward(tensordict, *args, **kwargs)

    def _write_to_tensordict(
        self,
        tensordict: TensorDictBase,
        tensors: Sequence[Any],
        tensordict_out: TensorDictBase | None = None,
        out_keys: Sequence[Any] | None = None,
    ) -> TensorDictBase:
        if out_keys is None:
            out_keys = self.out_keys_source
        if tensordict_out is None:
            if self.inplace is True:
                tensordict_out = tensordict
            elif self.inplace == "empty":
                tensordict_out = tensordict.empty()
            else:
                tensordict_out = TensorDict()
        if len(tensors) != len(out_keys):
            raise ValueError(
                f"out_keys: {self.primitive} returned {len(tensors)} output(s) for {len(out_keys)} out key(s)"
            )
        bs = tensordict_out.batch_size
        for key, value in zip(out_keys, tensors):
            if key == "_":
                continue
            if isinstance(value, Tensor) and value.shape[: len(bs)] == bs:
                tensordict_out.set(key, value)
            else:
                tensordict_out.set_non_tensor(key, value)
        return tensordict_out

    def extra_repr(self) -> str:
        return f"primitive={self.primitive!r}"


def _resolve_arg_keys(
    entry: Entry, fn: Callable[..., Any], in_keys: Mapping[str, Any] | None, *, what: str
) -> tuple[dict[str, Any], set[str]]:
    args = tensor_args(fn, keyed=[*entry.in_keys, *(in_keys or {})])
    for a in entry.in_keys:
        if a not in args:
            raise ValueError(
                f"in_keys: registry entry {what} maps {a!r}, which is not a parameter of {_fn_name(fn)}"
            )
    if in_keys is not None:
        for a in in_keys:
            if a not in args:
                raise ValueError(
                    f"in_keys: {a!r} is not a tensor argument of {what}; its tensor arguments: {list(args)}"
                )
    merged = {**entry.in_keys, **(in_keys or {})}
    missing = [a for a, required in args.items() if required and a not in merged]
    if missing:
        raise ValueError(
            f"in_keys: {what} has tensor argument(s) {missing} with no batch key; register them "
            f"with in_keys={{...}} or pass in_keys={{{missing[0]!r}: '<key>'}}"
        )
    arg_keys = {a: merged[a] for a in args if a in merged}
    optional = {a for a, required in args.items() if not required}
    return arg_keys, optional


def _check_hyper(fn: Callable[..., Any], hyper: Mapping[str, Any], arg_keys: Mapping[str, Any], what: str):
    params = _signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    for h in hyper:
        if h not in params:
            raise ValueError(f"{h}: is not a parameter of {what}; its parameters: {list(params)}")
        if h in arg_keys:
            raise ValueError(f"{h}: is read from the batch (in_keys) and also given as a hyper-parameter")


def _suffixed(key: Any, suffix: str) -> Any:
    if isinstance(key, tuple):
        return (*key[:-1], f"{key[-1]}{suffix}")
    return f"{key}{suffix}"


def td_module(
    fn_or_name: str | Callable[..., Any],
    *,
    registry: str | Registry | None = None,
    in_keys: Mapping[str, Any] | None = None,
    out_keys: Sequence[Any] | None = None,
    metrics_key: Any = _AUTO,
    broadcast: bool = False,
    mask_key: Any = "response_mask",
    inplace: bool | str = True,
    **hyper: Any,
) -> PrimitiveModule:
    """Wrap a rollkit primitive as a :class:`~tensordict.nn.TensorDictModule`.

    Args:
        fn_or_name: a registered name (``"grpo"``) or a function (registered or not).
        registry: where to look the name up: a key of :data:`rollkit.registry.REGISTRIES`
            (``"advantage"``, ``"policy_loss"``, ...), a :class:`Registry`, or ``None`` (all).
        in_keys: ``{argument name: batch key}``, merged over the entry's defaults.
        out_keys: keys to write, one per output (default: the entry's ``out_keys``).
        metrics_key: where a :class:`LossOutput`'s metrics dict goes (see the module docstring);
            ``None`` drops the metrics.
        broadcast: spread ``[B]`` float outputs over the tokens of ``batch[mask_key]``.
        mask_key: the ``[B, T]`` bool mask used by ``broadcast``.
        inplace: ``True`` writes into the given TensorDict; ``False``/``"empty"`` return a new one
            with only the outputs (see :class:`tensordict.nn.TensorDictModule`).
        **hyper: keyword-only hyper-parameters of the primitive (``eps=1e-6``).

    Returns:
        A :class:`PrimitiveModule` (a ``TensorDictModule``) with ``in_keys`` in the order of
        the primitive's tensor arguments.

    >>> import torch
    >>> from tensordict import TensorDict
    >>> def scale(rewards, *, c=1.0):  # [B] -> [B]
    ...     return c * rewards
    >>> m = td_module(scale, in_keys={"rewards": "rewards"}, out_keys=["scaled"], c=2.0)
    >>> m(TensorDict(rewards=torch.tensor([1.0, -1.0]), batch_size=[2]))["scaled"]
    tensor([ 2., -2.])
    """
    entry = resolve(fn_or_name, registry)
    fn = entry.fn
    what = f"{entry.name!r}"
    arg_keys, optional = _resolve_arg_keys(entry, fn, in_keys, what=what)
    _check_hyper(fn, hyper, arg_keys, what)
    keys = list(out_keys) if out_keys is not None else list(entry.out_keys)
    if not keys:
        raise ValueError(f"out_keys: {what} declares no out_keys; pass out_keys=[...]")
    loss_output = _returns_loss_output(fn)
    keep_metrics = False
    if loss_output or metrics_key not in (_AUTO, None):
        if metrics_key == _AUTO:
            metrics_key = keys[1] if len(keys) > 1 else _suffixed(keys[0], "_metrics")
        keys = keys[:1]
        if metrics_key is not None:
            keys.append(metrics_key)
            keep_metrics = True
    if inplace not in (True, False, "empty"):
        raise ValueError(f"inplace: must be True, False or 'empty', got {inplace!r}")
    call = _Call(
        fn,
        entry.name,
        list(arg_keys),
        optional & set(arg_keys),
        hyper,
        loss_output=loss_output or metrics_key is None,
        keep_metrics=keep_metrics,
        n_out=len(keys),
        broadcast=broadcast,
    )
    return PrimitiveModule(call, arg_keys, keys, mask_key=mask_key if broadcast else None, inplace=inplace)


# --------------------------------------------------------------------------------------------
# Filters
# --------------------------------------------------------------------------------------------


def apply_keep(td: TensorDictBase, keep: Tensor | Any = KEEP) -> TensorDictBase:
    """The rows of ``td`` that a filter kept: ``td[keep]``.

    Args:
        td: a batch with ``batch_size=[B]``.
        keep: a ``[B]`` bool tensor, or the key of one in ``td`` (default ``"keep"``).

    Returns:
        A new TensorDict with ``batch_size=[n_kept]`` (``[0]`` when nothing is kept); ``td`` is
        not modified. The keep-mask column, when read from ``td``, comes along (all ``True``).

    >>> import torch
    >>> from tensordict import TensorDict
    >>> td = TensorDict(rewards=torch.tensor([1.0, 2.0, 3.0]), keep=torch.tensor([True, False, True]),
    ...                 batch_size=[3])
    >>> apply_keep(td)["rewards"]
    tensor([1., 3.])
    """
    if not isinstance(td, TensorDictBase):
        raise ValueError(f"td: expected a TensorDict, got {type(td).__name__}")
    if td.batch_dims < 1:
        raise ValueError(f"td: expected a batch with batch_size [B], got {list(td.batch_size)}")
    if not isinstance(keep, Tensor):
        if keep not in td.keys(include_nested=True):
            raise ValueError(f"keep: the batch has no key {keep!r}")
        name, keep = str(keep), td.get(keep)
    else:
        name = "keep"
    check_mask(name, keep)
    check_shape(name, keep, [td.batch_size[0]])
    return td[keep]


# --------------------------------------------------------------------------------------------
# Scalar losses, torchrl-style
# --------------------------------------------------------------------------------------------


class TDLoss(TensorDictModuleBase):
    """A policy loss plus its aggregation, returning a scalar TensorDict; build it with
    :func:`td_loss`.

    ``forward(td)`` returns a new ``TensorDict`` with ``batch_size=[]`` holding the aggregated
    loss under ``loss_key`` and every metric of the :class:`LossOutput` under its own name
    (torchrl's ``LossModule`` convention). ``td`` itself is not modified.
    """

    def __init__(self, loss: PrimitiveModule, aggregation: PrimitiveModule, *, loss_key: str) -> None:
        super().__init__()
        self.loss = loss
        self.aggregation = aggregation
        self.loss_key = loss_key
        inner = set(loss.out_keys)
        self.in_keys = list(
            dict.fromkeys([*loss.in_keys, *(k for k in aggregation.in_keys if k not in inner)])
        )
        self.out_keys = [loss_key]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        tmp = tensordict.copy()
        tmp = self.loss(tmp)
        tmp = self.aggregation(tmp)
        out = TensorDict({self.loss_key: tmp[self.aggregation.out_keys[0]]}, batch_size=[])
        if len(self.loss.out_keys) > 1:
            metrics = tmp[self.loss.out_keys[1]]
            for k, v in metrics.items():
                out.set(k, v if isinstance(v, Tensor) else torch.as_tensor(v))
        return out


def td_loss(
    policy_loss: str | Callable[..., Any],
    *,
    aggregation: str | Callable[..., Any] = "token-mean",
    registry: str | Registry | None = "policy_loss",
    aggregation_registry: str | Registry | None = "aggregation",
    in_keys: Mapping[str, Any] | None = None,
    aggregation_in_keys: Mapping[str, Any] | None = None,
    aggregation_kwargs: Mapping[str, Any] | None = None,
    loss_key: str = "loss_objective",
    **hyper: Any,
) -> TDLoss:
    """A policy loss followed by an aggregation, as one module returning a scalar TensorDict.

    The per-token loss (written to the temporary key ``"loss"``) is fed to the aggregation's
    first tensor argument; the aggregation's other tensor arguments (the mask) are read from
    the batch. ``hyper`` goes to the policy loss, ``aggregation_kwargs`` to the aggregation
    (e.g. global token counts for gradient accumulation).

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from rollkit.types import LossOutput
    >>> def pg(logprobs, advantages, mask) -> LossOutput:
    ...     loss = torch.where(mask, -advantages * logprobs, 0.0)
    ...     return LossOutput(loss, {"n_tokens": mask.sum().float()})
    >>> def token_sum(loss, mask):
    ...     return loss[mask].sum()
    >>> m = td_loss(pg, aggregation=token_sum, registry=None, aggregation_registry=None,
    ...             in_keys={"logprobs": "logprobs", "advantages": "advantages", "mask": "response_mask"},
    ...             aggregation_in_keys={"mask": "response_mask"})
    >>> td = TensorDict(logprobs=-torch.ones(2, 2), advantages=torch.ones(2, 2),
    ...                 response_mask=torch.tensor([[True, False], [True, True]]), batch_size=[2])
    >>> out = m(td)
    >>> out["loss_objective"], out["n_tokens"]
    (tensor(3.), tensor(3.))
    """
    out_keys = None if resolve(policy_loss, registry).out_keys else ["loss"]
    loss_mod = td_module(policy_loss, registry=registry, in_keys=in_keys, out_keys=out_keys, **hyper)
    if len(loss_mod.out_keys) < 2:
        raise ValueError(f"policy_loss: {loss_mod.primitive!r} does not return a LossOutput")
    tmp_key = loss_mod.out_keys[0]
    agg_entry = resolve(aggregation, aggregation_registry)
    agg_args = tensor_args(agg_entry.fn, keyed=list(agg_entry.in_keys))
    if not agg_args:
        raise ValueError(f"aggregation: {agg_entry.name!r} takes no tensor argument")
    first = next(iter(agg_args))
    agg_keys = {**agg_entry.in_keys, **(aggregation_in_keys or {}), first: tmp_key}
    agg_mod = td_module(
        aggregation,
        registry=aggregation_registry,
        in_keys={a: k for a, k in agg_keys.items() if a in agg_args},
        out_keys=["_rollkit_loss_scalar"],
        metrics_key=None,
        **dict(aggregation_kwargs or {}),
    )
    return TDLoss(loss_mod, agg_mod, loss_key=loss_key)

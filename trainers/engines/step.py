"""The step batch: one object that carries a step's samples from the collector to the learner.

A :class:`StepBatch` holds ``B`` samples as tensors keyed by :mod:`rollkit.keys` names (and the
few trainer keys below), each with a leading ``[B]`` dimension, plus the prompt width ``P`` and
the rows' image inputs. The collector builds it from the packed generations; each stage of
the update adds its keys instead of changing a packed batch or passing tensors by position::

    collector        input_ids, attention_mask, response_mask, old_logprobs, prompt_index,
                     [rewards, group_ids, step_ids]
    recompute        old_logprobs <- the trainer's (proximal), behavior_logprobs <- the rollout's
    correction       is_weights, token_keep
    reference / KL   ref_logprobs, kl
    advantages       advantages (and values, returns, entropy_keep with a critic)
    max-length mask  token_keep

The learner (:func:`trainers.learner.ppo_update`, in process or on every Ray train rank: the
same object is the Ray payload) reads its inputs by key; a registry call (policy loss,
estimator) gets the batch as its ``available`` mapping, so a loss that reads a new key needs
only the stage that writes it. :meth:`StepBatch.view` is the :class:`~trainers.engines.base.PackedBatch`
that the train engines see (their ``logprobs`` take ``input_ids`` / ``attention_mask`` /
``response_mask`` and the image inputs).

>>> import torch
>>> from trainers.engines.base import pack
>>> b = StepBatch.from_packed(pack([[5, 6], [7]], [[8], [9, 10]], pad_token_id=0))
>>> b.batch_size, b.response_len, b.prompt_len
(2, 2, 2)
>>> b["advantages"] = torch.ones(2, 2)
>>> b[torch.tensor([1])]["advantages"].shape
torch.Size([1, 2])
>>> b["advantages"] = torch.ones(2, 3)
Traceback (most recent call last):
...
ValueError: StepBatch['advantages']: shape (2, 3), expected [B=2, T=2, ...]
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor

from rollkit import keys as K
from trainers.engines.base import PackedBatch, _select

__all__ = ["ENTROPY_KEEP", "INPUT_IDS", "ATTENTION_MASK", "PROMPT_INDEX", "StepBatch", "TOKEN_KEEP"]

# trainer keys (not in rollkit.keys): the engines' token layout and the update's masks
INPUT_IDS = "input_ids"  # [B, P + T] long
ATTENTION_MASK = "attention_mask"  # [B, P + T] long (1 = real token)
PROMPT_INDEX = "prompt_index"  # [B] long: the prompt of each sample in the step
TOKEN_KEEP = "token_keep"  # [B, T] bool: tokens the loss keeps (correction rejects, max-length mask)
ENTROPY_KEEP = K.ENTROPY_KEEP  # [B, T] bool: tokens that get the entropy bonus (AsyPPO's filter)

_SEQ_KEYS = (INPUT_IDS, ATTENTION_MASK)  # [B, P + T]
_TOKEN_KEYS = (TOKEN_KEEP,)  # [B, T] besides rollkit.keys' ("B", "T") ones

# the PackedBatch field of each key its view carries
_VIEW_FIELDS = {
    K.OLD_LOGPROBS: "old_logprobs",
    PROMPT_INDEX: "prompt_index",
    K.BEHAVIOR_LOGPROBS: "behavior_logprobs",
    K.IS_WEIGHTS: "is_weights",
    TOKEN_KEEP: "keep",
    ENTROPY_KEEP: "entropy_keep",
    K.STEP_IDS: "step_ids",
}


def _is_token_key(key: str) -> bool:
    spec = K.SPECS.get(key)
    return key in _TOKEN_KEYS or (spec is not None and spec.shape[:2] == ("B", "T"))


class StepBatch(Mapping[str, Tensor]):
    """A step's samples: key -> ``[B, ...]`` tensor, the prompt width ``prompt_len`` and the
    rows' image inputs (module docstring).

    Setting a key checks its shape: ``[B]`` leading for every key, ``[B, T]`` for token keys
    (rollkit's ``("B", "T")`` keys, ``token_keep``, ``entropy_keep``), ``[B, P + T]`` for
    ``input_ids`` / ``attention_mask``; a wrong one is a one-line ``ValueError`` naming the key.
    Setting ``None`` removes the key. Indexing by a string gives the tensor; by rows (a slice,
    an index tensor or a boolean mask) the same batch restricted to those rows.

    Args:
        tensors: at least ``input_ids``, ``attention_mask`` and ``response_mask``.
        prompt_len: ``P``, the width of the left-padded prompts.
        images: per row the prompt's image inputs (``None``: no image); ``None``: a text batch.
    """

    def __init__(
        self, tensors: Mapping[str, Tensor | None], *, prompt_len: int, images: list[Any] | None = None
    ) -> None:
        missing = [k for k in (INPUT_IDS, ATTENTION_MASK, K.RESPONSE_MASK) if tensors.get(k) is None]
        if missing:
            raise ValueError(f"StepBatch: no tensor for {missing} (the engines' token layout)")
        self._t: dict[str, Tensor] = {}
        self.prompt_len = int(prompt_len)
        ids, mask = tensors[INPUT_IDS], tensors[K.RESPONSE_MASK]
        if ids.dim() != 2 or mask.dim() != 2 or ids.shape[0] != mask.shape[0]:
            raise ValueError(
                f"StepBatch: input_ids {tuple(ids.shape)} and response_mask {tuple(mask.shape)} are not [B, P + T] "
                "and [B, T] of one B"
            )
        if ids.shape[1] != self.prompt_len + mask.shape[1]:
            raise ValueError(
                f"StepBatch: input_ids has {ids.shape[1]} columns, not prompt_len {self.prompt_len} + "
                f"T {mask.shape[1]}"
            )
        self._t[K.RESPONSE_MASK] = mask
        for k, v in tensors.items():
            self[k] = v
        if images is not None and len(images) != self.batch_size:
            raise ValueError(f"StepBatch: {len(images)} image entries for {self.batch_size} rows")
        self.images = images

    @classmethod
    def from_packed(cls, batch: PackedBatch, **tensors: Tensor | None) -> StepBatch:
        """The step batch of a packed batch (its tensors under their keys) plus ``tensors``."""
        t: dict[str, Tensor | None] = {
            INPUT_IDS: batch.input_ids,
            ATTENTION_MASK: batch.attention_mask,
            K.RESPONSE_MASK: batch.response_mask,
        }
        t.update({k: getattr(batch, f) for k, f in _VIEW_FIELDS.items()})
        t.update(tensors)
        return cls(t, prompt_len=batch.prompt_len, images=batch.images)

    # ------------------------------------------------------------------ mapping

    @property
    def batch_size(self) -> int:
        """``B``."""
        return int(self._t[K.RESPONSE_MASK].shape[0])

    @property
    def response_len(self) -> int:
        """``T``."""
        return int(self._t[K.RESPONSE_MASK].shape[1])

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return self._t[key]
        return self.rows(key)

    def __setitem__(self, key: str, value: Tensor | None) -> None:
        if value is None:
            self._t.pop(key, None)
            return
        if not isinstance(value, Tensor):
            raise ValueError(f"StepBatch[{key!r}]: a {type(value).__name__}, not a tensor")
        B, T = self.batch_size, self.response_len
        if key in _SEQ_KEYS:
            want, ok = f"[B={B}, P + T={self.prompt_len + T}]", tuple(value.shape) == (B, self.prompt_len + T)
        elif _is_token_key(key):
            want, ok = f"[B={B}, T={T}, ...]", value.dim() >= 2 and tuple(value.shape[:2]) == (B, T)
        else:
            want, ok = f"[B={B}, ...]", value.dim() >= 1 and value.shape[0] == B
        if not ok:
            raise ValueError(f"StepBatch[{key!r}]: shape {tuple(value.shape)}, expected {want}")
        self._t[key] = value

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self._t.items())
        return f"StepBatch(B={self.batch_size}, P={self.prompt_len}, T={self.response_len}; {fields})"

    # ------------------------------------------------------------------ rows and views

    def rows(self, rows: slice | Tensor) -> StepBatch:
        """The same keys restricted to ``rows`` (a slice, an index tensor or a boolean mask)."""
        images = None if self.images is None else _select(self.images, rows)
        return StepBatch({k: v[rows] for k, v in self._t.items()}, prompt_len=self.prompt_len, images=images)

    def replace(self, **tensors: Tensor | None) -> StepBatch:
        """A shallow copy with ``tensors`` set (``None`` removes a key); this batch is unchanged."""
        return StepBatch({**self._t, **tensors}, prompt_len=self.prompt_len, images=self.images)

    def view(self) -> PackedBatch:
        """The :class:`~trainers.engines.base.PackedBatch` the train engines see (shares tensors)."""
        return PackedBatch(
            input_ids=self._t[INPUT_IDS],
            attention_mask=self._t[ATTENTION_MASK],
            response_mask=self._t[K.RESPONSE_MASK],
            prompt_len=self.prompt_len,
            images=self.images,
            **{f: self._t.get(k) for k, f in _VIEW_FIELDS.items()},
        )

    @property
    def loss_mask(self) -> Tensor:
        """``[B, T]`` the tokens the loss trains on: the response minus ``token_keep``'s rejects."""
        keep = self._t.get(TOKEN_KEEP)
        mask = self._t[K.RESPONSE_MASK]
        return mask if keep is None else mask & keep

    def keep_tokens(self, keep: Tensor) -> None:
        """AND ``keep`` ``[B, T]`` into ``token_keep`` (the tokens the loss trains on)."""
        old = self._t.get(TOKEN_KEEP)
        self[TOKEN_KEEP] = keep if old is None else old & keep

    def to_tensordict(self) -> Any:
        """The tensors as a :class:`tensordict.TensorDict` with ``batch_size=[B]`` (for
        :mod:`rollkit.td`'s adapters); ``prompt_len`` and the images are not in it."""
        from tensordict import TensorDict

        return TensorDict(dict(self._t), batch_size=[self.batch_size])

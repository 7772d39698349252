"""Small result types shared by the primitives."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["LossOutput"]


class LossOutput(NamedTuple):
    """What every policy / value / KL loss returns.

    Attributes:
        loss: ``[B, T]`` per-token loss, exactly zero where the mask is False. Turn it into a
            scalar with :func:`rollkit.losses.aggregate`.
        metrics: ``dict[str, Tensor]`` of detached 0-dim tensors (clip fractions, ratio
            statistics, approx-KL, ...), computed over the masked tokens. They are tensors,
            not floats, so that logging does not force a device synchronisation.
    """

    loss: Tensor
    metrics: dict[str, Tensor]

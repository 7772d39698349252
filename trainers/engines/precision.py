"""Low-precision parameters with float32 master weights (``train.master_weights``).

Under ``torch.autocast`` the parameters stay float32 and every matmul casts its weight to
bf16 on the fly, in every micro-batch's forward and again in the backward. With master weights
the model's parameters *are* bf16 (or fp16): the forward and backward run on them with no
casts, while the optimizer steps float32 copies ("master weights", Micikevicius et al. 2018,
"Mixed precision training", ICLR, arXiv:1710.03740), as DeepSpeed's bf16 mode and FSDP2's
``MixedPrecisionPolicy`` keep them:

* each parameter's gradient is added into its master's float32 gradient the moment autograd
  finishes it (``register_post_accumulate_grad_hook``), and the bf16 gradient is dropped, so
  micro-batches accumulate in float32;
* the optimizer (and gradient clipping) sees only the masters;
* after the step each parameter is set to its master rounded to the parameter's dtype.

Updates smaller than half a bf16 ulp of a weight, which pure bf16 training loses, accumulate
in the master until they show (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["MasterWeights"]


class MasterWeights:
    """Float32 masters of ``params`` (low-precision ``nn.Parameter`` s that require grad).

    >>> lin = torch.nn.Linear(2, 2).to(torch.bfloat16)
    >>> mw = MasterWeights(lin.parameters())
    >>> [m.dtype for m in mw.params]
    [torch.float32, torch.float32]
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        for p in params:
            if not p.requires_grad:
                continue
            if p.dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(
                    f"train.master_weights: a parameter is {p.dtype}; master weights need bf16 or fp16 ones"
                )
            m = torch.nn.Parameter(p.detach().float().clone())
            p.register_post_accumulate_grad_hook(self._accumulate(m))
            self.pairs.append((p, m))

    @staticmethod
    def _accumulate(master: torch.nn.Parameter) -> Callable[[torch.nn.Parameter], None]:
        def hook(p: torch.nn.Parameter) -> None:
            g = p.grad.float()
            master.grad = g if master.grad is None else master.grad.add_(g)
            p.grad = None

        return hook

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The float32 masters, what the optimizer steps."""
        return [m for _, m in self.pairs]

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Each parameter := its master, rounded to the parameter's dtype."""
        for p, m in self.pairs:
            p.copy_(m)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Each master := its parameter (after loading model weights)."""
        for p, m in self.pairs:
            m.copy_(p)

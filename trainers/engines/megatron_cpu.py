"""The CPU shims Megatron-Core needs, in one place, and only where there is no CUDA.

Megatron-Core 0.16 trains on a CPU over gloo (its local, TransformerEngine-free layer spec)
except for three CUDA-only calls, which :func:`install` redirects when
``torch.cuda.is_available()`` is False (on a machine with CUDA it does nothing):

1. ``torch.cuda.current_device()``, which its layers use as the ``device=`` of new tensors
   (the rotary frequencies, attention's softmax offsets, gradient buffers), returns
   ``"cpu"`` (without CUDA it raises, so nothing that worked before changes).
2. Its RNG tracker (``tensor_parallel.random``: the model-parallel RNG state that dropout and
   activation recomputation fork) keeps CPU generator states: ``_get_cuda_rng_state`` /
   ``_set_cuda_rng_state`` read and set the CPU generator, and the tracker's ``add`` seeds a CPU
   state (:class:`CpuRNGStatesTracker`).
3. Gradient clipping is not shimmed: :class:`trainers.engines.megatron_train.MegatronTrainEngine`
   computes the global norm itself over the tensor-, pipeline- and data-parallel groups.

Megatron's ``DistributedDataParallel`` (CUDA gradient buffers) is not used: the engine
all-reduces gradients over the data-parallel group itself, as :class:`TorchTrainEngine` does.
"""

from __future__ import annotations

from typing import Any

import torch

from trainers.deps import require

__all__ = ["CpuRNGStatesTracker", "install", "seed_model_parallel_rng"]

_installed = False


def _cpu_get_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _tracker_class() -> type:
    random = require("megatron.core.tensor_parallel.random")

    class _Tracker(random.CudaRNGStatesTracker):
        """Megatron's RNG tracker over the CPU generator (``add`` seeds a CPU state)."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_ or name in self.states_:
                raise ValueError(f"RNG tracker: seed {seed} or state {name!r} already added")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    return _Tracker


def CpuRNGStatesTracker() -> Any:
    """A Megatron RNG tracker whose states are CPU generator states."""
    return _tracker_class()()


def install() -> bool:
    """Redirect Megatron-Core's CUDA-only calls to the CPU when there is no CUDA (idempotent).
    Returns whether the shims are active."""
    global _installed
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    random = require("megatron.core.tensor_parallel.random")
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    random._get_cuda_rng_state = _cpu_get_state
    random._set_cuda_rng_state = _cpu_set_state
    random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _installed = True
    return True


def seed_model_parallel_rng(seed: int, tp_rank: int) -> None:
    """Megatron's ``model_parallel_cuda_manual_seed`` for the model-parallel RNG state alone
    (seed ``seed + 2718 + tp_rank``, as Megatron does), on the CPU or CUDA tracker alike."""
    random = require("megatron.core.tensor_parallel.random")
    if not torch.cuda.is_available():
        tracker = random.get_cuda_rng_tracker()
        tracker.reset()
        tracker.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    else:
        random.model_parallel_cuda_manual_seed(seed)

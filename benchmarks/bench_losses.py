"""Forward + backward time of each policy loss, relative to a minimal hand-written PPO loss.

Every case computes the loss matrix, reduces it with the same token-mean
(``(loss * mask).sum() / mask.sum()``) and back-propagates to ``logprobs``; the baseline is the
same thing written in five lines with no validation, no sanitising and no metrics. A ratio
close to 1 means the primitive does no wasted passes. Wall-clock times on a busy machine are
noisy (best of N is reported), so the table also counts the ATen kernels of forward + backward
that touch a full ``[B, T]`` tensor, a deterministic proxy for memory traffic.

    python benchmarks/bench_losses.py                       # [256, 8192] float32, table
    python benchmarks/bench_losses.py --shape 64 1024 --repeats 5
    python benchmarks/bench_losses.py --batch 8 --length 64 --repeats 1   # smoke run (seconds)
    pytest benchmarks/bench_losses.py --benchmark-enable    # under pytest-benchmark

Results are printed, not asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from rollkit.losses.policy import (
    cispo,
    decoupled_ppo,
    gmpo,
    gpg,
    gspo,
    gspo_token,
    ppo_clip,
    raft_pp,
    sapo,
    tis,
    topr,
    vanilla_pg,
)

SHAPE = (256, 8192)


def make_inputs(shape: tuple[int, int] = SHAPE, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, T = shape
    lp = -torch.rand(B, T, generator=g) * 5
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    return {
        "logprobs": lp,
        "old_logprobs": lp + 0.1 * torch.randn(B, T, generator=g),
        "behavior_logprobs": lp + 0.1 * torch.randn(B, T, generator=g),
        "advantages": torch.randn(B, generator=g),
        "mask": torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1),
    }


def minimal_ppo(lp, old, adv, mask, eps: float = 0.2) -> torch.Tensor:
    """The baseline: PPO clip in as few operations as a hand-written trainer would use."""
    ratio = torch.exp(lp - old)
    a = adv.unsqueeze(-1)
    loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps, 1 + eps))
    return (loss * mask).sum() / mask.sum()


def _rk(fn: Callable, behavior: bool = False, **kw) -> Callable:
    def run(x: dict[str, torch.Tensor], lp: torch.Tensor) -> torch.Tensor:
        args = [lp, x["old_logprobs"], x["advantages"], x["mask"]]
        if behavior:
            args.append(x["behavior_logprobs"])
        out = fn(*args, **kw)
        return (out.loss * x["mask"]).sum() / x["mask"].sum()

    return run


CASES: dict[str, Callable] = {
    "minimal-ppo": lambda x, lp: minimal_ppo(lp, x["old_logprobs"], x["advantages"], x["mask"]),
    "ppo": _rk(ppo_clip),
    "ppo+dual": _rk(ppo_clip, dual_clip=3.0),
    "gspo": _rk(gspo),
    "gspo-token": _rk(gspo_token),
    "gmpo": _rk(gmpo),
    "cispo": _rk(cispo),
    "topr": _rk(topr),
    "tis": _rk(tis, behavior=True),
    "decoupled-ppo": _rk(decoupled_ppo, behavior=True),
    "raft++": _rk(raft_pp),
    "vanilla-pg": _rk(vanilla_pg),
    "gpg": _rk(gpg),
    "sapo": _rk(sapo),
}


def step(case: Callable, x: dict[str, torch.Tensor], lp: torch.Tensor) -> None:
    lp.grad = None
    case(x, lp).backward()


def time_cases(cases: dict[str, Callable], x: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` seconds per case, timed round-robin so that load drift on a shared
    machine hits every case alike."""
    lp = x["logprobs"].clone().requires_grad_(True)
    best = dict.fromkeys(cases, float("inf"))
    for case in cases.values():
        step(case, x, lp)  # warm-up
    for _ in range(repeats):
        for name, case in cases.items():
            t0 = time.perf_counter()
            step(case, x, lp)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


_NOT_A_PASS = ("view", "expand", "detach", "alias", "squeeze", "as_strided", "empty", "lift_fresh")


def count_passes(case: Callable, shape: tuple[int, int] = (16, 64)) -> int:
    """Number of ATen kernels in forward + backward that read or write a full ``[B, T]`` tensor.

    Deterministic, unlike wall-clock time on a shared machine: a proxy for memory traffic.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    numel = shape[0] * shape[1]

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func)
            tensors = [a for a in tree_leaves((args, kwargs, out)) if isinstance(a, torch.Tensor)]
            if any(t.numel() == numel for t in tensors) and not any(k in name for k in _NOT_A_PASS):
                _Count.n += 1
            return out

    x = make_inputs(shape)
    lp = x["logprobs"].clone().requires_grad_(True)
    with _Count():
        case(x, lp).backward()
    return _Count.n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=list(SHAPE), metavar=("B", "T"))
    p.add_argument("--batch", type=int, default=None, help="B (overrides --shape)")
    p.add_argument("--length", type=int, default=None, help="T (overrides --shape)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    args.shape = [args.batch or args.shape[0], args.length or args.shape[1]]
    if args.threads:
        torch.set_num_threads(args.threads)
    x = make_inputs(tuple(args.shape))
    times = time_cases(CASES, x, args.repeats)
    base = times["minimal-ppo"]
    print(f"shape {args.shape} float32, {torch.get_num_threads()} threads, best of {args.repeats}")
    base_passes = count_passes(CASES["minimal-ppo"])
    print(f"{'loss':<16}{'fwd+bwd ms':>12}{'vs minimal':>12}{'[B,T] ops':>11}{'vs minimal':>12}")
    for name, case in CASES.items():
        t = times[name]
        k = count_passes(case)
        print(f"{name:<16}{t * 1e3:>12.2f}{t / base:>12.2f}{k:>11d}{k / base_passes:>12.2f}")


# ---------------------------------------------------------------- pytest-benchmark entry point

try:
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="module")
    def bench_inputs():
        return make_inputs()

    @pytest.mark.parametrize("name", list(CASES))
    def test_policy_loss_forward_backward(benchmark, bench_inputs, name):
        lp = bench_inputs["logprobs"].clone().requires_grad_(True)
        benchmark(step, CASES[name], bench_inputs, lp)


if __name__ == "__main__":
    main()

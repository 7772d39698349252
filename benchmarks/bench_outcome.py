"""Benchmark: vectorised GRPO advantages vs the per-group Python loop of a typical trainer.

8192 samples in groups of 8 (group order shuffled), 4096 response tokens. Times the ``[B]``
advantage and the ``[B, T]`` broadcast over tokens, rollkit and baseline interleaved in one
run (median of the repeats), and prints time per call, GB/s and the speedup.

    python benchmarks/bench_outcome.py [--batch 8192] [--group 8] [--length 4096] [--repeats 20]
    python benchmarks/bench_outcome.py --batch 8 --length 64 --repeats 1   # smoke run (seconds)
    pytest benchmarks/bench_outcome.py --benchmark-enable

Results are printed, not asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import rollkit  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollkit.advantages.outcome import grpo_advantages
from rollkit.ops import broadcast_to_tokens


def make_batch(batch: int = 8192, group: int = 8, tokens: int = 4096, seed: int = 0, device: str = "cpu"):
    """Random rewards, shuffled group ids (``batch // group`` groups of ``group``) and a ragged mask."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, generator=gen)
    ids = torch.arange(batch // group).repeat_interleave(group) * 7 + 11  # arbitrary id values
    ids = ids[torch.randperm(batch, generator=gen)]
    lengths = torch.randint(1, tokens + 1, (batch,), generator=gen)
    mask = torch.arange(tokens)[None, :] < lengths[:, None]
    return rewards.to(device), ids.to(device), mask.to(device)


def loop_grpo(rewards, group_ids, eps: float = 1e-6):
    """The typical trainer code: loop over unique groups with boolean indexing."""
    adv = torch.empty_like(rewards)
    for gid in torch.unique(group_ids):
        sel = group_ids == gid
        r = rewards[sel]
        if r.numel() > 1:
            adv[sel] = (r - r.mean()) / (r.std() + eps)
        else:
            adv[sel] = 0.0
    return adv


def rollkit_grpo(rewards, group_ids):
    return grpo_advantages(rewards, group_ids, eps=1e-6)


def loop_grpo_tokens(rewards, group_ids, mask):
    return loop_grpo(rewards, group_ids).unsqueeze(-1) * mask


def rollkit_grpo_tokens(rewards, group_ids, mask):
    return broadcast_to_tokens(rollkit_grpo(rewards, group_ids), mask)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, args, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn(*args)
    _sync(device)
    return time.perf_counter() - t0


def run(batch: int, group: int, tokens: int, repeats: int, device: str) -> dict[str, float]:
    rewards, ids, mask = make_batch(batch, group, tokens, device=device)
    # correctness first
    ref = loop_grpo(rewards, ids)
    got = rollkit_grpo(rewards, ids)
    assert torch.allclose(ref, got, atol=1e-5), float((ref - got).abs().max())
    pairs = {
        "advantages [B]": (rollkit_grpo, loop_grpo, (rewards, ids), batch * (4 + 8 + 4)),
        "advantages + tokens [B,T]": (
            rollkit_grpo_tokens,
            loop_grpo_tokens,
            (rewards, ids, mask),
            batch * (4 + 8 + 4) + batch * tokens * (1 + 4),
        ),
    }
    results = {}
    print(
        f"B={batch} groups of {group} (shuffled), T={tokens}, device={device}, "
        f"threads={torch.get_num_threads()}, repeats={repeats} (median, interleaved)"
    )
    print(f"{'case':28s} {'rollkit ms':>11s} {'loop ms':>10s} {'rollkit GB/s':>13s} {'speedup':>8s}")
    for name, (fast, slow, args, nbytes) in pairs.items():
        fast(*args), slow(*args)  # warm-up
        tf, ts = [], []
        for _ in range(repeats):  # interleaved so that machine noise hits both alike
            tf.append(_time(fast, args, device))
            ts.append(_time(slow, args, device))
        f, s = statistics.median(tf), statistics.median(ts)
        print(f"{name:28s} {f * 1e3:11.3f} {s * 1e3:10.3f} {nbytes / f / 1e9:13.2f} {s / f:7.1f}x")
        results[name] = s / f
    return results


# --------------------------------------------------------------------------- pytest-benchmark

try:
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="module")
    def data():
        return make_batch()

    def test_rollkit_grpo(benchmark, data):
        r, g, _ = data
        benchmark(rollkit_grpo, r, g)

    def test_loop_grpo(benchmark, data):
        r, g, _ = data
        benchmark.pedantic(loop_grpo, args=(r, g), rounds=3, iterations=1)

    def test_rollkit_grpo_tokens(benchmark, data):
        benchmark(rollkit_grpo_tokens, *data)

    def test_loop_grpo_tokens(benchmark, data):
        benchmark.pedantic(loop_grpo_tokens, args=data, rounds=3, iterations=1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--length", "--tokens", dest="tokens", type=int, default=4096, help="response tokens T")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    if a.group < 1 or a.batch % a.group:
        p.error(f"--batch ({a.batch}) must be a multiple of --group ({a.group})")
    if a.threads:
        torch.set_num_threads(a.threads)
    run(a.batch, a.group, a.tokens, a.repeats, a.device)


if __name__ == "__main__":
    main()

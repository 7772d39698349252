"""GAE throughput: rollkit's chunked masked scan vs per-token loop baselines.

    python benchmarks/bench_gae.py                      # [256, 8192] float32, prints a table
    python benchmarks/bench_gae.py --batch 64 --length 2048 --repeats 5 --device cuda
    python benchmarks/bench_gae.py --batch 8 --length 64 --repeats 1  # smoke run (seconds)
    pytest benchmarks/bench_gae.py --benchmark-enable   # pytest-benchmark fixtures
    ROLLKIT_BENCH_THREADS=0 pytest benchmarks/bench_gae.py --benchmark-enable  # torch's default threads

The CLI runs with ``--threads 1`` by default (``--threads 0``: torch's default), because the
machine it was developed on is shared; on a dedicated machine use all threads.

Baselines (written here, for timing only):

* ``column loop``: the usual verl / OpenRLHF-style loop over ``t`` that updates whole
  ``[B]`` columns (with verl's skip-the-masked-token update), ``T`` Python iterations.
* ``per-sample loop``: a plain Python loop over the tokens of each sample, timed on a few
  rows and extrapolated linearly to the full batch (labelled as such).

Baseline and rollkit are timed interleaved in the same run (the machine may be shared), and
the median is reported. GB/s counts the bytes of the inputs read (rewards, values: 4 B each,
mask: 1 B) and outputs written (advantages, returns: 4 B each) once: 17 B per token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

try:
    import rollkit  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollkit.advantages.gae import gae_advantages
from rollkit.validation import value_checks

GAMMA, LAM = 1.0, 0.95


def make_batch(batch: int, length: int, *, device: str = "cpu", seed: int = 0, holes: bool = True):
    """Ragged right-padded masks (lengths uniform in [length/8, length]); ``holes`` also masks
    ~5% of the tokens inside the responses (multi-turn env/tool tokens)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(length // 8, length + 1, (batch,), generator=g)
    mask = torch.arange(length)[None, :] < lens[:, None]
    if holes:
        mask &= torch.rand(batch, length, generator=g) > 0.05
    rewards = torch.randn(batch, length, generator=g) * 0.01
    values = torch.randn(batch, length, generator=g)
    return rewards.to(device), values.to(device), mask.to(device)


@torch.no_grad()
def column_loop_gae(rewards, values, mask, gamma=GAMMA, lam=LAM):
    """Reference baseline: reverse loop over time steps, one [B] column per iteration."""
    B, T = rewards.shape
    m = mask.to(rewards.dtype)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    running = torch.zeros_like(next_value)
    adv = torch.zeros_like(rewards)
    for t in range(T - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        cand = delta + gamma * lam * running
        running = m[:, t] * cand + (1 - m[:, t]) * running
        next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value
        adv[:, t] = running * m[:, t]
    return adv, (adv + values) * m


def per_sample_loop_gae(rewards, values, mask, gamma=GAMMA, lam=LAM):
    """Plain Python over each sample's tokens (lists of floats)."""
    out = []
    for r, v, m in zip(rewards.tolist(), values.tolist(), mask.tolist()):
        adv = [0.0] * len(r)
        nv = last = 0.0
        for t in range(len(r) - 1, -1, -1):
            if m[t]:
                last = r[t] + gamma * nv - v[t] + gamma * lam * last
                adv[t] = last
                nv = v[t]
        out.append(adv)
    return out


def rollkit_gae(rewards, values, mask):
    return gae_advantages(rewards, values, mask, gamma=GAMMA, lam=LAM)


def rollkit_gae_unchecked(rewards, values, mask):
    with value_checks(False):
        return gae_advantages(rewards, values, mask, gamma=GAMMA, lam=LAM)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, *args, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn(*args)
    _sync(device)
    return time.perf_counter() - t0


def run(batch: int, length: int, repeats: int, device: str, sample_rows: int) -> list[tuple[str, float]]:
    r, v, m = make_batch(batch, length, device=device)
    m_prefix = make_batch(batch, length, device=device, holes=False)[2]
    # correctness first: rollkit agrees with the column loop
    for mm in (m, m_prefix):
        adv_ref, _ = column_loop_gae(r.double(), v.double(), mm)
        err = (rollkit_gae(r, v, mm)[0].double() - adv_ref).abs().max().item()
        print(f"max |rollkit float32 - column loop float64| = {err:.2e}")
    cases = {
        "rollkit, multi-turn masks (5% holes)": (rollkit_gae, m),
        "rollkit, holes, value checks off": (rollkit_gae_unchecked, m),
        "rollkit, right-padded masks (no holes)": (rollkit_gae, m_prefix),
        "column loop (verl-style), holes": (column_loop_gae, m),
    }
    for fn, mm in cases.values():  # warm-up
        fn(r, v, mm)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):  # interleaved
        for name, (fn, mm) in cases.items():
            times[name].append(_time(fn, r, v, mm, device=device))
    rows = [(k, statistics.median(ts)) for k, ts in times.items()]
    if sample_rows > 0:
        sub = (r[:sample_rows].cpu(), v[:sample_rows].cpu(), m[:sample_rows].cpu())
        t = statistics.median(_time(per_sample_loop_gae, *sub, device="cpu") for _ in range(3))
        rows.append((f"per-sample loop (extrapolated from {sample_rows} rows)", t * batch / sample_rows))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sample-rows", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave torch's default)")
    a = p.parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    print(
        f"GAE on [{a.batch}, {a.length}] float32, device={a.device}, torch {torch.__version__}, "
        f"threads={torch.get_num_threads()}, median of {a.repeats} interleaved runs"
    )
    rows = run(a.batch, a.length, a.repeats, a.device, a.sample_rows)
    nbytes = a.batch * a.length * 17
    base = dict(rows)["rollkit, multi-turn masks (5% holes)"]
    print(f"{'method':<54} {'time/call':>12} {'GB/s':>8} {'time / rollkit':>15}")
    for name, t in rows:
        print(f"{name:<54} {t * 1e3:>9.2f} ms {nbytes / t / 1e9:>8.3f} {t / base:>14.1f}x")
    col = dict(rows)["column loop (verl-style), holes"]
    pre = dict(rows)["rollkit, right-padded masks (no holes)"]
    print(f"speedup over the column loop: {col / base:.1f}x (holes), {col / pre:.1f}x (no holes)")


# ----------------------------------------------------------------------------- pytest-benchmark

_B, _T = 256, 8192


@pytest.fixture(autouse=True)
def _torch_threads():
    """Torch CPU threads for the benchmarks: ``ROLLKIT_BENCH_THREADS`` (default 1, since the
    development machine is shared; 0 keeps torch's default). Restored afterwards."""
    before = torch.get_num_threads()
    n = int(os.environ.get("ROLLKIT_BENCH_THREADS", "1"))
    if n > 0:
        torch.set_num_threads(n)
    yield
    torch.set_num_threads(before)


def _batch():
    return make_batch(_B, _T)


def test_gae_rollkit(benchmark):
    r, v, m = _batch()
    benchmark.pedantic(rollkit_gae, args=(r, v, m), rounds=5, warmup_rounds=1)


def test_gae_rollkit_no_holes(benchmark):
    r, v, _ = _batch()
    m = make_batch(_B, _T, holes=False)[2]
    benchmark.pedantic(rollkit_gae, args=(r, v, m), rounds=5, warmup_rounds=1)


def test_gae_rollkit_value_checks_off(benchmark):
    r, v, m = _batch()
    benchmark.pedantic(rollkit_gae_unchecked, args=(r, v, m), rounds=5, warmup_rounds=1)


def test_gae_column_loop(benchmark):
    r, v, m = _batch()
    benchmark.pedantic(column_loop_gae, args=(r, v, m), rounds=3, warmup_rounds=0)


if __name__ == "__main__":
    main()

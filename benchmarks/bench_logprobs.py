"""Peak memory and time of token log-probs + entropy, forward + backward: plain vs lean.

``plain``: the LM head's ``[N, V]`` logits (``hidden @ weight.T``), then
:func:`rollkit.logprobs.token_logprobs` with autograd. ``lean``:
:func:`rollkit.logprobs.lean_token_logprobs` (chunked, the backward recomputes each chunk's
logits). Both back-propagate ``sum(logprobs) + sum(entropy)`` to the hidden states and the LM
head weight. Each case runs in a fresh subprocess: its peak memory is ``ru_maxrss`` at the end
minus ``ru_maxrss`` after the inputs are allocated (and one small warm-up call), i.e. the
extra resident memory of the forward + backward, gradients included; its time is the median
of ``--repeats`` runs.

    python benchmarks/bench_logprobs.py                              # V=49152, H=576, T in 512 2048 8192
    python benchmarks/bench_logprobs.py --lengths 2048 --chunks 128 256 512 1024 --top-k 50 --top-p 0.95
    python benchmarks/bench_logprobs.py --batch 1 --length 64 --vocab 512 --hidden 32 --repeats 1  # smoke

Results are printed, not asserted.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, "") and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout

from rollkit.logprobs import lean_token_logprobs, token_logprobs  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def step(case: dict, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor) -> None:
    """One forward + backward of ``sum(logprobs) + sum(entropy)``; gradients dropped after."""
    kw = dict(temperature=case["temperature"], top_k=case["top_k"], top_p=case["top_p"], with_entropy=True)
    if case["chunk"]:
        lp, ent = lean_token_logprobs(hidden, weight, tokens, chunk_tokens=case["chunk"], **kw)
    else:
        lp, ent = token_logprobs(hidden @ weight.T, tokens, **kw)
    (lp.sum() + ent.sum()).backward()
    hidden.grad = weight.grad = None


def run_case(case: dict) -> dict:
    """Runs in the subprocess: the case's peak extra memory (MB) and its times (s)."""
    torch.set_num_threads(case["threads"] or torch.get_num_threads())
    g = torch.Generator().manual_seed(0)
    dtype = DTYPES[case["dtype"]]
    B, T, H, V = case["batch"], case["length"], case["hidden"], case["vocab"]
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    step(case, hidden[:, :2].detach().requires_grad_(True), weight, tokens[:, :2])  # warm-up, tiny
    base = _maxrss_mb()
    times = []
    for _ in range(case["repeats"]):
        t0 = time.perf_counter()
        step(case, hidden, weight, tokens)
        times.append(time.perf_counter() - t0)
    return {"peak_mb": _maxrss_mb() - base, "times": times}


def measure(case: dict, timeout_s: float) -> dict:
    code = f"import runpy, json, sys; m = runpy.run_path({str(Path(__file__).resolve())!r}); "
    code += f"print(json.dumps(m['run_case'](json.loads({json.dumps(json.dumps(case))}))))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--lengths", type=int, nargs="+", default=[512, 2048, 8192], help="T values (B * T tokens)"
    )
    p.add_argument("--length", type=int, default=None, help="one T (overrides --lengths)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--chunks", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case (subprocess deadline)")
    args = p.parse_args(argv)
    lengths = [args.length] if args.length else args.lengths
    common = dict(batch=args.batch, vocab=args.vocab, hidden=args.hidden, dtype=args.dtype,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  repeats=args.repeats, threads=args.threads)  # fmt: skip
    print(
        f"V={args.vocab} H={args.hidden} B={args.batch} {args.dtype}, temperature={args.temperature} "
        f"top_k={args.top_k} top_p={args.top_p}, forward+backward with entropy, "
        f"median of {args.repeats}, threads={args.threads or torch.get_num_threads()}"
    )
    print(
        f"{'case':<24}{'tokens':>8}{'peak MB':>10}{'mem / plain':>13}{'time s':>9}{'time / plain':>14}{'min-max s':>16}"
    )
    results: dict = {}
    for T in lengths:
        base = None
        for chunk in [0, *args.chunks]:
            r = measure({**common, "length": T, "chunk": chunk}, args.timeout)
            med = statistics.median(r["times"])
            base = base or (r["peak_mb"], med)
            name = "plain" if chunk == 0 else f"lean chunk={chunk}"
            results[(T, name)] = {"peak_mb": r["peak_mb"], "time_s": med, "times": r["times"]}
            spread = f"{min(r['times']):.2f}-{max(r['times']):.2f}"
            print(
                f"{name:<24}{args.batch * T:>8}{r['peak_mb']:>10.0f}{r['peak_mb'] / max(base[0], 1e-9):>13.3f}"
                f"{med:>9.3f}{med / base[1]:>14.2f}{spread:>16}"
            )
    return results


if __name__ == "__main__":
    main()

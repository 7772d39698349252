"""Measure this machine's cost constants for SmolLM2-135M (the ``_CPU`` table of costs.py).

    python -m benchmarks.sim.calibrate                  # vLLM CPU build, transformers engine, training
    python -m benchmarks.sim.calibrate --skip vllm      # without vLLM (about a minute)

Decode: batches of ``B`` distinct random prompts of ``P`` tokens generate ``L`` tokens with
``ignore_eos`` after a warm-up run (vLLM: through the request-level view the trainers use, add
then ``step()`` until done; transformers: one batch ``generate``, the recipe's path); with :math:`L = 1` the call is
a prefill, fitted as :math:`p_0 + p_1 BP`; the others fit :math:`a, b, c` of
:math:`t - \\text{prefill} = La + bBL + c(BPL + BL(L-1)/2)` by least squares (the closed form of
costs.DecodeCost). Train: forward + backward of a token-mean log-prob loss and an AdamW step over
micro-batches of 8 sequences of ``T`` tokens, fitted as :math:`t_0 + k\\,\\text{tokens}`; weight
sync: one ``update_weights`` of the rollout engine. Prints the constants and the fit's largest
relative error; nothing is written.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import copy

import numpy as np
import torch

from trainers.config import load_config
from trainers.engines.base import SamplingParams
from trainers.engines.build import build_model, make_rollout_engine
from trainers.engines.requests import Request, as_request_engine

#: (batch, new tokens) per engine; L = 1 is a prefill
DECODE_GRID = {
    "hf": [(1, 1), (32, 1), (1, 12), (8, 12), (32, 12)],
    "vllm": [(1, 1), (16, 1), (1, 64), (4, 64), (16, 64), (16, 16), (4, 256)],
}
PROMPT = 48


def _time(fn, repeats: int = 1) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _drive(view, prompts, p: SamplingParams) -> None:
    """The trainers' request-level path: add every request, step until all finished."""
    _drive.calls = getattr(_drive, "calls", 0) + 1
    view.add([Request(f"c{_drive.calls}-{i}", ids, p) for i, ids in enumerate(prompts)])
    while view.num_running:
        view.step()


def decode(engine_name: str, model, tok) -> dict[str, float]:
    cfg = load_config([f"--rollout={engine_name}", "rollout.dtype=float32", "rollout.max_model_len=640"])
    eng = make_rollout_engine(cfg, copy.deepcopy(model), tok, device="cpu")
    view = as_request_engine(eng)
    g = torch.Generator().manual_seed(0)
    rows = []
    try:
        for B, L in DECODE_GRID[engine_name]:
            prompts = [torch.randint(100, 20000, (PROMPT,), generator=g).tolist() for _ in range(B)]
            p = SamplingParams(n=1, max_tokens=L, temperature=1.0, ignore_eos=True, seed=0)
            run = (
                (lambda prompts=prompts, p=p: eng.generate(prompts, p))
                if engine_name == "hf"
                else (lambda prompts=prompts, p=p: _drive(view, prompts, p))
            )
            rows.append((B, L, _time(run)))
            print(f"  {engine_name}: B={B:<3} L={L:<4} {rows[-1][2]:.3f} s", flush=True)
        weights = list(model.named_parameters())
        sync = _time(lambda: eng.update_weights(((k, v.detach()) for k, v in weights), version=1), 1)
    finally:
        if hasattr(eng, "shutdown"):
            eng.shutdown()
    pre = [(B * PROMPT, t) for B, L, t in rows if L == 1]
    (p1, p0), *_ = np.linalg.lstsq(
        np.array([[x, 1.0] for x, _ in pre]), np.array([t for _, t in pre]), rcond=None
    )
    A, y = [], []
    for B, L, t in rows:
        if L > 1:
            A.append([L, B * L, B * PROMPT * L + B * L * (L - 1) / 2])
            y.append(t - (p0 + p1 * B * PROMPT))
    (a, b, c), *_ = np.linalg.lstsq(np.array(A), np.array(y), rcond=None)
    err = max(abs(np.dot(r, (a, b, c)) - v) / (v + p0 + p1 * B * PROMPT) for r, v, (B, *_) in zip(A, y, rows))
    return {"a": a, "b": b, "c": c, "p0": p0, "p1": p1, "sync_s": sync, "max_rel_err": err}


def train(model) -> dict[str, float]:
    m = copy.deepcopy(model).float().train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    rows = []
    for samples, T in [(8, 48), (16, 48), (8, 160)]:
        ids = torch.randint(100, 20000, (samples, T), generator=g)

        def step(ids: torch.Tensor = ids) -> None:
            opt.zero_grad()
            for mb in ids.split(8):
                logits = m(mb).logits[:, :-1].float()
                lp = logits.log_softmax(-1).gather(-1, mb[:, 1:, None]).mean()
                (-lp).backward()
            opt.step()

        rows.append((samples * T, _time(step)))
        print(f"  train: {samples} x {T} tokens {rows[-1][1]:.3f} s", flush=True)
    (k, t0), *_ = np.linalg.lstsq(
        np.array([[x, 1.0] for x, _ in rows]), np.array([t for _, t in rows]), rcond=None
    )
    err = max(abs(t0 + k * x - t) / t for x, t in rows)
    return {"t0": t0, "per_token": k, "max_rel_err": err}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", default="", help="comma-separated: vllm, hf, train")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    bad = skip - {"vllm", "hf", "train"}
    if bad:
        raise SystemExit(f"error: --skip: unknown part(s) {sorted(bad)} (vllm, hf, train)")
    torch.set_num_threads(args.threads)
    model, tok = build_model(load_config(["model.dtype=float32"]))
    out: dict[str, dict[str, float]] = {}
    for name in ("vllm", "hf"):
        if name not in skip:
            out[name] = decode(name, model, tok)
    if "train" not in skip:
        out["train"] = train(model)
    print(f"machine: {os.cpu_count()} cores, torch threads {args.threads}, float32")
    for k, v in out.items():
        print(f"{k}: " + ", ".join(f"{n}={x:.3g}" for n, x in v.items()))
    return out


if __name__ == "__main__":
    main()

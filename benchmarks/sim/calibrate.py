"""Measure this machine's cost constants for SmolLM2-135M (``_CPU`` and ``_TRAIN_1_THREAD`` of costs.py).

    python -m benchmarks.sim.calibrate                  # vLLM CPU build, transformers engine, sync, training
    python -m benchmarks.sim.calibrate --skip vllm      # without vLLM
    nice -n 5 python -m benchmarks.sim.calibrate --skip vllm,hf,sync --threads 1   # training only (~12 min loaded)

Decode: batches of ``B`` distinct random prompts of ``P`` tokens generate ``L`` tokens with
``ignore_eos`` after a warm-up run (vLLM: through the request-level view the trainers use, add
then ``step()`` until done; transformers: one batch ``generate``, the recipe's path); with
:math:`L = 1` the call is a prefill, fitted as :math:`p_0 + p_1 BP`; the others fit
:math:`a, b, c` of :math:`t - \text{prefill} = La + bBL + c(BPL + BL(L-1)/2)` by least squares
(the closed form of costs.DecodeCost); the vLLM engine's ``update_weights`` is timed after.
Sync: the transformers engine's ``update_weights``. Train: one ``ppo_update`` of the real torch
train engine over the shapes of :data:`TRAIN_GRID`, fitted as the micro-batched form of
costs.TrainCost (:func:`train`). Prints the constants and the fit's largest relative error;
nothing is written.
"""

from __future__ import annotations

import argparse
import math
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
from trainers.engines.base import Generation, SamplingParams, pack_generations
from trainers.engines.build import build_model, make_rollout_engine, make_train_engine
from trainers.engines.requests import Request, as_request_engine
from trainers.engines.step import StepBatch
from trainers.learner import LocalLearner, UpdateSpec

#: (batch, new tokens) per engine; L = 1 is a prefill
DECODE_GRID = {
    "hf": [(1, 1), (32, 1), (1, 12), (8, 12), (32, 12)],
    "vllm": [(1, 1), (16, 1), (1, 64), (4, 64), (16, 64), (16, 16), (4, 256)],
}
PROMPT = 48
#: the chat-formatted 2-digit addition prompt of the recipes, in SmolLM2 tokens
PROMPT_TRAIN = 37


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


#: (prompts, samples per prompt, response tokens, micro-batch rows, sort by length) of one
#: update: the recipe's job (4 x 8, 12 tokens, micro-batch 16), then W1-like micro-batches of
#: two prompts x 4 samples with longer responses
TRAIN_GRID = [
    (4, 8, 12, 16, False),
    (2, 4, 12, 8, True),
    (2, 4, 48, 8, True),
    (2, 4, 128, 8, True),
    (2, 4, 256, 8, True),
    (2, 4, 512, 8, True),
]


def _update_fn(cfg, model, prompts: int, n: int, resp: int, mb: int, sort: bool, g: torch.Generator):
    """One ``ppo_update`` of the torch train engine on a synthetic batch of this shape."""
    cfg = copy.deepcopy(cfg)
    cfg.train.micro_batch_size, cfg.train.sort_by_length = mb, sort
    engine = make_train_engine(cfg, model, device="cpu")
    learner = LocalLearner(engine, UpdateSpec.from_config(cfg))
    gens = []
    for i in range(prompts):
        p = torch.randint(100, 20000, (PROMPT_TRAIN,), generator=g).tolist()
        for _ in range(n):
            ids = torch.randint(100, 20000, (resp,), generator=g).tolist()
            gens.append(Generation(i, p, ids, [-1.0] * resp, "length"))
    batch = pack_generations(gens, 0)
    adv = torch.where(torch.rand(len(gens), generator=g) < 0.5, -1.0, 1.0)[:, None] * batch.response_mask
    return lambda: learner.update(StepBatch.from_packed(batch, advantages=adv), seed=0)


def _min_time(fn, calls: int) -> tuple[float, float]:
    """The least wall and the least process CPU seconds over ``calls`` calls: other jobs on the
    machine only ever add time, so the minimum is the least disturbed."""
    walls, cpus = [], []
    for _ in range(calls):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus)


def train(model, threads: int) -> dict[str, float]:
    """Seconds of one update of each :data:`TRAIN_GRID` shape through the real torch train engine
    and ``ppo_update`` (the recipe's loss settings: ``ppo``, token-mean, temperature 0.7, prompt
    sharing; random tokens), fitted as the shaped form of costs.TrainCost:
    ``t0 + sum over micro-batches of k_p U P + k_r B R + k_a B R (P + R)``.

    Each shape runs twice and the faster call counts (the first call of a shape allocates its
    activations). With one thread the fit is on the process CPU time, which other jobs on the
    machine do not inflate (they only delay it); with more, on the wall time."""
    cfg = load_config(["model.dtype=float32", "rollout.temperature=0.7", "train.lr=1e-6"])
    m = copy.deepcopy(model).float().train()
    g = torch.Generator().manual_seed(0)
    rows = []
    for shape in TRAIN_GRID:
        prompts, n, resp, mb, _ = shape
        fn = _update_fn(cfg, m, *shape, g)
        load = os.getloadavg()[0]
        wall, cpu = _min_time(fn, 2)
        feats = [1.0, 0.0, 0.0, 0.0]  # t0, micro-batches, U P + B R tokens, B R (P + R)
        for b in [min(mb, prompts * n - i) for i in range(0, prompts * n, mb)]:
            # contiguous groups, equal lengths: a micro-batch of b rows holds ceil(b / n) prompts
            feats[1] += 1
            feats[2] += math.ceil(b / n) * PROMPT_TRAIN + b * resp
            feats[3] += b * resp * (PROMPT_TRAIN + resp)
        rows.append((feats, cpu if threads == 1 else wall))
        print(
            f"  train: {prompts} x {n} x {resp} tokens, micro-batch {mb}: {wall:.3f} s wall, "
            f"{cpu:.3f} s CPU (load average {load:.2f} -> {os.getloadavg()[0]:.2f})",
            flush=True,
        )
    A, y = np.array([f for f, _ in rows]), np.array([t for _, t in rows])
    coef = _nnls(A, y)
    err = max(abs(float(np.dot(f, coef)) - t) / t for f, t in rows)
    on = "CPU time, 1 thread" if threads == 1 else f"wall time, {threads} threads"
    names = ("t0", "per_micro_batch", "per_token", "k_attn")
    print(f"  train fit on {on}: " + ", ".join(f"{k}={v:.4g}" for k, v in zip(names, coef)))
    return {**dict(zip(names, (float(x) for x in coef))), "max_rel_err": err}


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: refit without the most negative one until
    none is (enough for four columns)."""
    active = list(range(A.shape[1]))
    while True:
        c, *_ = np.linalg.lstsq(A[:, active], y, rcond=None)
        if (c >= 0).all():
            out = np.zeros(A.shape[1])
            out[active] = c
            return out
        del active[int(np.argmin(c))]


def weight_sync(model, tok) -> dict[str, float]:
    """One ``update_weights`` of the transformers rollout engine (the recipe's), the fastest of
    three (wall and process CPU seconds)."""
    cfg = load_config(["--rollout=hf", "rollout.dtype=float32"])
    eng = make_rollout_engine(cfg, copy.deepcopy(model), tok, device="cpu")
    weights = [(k, v.detach()) for k, v in model.named_parameters()]
    wall, cpu = _min_time(lambda: eng.update_weights(iter(weights), version=1), 3)
    print(f"  hf update_weights: {wall:.3f} s wall, {cpu:.3f} s CPU", flush=True)
    return {"sync_s": wall, "sync_cpu_s": cpu}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", default="", help="comma-separated: vllm, hf, train, sync")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    bad = skip - {"vllm", "hf", "train", "sync"}
    if bad:
        raise SystemExit(f"error: --skip: unknown part(s) {sorted(bad)} (vllm, hf, train, sync)")
    torch.set_num_threads(args.threads)
    model, tok = build_model(load_config(["model.dtype=float32"]))
    out: dict[str, dict[str, float]] = {}
    for name in ("vllm", "hf"):
        if name not in skip:
            out[name] = decode(name, model, tok)
    if "sync" not in skip:
        out["hf_sync"] = weight_sync(model, tok)
    if "train" not in skip:
        out["train"] = train(model, args.threads)
    print(f"machine: {os.cpu_count()} cores, torch threads {args.threads}, float32")
    for k, v in out.items():
        print(f"{k}: " + ", ".join(f"{n}={x:.3g}" for n, x in v.items()))
    return out


if __name__ == "__main__":
    main()

"""Benchmark W1 (long-tail RLVR rollout): synchronous vs queue scheduling vs extra prompts vs async.

The workload W1 (docs/benchmarks.md): a real model generates through a real engine with
``ignore_eos`` and a per-request ``max_tokens`` drawn from a log-normal distribution clipped
to a cap (``rollout.length_dist``, :mod:`trainers.loops.lengths`); rewards are the cheap
exact-match check; the training step is the real loss and backward. Every mode trains the same
samples per step (``--prompts`` x ``--n``) with the same engines in this process: ``sync``
(:class:`~trainers.loops.SyncTrainer`), ``queue`` (:class:`~trainers.loops.AsyncTrainer` with
``ratio=0``: ROLL Flash's queue scheduling alone), ``queue+extra`` (``ratio=0`` with
``--extra`` more prompts running) and ``async a=K`` (``ratio=K``). The table has the median
seconds per step, the generating (sync) or waiting (async) share of the step, the mean
staleness and the speed-up against ``sync``; results are printed, not asserted.

    python benchmarks/bench_async.py                         # SmolLM2-135M on vLLM (the reported run)
    python benchmarks/bench_async.py --model tiny --engine hf --cap 48 --steps 2   # smoke run
    python benchmarks/bench_async.py --learning              # learning preserved: sync vs a=2, 3 seeds
    python benchmarks/bench_async.py --recipe                # the default recipe's own job, 5 set-ups

``--epoch K`` times one epoch of a fixed set of ``K`` prompts per mode (:func:`run_epoch`): every
sample of every prompt is trained, or dropped by a stated rule and counted, and the headline is
trained tokens per second, so that no mode wins by training shorter responses:

    python benchmarks/bench_async.py --epoch 32 --prompts 4 --n 4          # W1, sync / async on Ray, tail batching
    python benchmarks/bench_async.py --epoch 4 --prompts 2 --n 2 --model tiny --engine hf --cap 16 --layout process

``--recipe`` runs the whole job of ``recipes/rlvr_qwen.py`` once per set-up (``--recipe-modes``:
in process and on a local Ray with ``placement.mode=disaggregated``, sync and async);
``--learning`` the tiny-model task of the tests, sync vs ``ratio=2`` (``--async-config``) over
``--seeds`` seeds. The modes, the set-ups and the measured tables: docs/async.md.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

MODES = ("sync", "queue", "queue+extra", "async a=1", "async a=2", "async a=4")
_OFF_POLICY = ["algorithm.policy_loss=decoupled-ppo"]
_RAY = ["--ray", "placement.mode=disaggregated", "ray.object_store_mb=512"]
#: the set-ups of ``--recipe``: config overrides of recipes/rlvr_qwen.py
RECIPE_MODES: dict[str, list[str]] = {
    "sync": [],
    "async a=1": ["asynchronous.enabled=true", "asynchronous.ratio=1", *_OFF_POLICY],
    "async a=2": ["asynchronous.enabled=true", "asynchronous.ratio=2", *_OFF_POLICY],
    "ray sync": _RAY,
    "ray async a=1": [*_RAY, "asynchronous.enabled=true", "asynchronous.ratio=1", *_OFF_POLICY],
}


def mode_overrides(mode: str, extra: int) -> list[str]:
    if mode == "sync":
        return []
    if mode == "queue":
        return ["asynchronous.ratio=0"]
    if mode == "queue+extra":
        return ["asynchronous.ratio=0", f"asynchronous.extra_prompts={extra}"]
    if mode.startswith("async a="):
        return [f"asynchronous.ratio={mode.split('=')[1]}"]
    raise ValueError(f"--modes: unknown mode {mode!r}; known: {', '.join(MODES)}")


# --------------------------------------------------------------------------- one epoch

#: the modes of ``--epoch``; sync, async and "tail batching (ray)" run on ``--layout`` (the
#: last needs ``ray``), "tail batching" always in this process with "sync (in process)" as its
#: baseline
EPOCH_MODES = ("sync", "async a=1", "async a=2", "tail batching", "sync (in process)", "tail batching (ray)")
_ON_LAYOUT = ("sync", "async a=1", "async a=2", "tail batching (ray)")


def _queue_driven(spec: EpochSpec, mode: str) -> bool:
    """Whether ``mode`` runs on the queue scheduler and its buffer: async, and sync on Ray (the
    queue scheduler at ``asynchronous.ratio=0``, which trains the synchronous samples: the
    synchronous collector had no request-level view of a Ray rollout group when the docs'
    figures were measured, and the mode stays so to compare with them)."""
    return mode.startswith("async") or (mode == "sync" and spec.layout == "ray")


class EpochSpec:
    """One epoch of ``epoch_prompts`` fixed prompts per mode (:func:`run_epoch`). ``layout``:
    ``"ray"`` (sync and async disaggregated, half the cores each) or ``"process"``; ``model``:
    ``""`` (SmolLM2-135M-Instruct), ``"tiny"`` or a checkpoint dir; ``threads``: torch threads in
    this process (0: every core). A plain class: the benchmarks are loaded from their paths."""

    def __init__(
        self,
        epoch_prompts: int,
        modes: list[str] | None = None,
        layout: str = "ray",
        model: str = "",
        engine: str = "vllm",
        prompts: int = 4,
        n: int = 4,
        length_dist: str = "lognormal:16.0:1.5",
        cap: int = 512,
        micro_batch: int = 8,
        eta_prompts: float = 1.25,
        eta_responses: float = 1.25,
        seed: int = 0,
        threads: int = 0,
    ) -> None:
        self.epoch_prompts, self.modes = epoch_prompts, list(EPOCH_MODES if modes is None else modes)
        self.layout, self.model, self.engine = layout, model, engine
        self.prompts, self.n, self.length_dist, self.cap = prompts, n, length_dist, cap
        self.micro_batch, self.eta_prompts, self.eta_responses = micro_batch, eta_prompts, eta_responses
        self.seed, self.threads = seed, threads
        self._check()

    def _check(self) -> None:
        for name in ("epoch_prompts", "prompts", "n", "cap", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.epoch_prompts % self.prompts:
            raise ValueError(
                f"--epoch: {self.epoch_prompts} prompts is not a whole number of steps of "
                f"--prompts {self.prompts} (the synchronous modes train exactly {self.prompts} per step)"
            )
        if self.layout not in ("ray", "process"):
            raise ValueError(f"--layout: expected 'ray' or 'process', got {self.layout!r}")
        for m in self.modes:
            if m not in EPOCH_MODES:
                raise ValueError(f"--modes: unknown epoch mode {m!r}; known: {', '.join(EPOCH_MODES)}")
            if m == "tail batching (ray)" and self.layout != "ray":
                raise ValueError(f"--modes: {m!r} runs on Ray; it needs --layout ray")


def epoch_overrides(spec: EpochSpec, mode: str) -> list[str]:
    """The trainer config of ``mode`` in an epoch run (everything else is shared)."""
    tiny = spec.model == "tiny"
    over = [
        "--model",
        spec.model,
        f"rollout.engine={spec.engine}",
        f"rollout.prompts_per_step={spec.prompts}",
        f"rollout.n={spec.n}",
        f"rollout.max_tokens={spec.cap}",
        f"rollout.length_dist={spec.length_dist}",
        "rollout.temperature=1.0",
        "rollout.dtype=auto",
        "train.autocast=auto",
        "train.sort_by_length=true",
        f"train.micro_batch_size={spec.micro_batch}",
        "train.lr=1e-6",
        "data.digits=1" if tiny else "data.digits=2",
        "data.eval_size=10",
        "eval.before=false",
        "eval.every=0",
        f"seed={spec.seed}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        f"logging.dir={tempfile.mkdtemp(prefix='rollkit-bench-epoch-')}",
    ]
    if spec.engine == "vllm":
        over += [f"rollout.max_model_len={spec.cap + 128}"]
        if tiny:  # vLLM's CPU attention needs a head size of 32
            over += ["model.tiny_heads=2", "model.tiny_kv_heads=1"]
    if mode.startswith("async"):
        over += [f"asynchronous.ratio={mode.split('=')[1]}", *_OFF_POLICY]
    elif _queue_driven(spec, mode):
        over += ["asynchronous.ratio=0"]
    if mode.startswith("tail batching"):
        over += [
            "tail_batching.enabled=true",
            f"tail_batching.eta_prompts={spec.eta_prompts}",
            f"tail_batching.eta_responses={spec.eta_responses}",
        ]
    if spec.layout == "ray" and mode in _ON_LAYOUT:
        cores = os.cpu_count() or 1
        over += [*_RAY, f"ray.num_cpus={cores}", f"placement.cpus_per_worker={max(1, cores // 2)}"]
    return over


class _EpochLedger:
    """Which of the epoch's prompts are trained, dropped or still open, per mode.

    * sync in this process: the collector draws ``prompts`` prompts a step from the epoch's shuffled order, and
      trains all of them: the epoch is ``K / prompts`` steps (checked on the prompt iterator).
    * tail batching: the prompt ids of :class:`rollkit.scheduling.EpochSampler` are
      ``epoch * K + index``, so ids ``< K`` are this epoch's; each step's batch names the prompts
      it trains (and, with dynamic sampling, drops). A deferred prompt waits for a long round,
      so prompts of the next epoch may be trained before the epoch closes (counted).
    * async, and sync on Ray (the queue scheduler at ratio 0): the buffer's request ids ``0 .. K-1`` are the first ``K`` prompts drawn, i.e. this
      epoch; every batch's ids are recorded as the trainer draws it (the buffer's own
      ``get_batch``, wrapped to read its return value). An epoch request that leaves the buffer
      untrained was dropped by the freshness rule: aborted while running (too old to finish in
      time) or expired after finishing. The epoch closes when none of its requests is running
      or held.
    """

    def __init__(self, tr: object, mode: str, K: int, P: int, queue: bool) -> None:
        self.tr, self.mode, self.K, self.P, self.queue = tr, mode, K, P, queue
        self.trained: set[int] = set()  # epoch ids trained
        self.dropped: set[int] = set()
        self.next_epoch = 0  # prompts of later epochs trained before this one closed
        self.steps = 0
        if queue:
            buf, get = tr.buffer, tr.buffer.get_batch

            def get_batch():  # the buffer's own batch, recorded
                batch = get()
                if batch is not None:
                    self._record(batch.request_ids)
                return batch

            buf.get_batch = get_batch

    def _record(self, ids) -> None:
        for i in ids:
            if i < self.K:
                self.trained.add(i)
            else:
                self.next_epoch += 1

    def after_step(self) -> bool:
        """Account the step just taken; whether the epoch is closed."""
        self.steps += 1
        if self.mode.startswith("sync") and not self.queue:
            self.trained.update(range((self.steps - 1) * self.P, self.steps * self.P))
            return self.steps * self.P >= self.K
        if self.mode.startswith("tail batching"):
            b = self.tr.last_tail_batch
            self._record(b.prompt_ids)
            self.dropped.update(i for i in b.dropped if i < self.K)
            return len(self.trained | self.dropped) >= self.K
        buf = self.tr.buffer
        with self.tr.scheduler.cond:  # the producer thread changes the buffer under this lock
            st = buf.state_dict()
        reserved = st["next_id"]
        open_ = {r for r, _ in st["running"]} | {r for r, *_ in st["held"]}
        gone = set(range(min(reserved, self.K))) - open_ - self.trained
        self.dropped |= gone
        return reserved >= self.K and not any(r < self.K for r in open_)

    def check(self) -> None:
        """The epoch's conservation law: every prompt trained once or dropped by the rule."""
        assert not (self.trained & self.dropped), "a prompt was both trained and dropped"
        assert len(self.trained) + len(self.dropped) == self.K, (len(self.trained), len(self.dropped), self.K)
        if self.mode.startswith("sync") and not self.queue:
            it = self.tr.iterator.state_dict()
            assert (it["epoch"], it["position"]) in ((0, self.K), (1, 0)), it


def _epoch_trainer(spec: EpochSpec, mode: str, prompts: list) -> object:
    from trainers.config import load_config
    from trainers.loops import AsyncTrainer, SyncTrainer

    cfg = load_config(epoch_overrides(spec, mode))
    cls = AsyncTrainer if _queue_driven(spec, mode) else SyncTrainer
    return cls(cfg, train_prompts=prompts)


def epoch_one(spec: EpochSpec, mode: str) -> dict[str, float]:
    """One epoch of ``mode`` from a cold start (fresh engines and trainer; building them is
    not timed; the first step's first-call costs are)."""
    from trainers.config import load_config
    from trainers.data import build_prompts

    prompts = build_prompts(load_config(epoch_overrides(spec, "sync")))[0][: spec.epoch_prompts]
    if len(prompts) < spec.epoch_prompts:
        raise SystemExit(f"--epoch: the task has only {len(prompts)} train prompts")
    K, P, n = spec.epoch_prompts, spec.prompts, spec.n
    tr = _epoch_trainer(spec, mode, prompts)
    queue = _queue_driven(spec, mode)
    ledger = _EpochLedger(tr, mode, K, P, queue)
    tokens = samples = wait = gen = 0.0
    tokens0 = tr.scheduler.counts["generated_tokens"] if queue else 0
    try:
        t0 = time.perf_counter()
        limit = 4 * K // P + 8
        while True:
            m = tr.step()
            k = m.get("rollout/kept_groups", P) * n
            samples += k
            tokens += m["response/length_mean"] * k
            wait += m.get("time/rollout", 0.0) + m.get("time/wait", 0.0)
            gen += m.get("throughput/rollout_tokens_per_s", 0.0) * m.get("time/rollout", 0.0)
            if ledger.after_step():
                break
            if ledger.steps >= limit:
                raise RuntimeError(f"{mode}: the epoch did not close in {limit} steps ({ledger.__dict__})")
        wall = time.perf_counter() - t0
        generated = tr.scheduler.counts["generated_tokens"] - tokens0 if queue else gen
        aborted = m.get("buffer/aborted", 0.0) + m.get("buffer/dropped_stale", 0.0)
    finally:
        tr.close()
        gc.collect()
    ledger.check()
    return {
        "wall_s": wall,
        "steps": ledger.steps,
        "trained": len(ledger.trained),
        "dropped": len(ledger.dropped),
        "next_epoch": ledger.next_epoch,
        "samples": samples,
        "tokens": tokens,
        "generated": generated,
        "dropped_requests": aborted,
        "mean_length": tokens / max(samples, 1),
        "tokens_per_s": tokens / max(wall, 1e-9),
        "wait_share": wait / max(wall, 1e-9),
    }


def run_epoch(spec: EpochSpec) -> dict[str, dict[str, float]]:
    """``--epoch``: each mode of ``spec.modes`` trains one epoch of the same ``K`` prompts; the
    table gives the epoch's wall time, the prompts trained / dropped (and trained from the next
    epoch before it closed), the mean trained length and the trained tokens per second, with the
    speed-up in trained tokens/s over the sync run of the same layout."""
    torch.set_num_threads(spec.threads or max(1, os.cpu_count() or 1))
    where = {m: "ray 1+1" if spec.layout == "ray" and m in _ON_LAYOUT else "process" for m in spec.modes}
    if where.get("sync") == "ray 1+1":
        where["sync"] = "ray 1+1 (queue, ratio 0)"
    print(
        f"One epoch: {spec.epoch_prompts} prompts x {spec.n} samples, {spec.prompts} prompts per step; "
        f"model {spec.model or 'SmolLM2-135M-Instruct'}, engine {spec.engine}, lengths {spec.length_dist} "
        f"capped at {spec.cap}, ignore_eos; {os.cpu_count()} cores",
        flush=True,
    )
    rows: dict[str, dict[str, float]] = {}
    for mode in spec.modes:
        rows[mode] = epoch_one(spec, mode)
        r = rows[mode]
        print(  # the whole row at once: a run stopped later keeps it
            f"  {mode:<18} {r['wall_s']:.1f} s, {r['steps']} steps, {r['tokens_per_s']:.2f} trained tok/s, "
            f"prompts trained / dropped {r['trained']} / {r['dropped']}, next epoch {r['next_epoch']}, "
            f"mean trained length {r['mean_length']:.1f}, generated {r['generated']:.0f}",
            flush=True,
        )
    print()
    print(
        "| mode | layout | epoch s | steps | epoch prompts trained / dropped | next-epoch prompts trained | "
        "mean trained length | trained tokens/s | speed-up (trained tokens/s) | generated tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        base = (
            "sync" if where[mode] != "process" else ("sync (in process)" if spec.layout == "ray" else "sync")
        )
        ref = rows.get(base, {}).get("tokens_per_s", math.nan)
        speedup = f"{r['tokens_per_s'] / ref:.2f}x" if math.isfinite(ref) else f"- (no {base} row)"
        print(
            f"| {mode} | {where[mode]} | {r['wall_s']:.1f} | {r['steps']} | {r['trained']} / {r['dropped']} | "
            f"{r['next_epoch']} | {r['mean_length']:.1f} | {r['tokens_per_s']:.2f} | "
            f"{speedup} | {r['generated']:.0f} |"
        )
    print(
        "dropped: async requests aborted by the freshness bound or expired after finishing; tail "
        "batching trains the first R0 of ceil(eta_R R0) responses of each prompt"
    )
    return rows


def w1(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF checkpoint dir; '' = SmolLM2 (default); 'tiny'")
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--median", type=float, default=16.0, help="median max_tokens")
    ap.add_argument("--sigma", type=float, default=1.5, help="log-normal sigma")
    ap.add_argument("--cap", type=int, default=512, help="the most tokens of a response")
    ap.add_argument("--extra", type=int, default=8, help="extra prompts of queue+extra")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per mode")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--passes", type=int, default=2, help="1: modes in order; 2: then in reverse")
    ap.add_argument(
        "--modes", default=None, help=f"default {','.join(MODES)}; with --epoch {','.join(EPOCH_MODES)}"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--learning", action="store_true", help="run the learning comparison instead")
    ap.add_argument("--seeds", type=int, default=3, help="--learning: seeds")
    ap.add_argument(
        "--async-config",
        default="algorithm.policy_loss=decoupled-ppo",
        help="--learning: config overrides of the async runs (space-separated)",
    )
    ap.add_argument("--recipe", action="store_true", help="run the default recipe's job instead")
    ap.add_argument("--recipe-modes", default=",".join(RECIPE_MODES), help="--recipe: set-ups")
    ap.add_argument("--recipe-args", default="", help="--recipe: overrides for every run (space-separated)")
    ap.add_argument("--epoch", type=int, default=0, help="K > 0: time one epoch of K fixed prompts per mode")
    ap.add_argument("--layout", default="ray", choices=["ray", "process"], help="--epoch: sync and async on")
    ap.add_argument("--seed", type=int, default=0, help="--epoch: seed")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    if args.epoch:
        modes = EPOCH_MODES if args.modes is None else [m.strip() for m in args.modes.split(",") if m.strip()]
        try:
            spec = EpochSpec(
                args.epoch,
                list(modes),
                args.layout,
                args.model,
                args.engine,
                args.prompts,
                args.n,
                f"lognormal:{args.median}:{args.sigma}",
                args.cap,
                seed=args.seed,
                threads=args.threads,
            )
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        return run_epoch(spec)
    if args.modes is None:
        args.modes = ",".join(MODES)
    if args.learning:
        return learning(args.seeds, args.async_config.split())
    if args.recipe:
        return recipe(
            [m.strip() for m in args.recipe_modes.split(",") if m.strip()], args.recipe_args.split()
        )

    from trainers.config import load_config
    from trainers.engines.build import make_rollout_engine, make_train_engine
    from trainers.loops import AsyncTrainer, SyncTrainer
    from trainers.models import char_tokenizer, default_model_path, load_model, tiny_qwen2

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        mode_overrides(m, args.extra)
    if args.model == "tiny":
        tok = char_tokenizer()
        model = tiny_qwen2(tok, seed=0, hidden_size=64, heads=2, kv_heads=1)
    else:
        model, tok = load_model(args.model or default_model_path())
    log_dir = tempfile.mkdtemp(prefix="rollkit-bench-async-")
    base = [
        f"rollout.engine={args.engine}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.n}",
        f"rollout.max_tokens={args.cap}",
        f"rollout.length_dist=lognormal:{args.median}:{args.sigma}",
        f"rollout.max_model_len={args.cap + 128}",
        "rollout.temperature=1.0",
        "rollout.dtype=auto",
        "train.autocast=auto",
        "train.sort_by_length=true",
        "train.micro_batch_size=8",
        "train.lr=1e-6",
        "data.digits=2",
        "eval.before=false",
        "eval.every=0",
        "logging.progress=false",
        f"logging.dir={log_dir}",
    ]
    cfg0 = load_config(base)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    engine = make_rollout_engine(cfg0, copy.deepcopy(model), tok, device="cpu")
    rows: dict[str, dict[str, float]] = {}
    print(
        f"W1: {args.prompts} prompts x {args.n} samples per step, max_tokens ~ lognormal(median "
        f"{args.median:g}, sigma {args.sigma:g}) capped at {args.cap}, ignore_eos; engine {args.engine}; "
        f"{torch.get_num_threads()} threads; {args.warmup} warm-up + {args.steps} measured steps per mode",
        flush=True,
    )
    results: dict[str, dict[str, list[float]]] = {
        m: {"t": [], "share": [], "stale": [], "len": []} for m in modes
    }

    def run(mode: str, steps: int, warmup: int) -> None:
        cls = SyncTrainer if mode == "sync" else AsyncTrainer
        cfg = load_config([*base, *mode_overrides(mode, args.extra)])
        engine.update_weights(init.items(), version=0)
        m = copy.deepcopy(model)
        m.load_state_dict(init)
        train = make_train_engine(cfg, m, device="cpu")
        res = results.get(mode)
        with cls(cfg, rollout=engine, train=train, tokenizer=tok) as tr:
            for k in range(warmup + steps):
                met = tr.step()
                if k < warmup or res is None:
                    continue
                res["t"].append(met["time/step"])
                res["share"].append(
                    (met.get("time/rollout", 0.0) + met.get("time/wait", 0.0)) / met["time/step"]
                )
                res["stale"].append(met.get("staleness/mean", 0.0))
                res["len"].append(met["response/length_mean"])
        del tr, train, m
        gc.collect()  # the trainer, its optimizer state and the producer thread's references
        if res is not None:
            print(f"  {mode:<12} {statistics.median(res['t'][-steps:]):.2f} s/step", flush=True)

    # Kernels for new shapes are built on first use (oneDNN): one sync run warms them for all
    # modes; then the modes run in order and again in reverse, to even out any drift.
    results_bak, results = results, {}
    run("sync", 0, 2)
    results = results_bak
    for order in (modes, modes[::-1])[: max(1, args.passes)]:
        for mode in order:
            run(mode, args.steps, args.warmup)
    for mode in modes:
        r = results[mode]
        rows[mode] = {
            "s_per_step": statistics.median(r["t"]),
            "gen_share": statistics.median(r["share"]),
            "staleness": statistics.mean(r["stale"]),
            "len_mean": statistics.mean(r["len"]),
        }
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    ref = rows.get("sync", next(iter(rows.values())))["s_per_step"]
    print()
    print(
        "| mode | s/step (median) | generating / waiting share | staleness (mean) | trained length (mean) | speed-up vs sync |"
    )
    print("|---|---|---|---|---|---|")
    for mode, r in rows.items():
        print(
            f"| {mode} | {r['s_per_step']:.2f} | {r['gen_share']:.0%} | {r['staleness']:.2f} | "
            f"{r['len_mean']:.1f} | {ref / r['s_per_step']:.2f}x |"
        )
    return rows


def recipe(modes: list[str], extra: list[str]) -> dict[str, dict[str, float]]:
    """The default recipe's job in each set-up of :data:`RECIPE_MODES` (module docstring)."""
    import json
    import re
    import subprocess

    for m in modes:
        if m not in RECIPE_MODES:
            raise SystemExit(f"--recipe-modes: unknown set-up {m!r}; known: {', '.join(RECIPE_MODES)}")
    root = Path(__file__).resolve().parents[1]
    cores = os.cpu_count() or 1
    rows: dict[str, dict[str, float]] = {}
    print(f"The default recipe's job (recipes/rlvr_qwen.py), {cores} cores, one run per set-up")
    for mode in modes:
        log_dir = tempfile.mkdtemp(prefix="rollkit-bench-recipe-")
        ray_cpus = [f"ray.num_cpus={cores}", f"placement.cpus_per_worker={max(1, cores // 2)}"]
        cmd = [
            sys.executable,
            str(root / "recipes" / "rlvr_qwen.py"),
            *RECIPE_MODES[mode],
            *(ray_cpus if "--ray" in RECIPE_MODES[mode] else []),
            *extra,
            f"logging.dir={log_dir}",
        ]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            print(p.stdout[-3000:], p.stderr[-3000:], sep="\n")
            raise SystemExit(f"{mode}: the recipe failed ({p.returncode}): {' '.join(cmd)}")
        acc = {k: float(v) for k, v in re.findall(r"held-out accuracy (before|after):\s+([0-9.]+)", p.stdout)}
        hist = [json.loads(line) for line in open(Path(log_dir) / "metrics.jsonl")]
        steps = [h for h in hist if "time/step" in h]
        t = [h["time/step"] for h in steps]
        waits = [(h.get("time/rollout", 0.0) + h.get("time/wait", 0.0)) / h["time/step"] for h in steps]
        rows[mode] = {
            "s_per_step": statistics.mean(t),
            "s_per_step_median": statistics.median(t),
            "gen_share": statistics.mean(waits),
            "staleness": statistics.mean([h.get("staleness/mean", 0.0) for h in steps]),
            "len_mean": statistics.mean([h["response/length_mean"] for h in steps]),
            "wall_s": wall,
            "before": acc.get("before", float("nan")),
            "after": acc.get("after", float("nan")),
        }
        print(f"  {mode:<14} {rows[mode]['s_per_step']:.2f} s/step, {wall:.0f} s in all", flush=True)
    ref = rows.get("sync", next(iter(rows.values())))["s_per_step"]
    print()
    print(
        "| set-up | s/step (mean) | median | generating / waiting share | staleness (mean) | "
        "trained length | job wall time | accuracy before -> after | speed-up vs sync (s/step) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        print(
            f"| {mode} | {r['s_per_step']:.2f} | {r['s_per_step_median']:.2f} | {r['gen_share']:.0%} | "
            f"{r['staleness']:.2f} | {r['len_mean']:.1f} | {r['wall_s']:.0f} s | {r['before']:.2f} -> "
            f"{r['after']:.2f} | {ref / r['s_per_step']:.2f}x |"
        )
    return rows


def learning(seeds: int, async_overrides: list[str]) -> dict[str, dict[str, float]]:
    """Held-out accuracy of the tiny-model task after the same trained samples: sync vs a=2."""
    from trainers.config import load_config
    from trainers.engines import HFRolloutEngine, TorchTrainEngine
    from trainers.learner import supervised_warmup
    from trainers.loops import AsyncTrainer, SyncTrainer
    from trainers.models import TINY_RL_OVERRIDES, char_tokenizer, tiny_qwen2

    rl = [
        "--model",
        "tiny",
        "data.digits=1",
        "data.eval_size=30",
        "eval.every=0",
        *TINY_RL_OVERRIDES,
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.plot=false",
    ]
    tok = char_tokenizer()
    out: dict[str, dict[str, float]] = {}
    print(
        "Learning preserved: 1-digit addition, tiny Qwen2 after 100 supervised steps; 25 RL steps x 64 samples"
    )
    print(f"async runs: asynchronous.ratio=2 {' '.join(async_overrides)}")
    print()
    print("| seed | before | sync after | async a=2 after | a=2 staleness (mean) |")
    print("|---|---|---|---|---|")
    for seed in range(seeds):
        res = {}
        for name, cls, extra in (
            ("sync", SyncTrainer, []),
            ("a=2", AsyncTrainer, ["asynchronous.ratio=2", *async_overrides]),
        ):
            cfg = load_config([*rl, f"seed={seed}", f"logging.dir={tempfile.mkdtemp()}", *extra])
            model = tiny_qwen2(tok, seed=seed)
            warm = TorchTrainEngine(model, lr=3e-3)
            with SyncTrainer(
                cfg, rollout=HFRolloutEngine(copy.deepcopy(model), tok), train=warm, tokenizer=tok
            ) as w:
                supervised_warmup(w.train, tok, w.train_prompts, steps=100, batch_size=64, seed=seed)
            train = TorchTrainEngine(model, lr=cfg.train.lr)
            with cls(
                cfg, rollout=HFRolloutEngine(copy.deepcopy(model), tok), train=train, tokenizer=tok
            ) as tr:
                t0 = time.perf_counter()
                r = tr.fit()
                stale = [h.get("staleness/mean", 0.0) for h in r["history"] if "staleness/mean" in h]
                res[name] = (r["accuracy_before"], r["accuracy_after"], time.perf_counter() - t0, stale)
        out[str(seed)] = {"before": res["sync"][0], "sync": res["sync"][1], "a=2": res["a=2"][1]}
        st = res["a=2"][3]
        print(
            f"| {seed} | {res['sync'][0]:.3f} | {res['sync'][1]:.3f} | {res['a=2'][1]:.3f} | "
            f"{(sum(st) / len(st)) if st else 0:.2f} |",
            flush=True,
        )
    s = [v["sync"] for v in out.values()]
    a = [v["a=2"] for v in out.values()]
    print(f"| mean | | {statistics.mean(s):.3f} | {statistics.mean(a):.3f} | |")
    return out


if __name__ == "__main__":
    w1()

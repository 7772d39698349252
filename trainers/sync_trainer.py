"""The synchronous RLVR trainer: one readable loop over injected rollout and training engines.

:meth:`SyncTrainer.step` is the whole RL step on one screen::

    sample prompts -> generate n per prompt -> reward each sample -> filter (dynamic sampling:
    refill until the batch is full, at most filter.max_rounds rounds) -> [reference log-probs]
    -> advantages (registry name) -> ppo_epochs x mini-batches x micro-batches of
    policy loss (registry name) + aggregate(global_normalizers) -> step -> push weights -> log

Everything algorithmic is a rollkit primitive picked by name in :class:`~trainers.config.Config`.
The engines are whatever implements :class:`~trainers.engines.base.RolloutEngine` and
:class:`~trainers.engines.base.TrainEngine` (the embedded transformers / PyTorch defaults
here; vLLM, DeepSpeed or Ray-actor proxies slot in through the constructor). The reference
policy for KL is a frozen copy of the initial policy behind the same ``logprobs`` interface.
"""

from __future__ import annotations

import copy
import random
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rollkit.losses import aggregate, global_normalizers
from rollkit.registry import ADVANTAGE_ESTIMATORS, FILTERS, POLICY_LOSSES, REGULARIZERS
from rollkit.rewards import RunningRewardNormalizer
from trainers.config import Config
from trainers.data import (
    Prompt,
    PromptIterator,
    addition_task,
    encode_prompt,
    exact_match_reward,
    load_prompts,
)
from trainers.engines.base import RolloutEngine, SamplingParams, TrainEngine, pack_generations
from trainers.tracking import Tracker

__all__ = ["SyncTrainer", "build_engines", "build_prompts", "supervised_warmup"]

RewardFn = Callable[[str, str], float]


def _dtype(name: str) -> torch.dtype:
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"model.dtype must be float32, bfloat16 or float16, got {name!r}") from None


def _lr_lambda(cfg: Config) -> Callable[[int], float]:
    import math

    warm, total, kind = cfg.train.warmup_steps, max(cfg.train.steps, 1), cfg.train.lr_schedule
    if kind not in ("constant", "cosine"):
        raise ValueError(f"train.lr_schedule must be constant or cosine, got {kind!r}")

    def f(step: int) -> float:  # step counts optimizer steps
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))
        return 1.0

    return f


def build_engines(cfg: Config) -> tuple[RolloutEngine, TrainEngine, Any]:
    """``(rollout, train, tokenizer)`` for ``cfg.model`` with the embedded default engines.

    Other engines (vLLM, DeepSpeed, Ray actors) are passed to :class:`SyncTrainer` directly.
    """
    from trainers.engines import HFRolloutEngine, TorchTrainEngine
    from trainers.models import char_tokenizer, default_model_path, load_model, tiny_qwen2

    if cfg.rollout.engine != "hf" or cfg.train.engine != "torch":
        raise ValueError(
            f"rollout.engine={cfg.rollout.engine!r} / train.engine={cfg.train.engine!r}: build_engines "
            "makes the embedded defaults (hf / torch); pass other engines to SyncTrainer(rollout=, train=)"
        )
    dtype = _dtype(cfg.model.dtype)
    if cfg.model.path == "tiny":
        tok = char_tokenizer()
        model = tiny_qwen2(tok, seed=cfg.model.tiny_seed, dtype=dtype)
    else:
        path = cfg.model.path or default_model_path()
        if not Path(path).exists():
            raise ValueError(f"model.path: {path} does not exist (give a local HF checkpoint directory)")
        model, tok = load_model(path, dtype=dtype)
    rollout = HFRolloutEngine(
        copy.deepcopy(model),
        tok,
        device=cfg.train.device,
        dtype=dtype,
        max_batch_size=cfg.rollout.max_batch_size,
    )
    lam = _lr_lambda(cfg)
    train = TorchTrainEngine(
        model,
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        grad_clip=cfg.train.grad_clip,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lam),
        dtype=dtype,
        device=cfg.train.device,
    )
    return rollout, train, tok


def build_prompts(cfg: Config) -> tuple[list[Prompt], list[Prompt]]:
    """``(train, held_out)`` prompts: from ``data.train_file`` / ``data.eval_file`` or the task."""
    d = cfg.data
    if d.train_file:
        train = load_prompts(d.train_file)
        if d.eval_file:
            return train, load_prompts(d.eval_file)
        return train[d.eval_size :], train[: d.eval_size]
    if d.task != "addition":
        raise ValueError(f"data.task: unknown task {d.task!r} (known: addition); or set data.train_file")
    return addition_task(digits=d.digits, eval_size=d.eval_size, seed=cfg.seed)


class _Timer:
    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self.t[name] += time.perf_counter() - t0


def _call(entry: Any, available: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    """Call a registered primitive with the batch tensors its ``in_keys`` name."""
    args = {a: available[k] for a, k in entry.in_keys.items() if available.get(k) is not None}
    missing = [a for a, req in entry.tensor_args().items() if req and a not in args]
    if missing:
        raise ValueError(f"{entry.name}: the trainer has no input for {missing} (in_keys {entry.in_keys})")
    return entry.fn(**args, **kwargs)


class SyncTrainer:
    """Synchronous RLVR: ``fit()`` = evaluate, ``steps`` x :meth:`step`, evaluate, plot.

    Args:
        cfg: the configuration.
        rollout, train, tokenizer: engines and tokenizer (default: :func:`build_engines`).
            ``rollout`` must start with the same weights as ``train``.
        train_prompts, eval_prompts: default :func:`build_prompts`.
        reward_fn: ``(completion_text, answer) -> float`` (default exact match on numbers).
        reference: anything with the TrainEngine ``logprobs`` method, holding the frozen
            initial policy (used when ``algorithm.kl.coef > 0``); default: a frozen deep copy
            of ``train.model`` (the embedded TorchTrainEngine).
    """

    def __init__(
        self,
        cfg: Config,
        *,
        rollout: RolloutEngine | None = None,
        train: TrainEngine | None = None,
        tokenizer: Any = None,
        train_prompts: list[Prompt] | None = None,
        eval_prompts: list[Prompt] | None = None,
        reward_fn: RewardFn = exact_match_reward,
        reference: Any = None,
    ) -> None:
        self.cfg = cfg
        self._validate()
        if rollout is None or train is None:
            rollout, train, tokenizer = build_engines(cfg)
        if tokenizer is None:
            raise ValueError("tokenizer: required when the engines are passed in")
        self.rollout, self.train, self.tok = rollout, train, tokenizer
        if train_prompts is None or eval_prompts is None:
            tp, ep = build_prompts(cfg)
            train_prompts = tp if train_prompts is None else train_prompts
            eval_prompts = ep if eval_prompts is None else eval_prompts
        self.train_prompts, self.eval_prompts = train_prompts, eval_prompts
        self.reward_fn = reward_fn
        self.iterator = PromptIterator(train_prompts, seed=cfg.seed)
        self._ids: dict[int, list[int]] = {}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        a = cfg.algorithm
        self.adv_entry = ADVANTAGE_ESTIMATORS.entry(a.advantage)
        self.loss_entry = POLICY_LOSSES.entry(a.policy_loss)
        self.normalizer = RunningRewardNormalizer() if a.reward_normalizer else None
        # Reference policy: a frozen copy of the initial policy, behind the same logprobs().
        self.reference = reference if a.kl.coef > 0 else None
        if a.kl.coef > 0 and reference is None:
            self.reference = copy.copy(train)
            self.reference.model = copy.deepcopy(train.model).eval().requires_grad_(False)
        self.global_step = 0
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    def _validate(self) -> None:
        c = self.cfg
        for name, v in (
            ("rollout.prompts_per_step", c.rollout.prompts_per_step),
            ("rollout.n", c.rollout.n),
            ("train.micro_batch_size", c.train.micro_batch_size),
            ("train.ppo_epochs", c.train.ppo_epochs),
            ("filter.max_rounds", c.filter.max_rounds),
        ):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if c.algorithm.kl.mode not in ("loss", "reward"):
            raise ValueError(f"algorithm.kl.mode must be loss or reward, got {c.algorithm.kl.mode!r}")
        for name, reg, value in (
            ("algorithm.advantage", ADVANTAGE_ESTIMATORS, c.algorithm.advantage),
            ("algorithm.policy_loss", POLICY_LOSSES, c.algorithm.policy_loss),
        ):
            if value not in reg:
                raise ValueError(
                    f"{name}: unknown {reg.kind} {value!r}; known: {', '.join(sorted(reg.names()))}"
                )

    # ------------------------------------------------------------------ helpers

    def encode(self, p: Prompt) -> list[int]:
        key = id(p)
        if key not in self._ids:
            self._ids[key] = encode_prompt(self.tok, p, self.cfg.data.chat_template)
        return self._ids[key]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _sampling(self, round_: int) -> SamplingParams:
        r = self.cfg.rollout
        seed = (self.cfg.seed * 1_000_003 + self.global_step * 1009 + round_) % (2**31)
        return SamplingParams(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens, seed=seed
        )

    def _ref_logprobs(self, batch: Any) -> torch.Tensor:
        out = []
        with torch.no_grad():
            for i in range(0, batch.input_ids.shape[0], self.cfg.train.micro_batch_size):
                mb = batch[i : i + self.cfg.train.micro_batch_size]
                out.append(
                    self.reference.logprobs(
                        mb.input_ids,
                        mb.attention_mask,
                        mb.response_mask,
                        temperature=self.cfg.rollout.temperature,
                    )
                )
        return torch.cat(out)

    # ------------------------------------------------------------------ the loop

    def step(self) -> dict[str, float]:
        """One RL step; returns its metrics."""
        cfg, a, timer = self.cfg, self.cfg.algorithm, _Timer()
        P, n = cfg.rollout.prompts_per_step, cfg.rollout.n
        t_start = time.perf_counter()

        # 1-3. Generate n samples per prompt and reward them; dynamic sampling refills dropped groups.
        groups: list[tuple[Prompt, list[Any], list[float]]] = []
        all_rewards, all_lens, gen_tokens, rounds = [], [], 0, 0
        acc_by_source: dict[str, list[float]] = defaultdict(list)
        max_rounds = cfg.filter.max_rounds if cfg.filter.zero_variance else 1
        while len(groups) < P and rounds < max_rounds:
            prompts = self.iterator.next_batch(P - len(groups))
            with timer("rollout"):
                gens = self.rollout.generate([self.encode(p) for p in prompts], self._sampling(rounds))
            rounds += 1
            with timer("reward"):  # sample by sample, as each generation comes back
                rewards = [
                    self.reward_fn(self.decode(g.token_ids), prompts[g.prompt_index].answer) for g in gens
                ]
            for g, r in zip(gens, rewards):
                acc_by_source[prompts[g.prompt_index].data_source].append(r)
            all_rewards += rewards
            all_lens += [len(g.token_ids) for g in gens]
            gen_tokens += sum(len(g.token_ids) for g in gens)
            r_t = torch.tensor(rewards, dtype=torch.float32)
            keep = torch.ones(len(gens), dtype=torch.bool)
            if cfg.filter.zero_variance:
                gid = torch.arange(len(prompts)).repeat_interleave(n)
                keep = _call(FILTERS.entry("zero_variance"), {"rewards": r_t, "group_ids": gid}, {})
            for i, p in enumerate(prompts):
                if bool(keep[i * n]):
                    groups.append((p, gens[i * n : (i + 1) * n], rewards[i * n : (i + 1) * n]))
        groups = groups[:P]
        metrics: dict[str, float] = {
            "reward/mean": sum(all_rewards) / len(all_rewards),
            "response/length_mean": sum(all_lens) / len(all_lens),
            "rollout/rounds": rounds,
            "rollout/kept_groups": len(groups),
        }
        for src, rs in acc_by_source.items():
            metrics[f"accuracy/{src}"] = sum(rs) / len(rs)

        if groups:
            # 4. Pack; the rollout's log-probs are the old (behaviour) log-probs.
            gens = [g for _, gs, _ in groups for g in gs]
            batch = pack_generations(gens, self.pad_id)
            mask = batch.response_mask
            group_ids = torch.arange(len(groups)).repeat_interleave(n)
            rewards = torch.tensor([r for _, _, rs in groups for r in rs], dtype=torch.float32)

            # 5. Optional KL to the frozen initial policy (as a reward penalty or a loss term).
            ref_lp = None
            if self.reference is not None:
                with timer("reference"):
                    ref_lp = self._ref_logprobs(batch)
                kl_tok = _call(
                    REGULARIZERS.entry("kl"),
                    {"logprobs": batch.old_logprobs, "ref_logprobs": ref_lp, "response_mask": mask},
                    {"estimator": a.kl.estimator, "coef": 1.0},
                ).loss
                metrics["kl/rollout"] = float(kl_tok.sum() / mask.sum().clamp(min=1))
                if a.kl.mode == "reward":
                    rewards = rewards - a.kl.coef * kl_tok.sum(-1)
            if self.normalizer is not None:
                rewards = self.normalizer.normalize(rewards)

            # 6. Advantages by registry name ([B] outcome advantages broadcast over tokens).
            adv = _call(
                self.adv_entry,
                {"rewards": rewards, "group_ids": group_ids, "response_mask": mask},
                a.advantage_kwargs,
            )
            adv = adv[0] if isinstance(adv, tuple) else adv
            adv = (adv[:, None] if adv.dim() == 1 else adv) * mask
            metrics["advantage/abs_mean"] = float(adv.abs().sum() / mask.sum().clamp(min=1))

            # 7. PPO epochs of micro-batched updates, global normalisers per mini-batch.
            B, mbs = mask.shape[0], cfg.train.micro_batch_size
            mini = cfg.train.mini_batch_size or B
            gen = torch.Generator().manual_seed(cfg.seed * 7919 + self.global_step)
            sums: dict[str, float] = defaultdict(float)
            counts: dict[str, int] = defaultdict(int)
            with timer("train"):
                for _ in range(cfg.train.ppo_epochs):
                    order = (
                        torch.randperm(B, generator=gen)
                        if cfg.train.ppo_epochs > 1 or mini < B
                        else torch.arange(B)
                    )
                    for m0 in range(0, B, mini):
                        rows_m = order[m0 : m0 + mini]
                        norms = global_normalizers(mask[rows_m])
                        for u0 in range(0, len(rows_m), mbs):
                            rows = rows_m[u0 : u0 + mbs]
                            mb = batch[rows]
                            lp, ent = self.train.logprobs(
                                mb.input_ids,
                                mb.attention_mask,
                                mb.response_mask,
                                temperature=cfg.rollout.temperature,
                                with_entropy=True,
                            )
                            avail = {
                                "logprobs": lp,
                                "old_logprobs": mb.old_logprobs,
                                "behavior_logprobs": mb.old_logprobs,
                                "advantages": adv[rows],
                                "response_mask": mb.response_mask,
                            }
                            out = _call(self.loss_entry, avail, a.policy_loss_kwargs)
                            loss = aggregate(out.loss, mb.response_mask, a.aggregation, **norms)
                            if a.entropy_coef:
                                e = REGULARIZERS.get("entropy")(ent, mb.response_mask, coef=a.entropy_coef)
                                loss = loss + aggregate(e.loss, mb.response_mask, a.aggregation, **norms)
                            if ref_lp is not None and a.kl.mode == "loss":
                                kl = REGULARIZERS.get("kl")(
                                    lp,
                                    ref_lp[rows],
                                    mb.response_mask,
                                    estimator=a.kl.estimator,
                                    coef=a.kl.coef,
                                )
                                loss = loss + aggregate(kl.loss, mb.response_mask, a.aggregation, **norms)
                            self.train.backward(loss)
                            w = int(mb.response_mask.sum())
                            for k, v in out.metrics.items():
                                sums[f"loss/{k}"] += float(v) * w
                                counts[f"loss/{k}"] += w
                            sums["entropy"] += float(ent.detach()[mb.response_mask].sum())
                            counts["entropy"] += w
                        for k, v in self.train.step().items():
                            sums[f"optim/{k}"] += v
                            counts[f"optim/{k}"] += 1
            metrics.update({k: sums[k] / max(counts[k], 1) for k in sums})

            # 8. Push the new weights to the rollout engine.
            with timer("weight_sync"):
                self.rollout.update_weights(self.train.export_weights(), version=self.global_step + 1)

        self.global_step += 1
        total = time.perf_counter() - t_start
        metrics.update({f"time/{k}": v for k, v in timer.t.items()})
        metrics["time/step"] = total
        metrics["throughput/rollout_tokens_per_s"] = gen_tokens / max(timer.t["rollout"], 1e-9)
        return metrics

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, prompts: list[Prompt] | None = None) -> dict[str, float]:
        """Greedy accuracy on the held-out prompts, overall and per ``data_source``."""
        prompts = self.eval_prompts if prompts is None else prompts
        if not prompts:
            return {}
        params = SamplingParams(n=1, temperature=0.0, max_tokens=self.cfg.eval.max_tokens, seed=0)
        gens = self.rollout.generate([self.encode(p) for p in prompts], params)
        by: dict[str, list[float]] = defaultdict(list)
        for g in gens:
            p = prompts[g.prompt_index]
            by[p.data_source].append(self.reward_fn(self.decode(g.token_ids), p.answer))
        scores = [s for v in by.values() for s in v]
        out = {"eval/accuracy": sum(scores) / len(scores)}
        if len(by) > 1:
            out.update({f"eval/accuracy/{k}": sum(v) / len(v) for k, v in by.items()})
        return out

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "train": self.train.state_dict(),
            "reference": None
            if getattr(self.reference, "model", None) is None
            else self.reference.model.state_dict(),
            "data": self.iterator.state_dict(),
            "normalizer": None if self.normalizer is None else self.normalizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def save_checkpoint(self, directory: str | Path | None = None) -> Path:
        """Write ``<checkpoint.dir>/step_<k>/trainer.pt``; returns the step directory."""
        root = Path(directory or self.cfg.checkpoint.dir)
        if not str(root):
            raise ValueError("checkpoint.dir: empty")
        path = root / f"step_{self.global_step:06d}"
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / "trainer.pt.tmp"
        torch.save(self.state_dict(), tmp)
        tmp.replace(path / "trainer.pt")
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a checkpoint (a ``step_<k>`` directory, or ``"auto"``: the latest under
        ``checkpoint.dir``) and push its weights to the rollout engine."""
        path = Path(path)
        if str(path) == "auto":
            found = sorted(Path(self.cfg.checkpoint.dir).glob("step_*/trainer.pt"))
            if not found:
                raise ValueError(f"checkpoint.resume=auto: no checkpoint under {self.cfg.checkpoint.dir!r}")
            path = found[-1].parent
        f = path / "trainer.pt" if path.is_dir() else path
        if not f.is_file():
            raise ValueError(f"checkpoint.resume: no trainer.pt at {path}")
        state = torch.load(f, weights_only=False)
        self.train.load_state_dict(state["train"])
        if getattr(self.reference, "model", None) is not None and state.get("reference") is not None:
            self.reference.model.load_state_dict(state["reference"])
        self.iterator.load_state_dict(state["data"])
        if self.normalizer is not None and state.get("normalizer") is not None:
            self.normalizer.load_state_dict(state["normalizer"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.global_step = int(state["global_step"])
        self.rollout.update_weights(self.train.export_weights(), version=self.global_step)

    # ------------------------------------------------------------------ fit

    def fit(self, steps: int | None = None) -> dict[str, Any]:
        """Evaluate, train ``steps`` (default ``train.steps``; counted from the current step
        up to that total), evaluate; returns a summary."""
        cfg = self.cfg
        resume_step = None
        if cfg.checkpoint.resume:
            self.load_checkpoint(cfg.checkpoint.resume)
            resume_step = self.global_step
        total = cfg.train.steps if steps is None else steps
        tracker = Tracker(
            cfg.logging.dir,
            tensorboard=cfg.logging.tensorboard,
            plot=cfg.logging.plot,
            resume_step=resume_step,
        )
        for note in tracker.notes:
            print(f"[rollkit] {note}")
        before = None
        if cfg.eval.before and self.global_step == 0:
            before = self.evaluate()
            tracker.log(0, before)
            print(f"[eval] step 0 held-out accuracy {before.get('eval/accuracy', float('nan')):.3f}")
        t0 = time.perf_counter()
        start = self.global_step
        while self.global_step < total:
            m = self.step()
            k = self.global_step
            if cfg.eval.every and k % cfg.eval.every == 0 and k < total:
                m.update(self.evaluate())
            tracker.log(k, m)
            if cfg.logging.progress:
                ev = f" eval {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""
                print(
                    f"[step {k:>4}/{total}] reward {m['reward/mean']:.3f} len {m['response/length_mean']:.1f} "
                    f"kept {m['rollout/kept_groups']} {m['time/step']:.1f}s "
                    f"({m.get('time/rollout', 0):.1f} gen, {m.get('time/train', 0):.1f} train){ev}",
                    flush=True,
                )
            if cfg.checkpoint.dir and cfg.checkpoint.every and k % cfg.checkpoint.every == 0:
                self.save_checkpoint()
        train_time = time.perf_counter() - t0
        after = self.evaluate()
        tracker.log(self.global_step, after)
        plot = tracker.plot()
        tracker.close()
        if cfg.checkpoint.dir:
            self.save_checkpoint()
        steps_run = self.global_step - start
        return {
            "accuracy_before": None if before is None else before.get("eval/accuracy"),
            "accuracy_after": after.get("eval/accuracy"),
            "steps": steps_run,
            "train_seconds": train_time,
            "seconds_per_step": train_time / max(steps_run, 1),
            "metrics_file": str(tracker.jsonl),
            "tensorboard_dir": None
            if tracker.tb is None and not (tracker.dir / "tb").exists()
            else str(tracker.dir / "tb"),
            "plot": None if plot is None else str(plot),
            "notes": tracker.notes,
            "history": tracker.history,
        }


def supervised_warmup(
    train: TrainEngine,
    tokenizer: Any,
    prompts: list[Prompt],
    *,
    steps: int,
    batch_size: int = 32,
    seed: int = 0,
    chat_template: str = "off",
) -> float:
    """Teacher-forced SFT of ``prompt -> answer<eos>`` through the TrainEngine interface
    (token-mean NLL); returns the last loss. Used to give a tiny random model a starting
    accuracy before RL."""
    from trainers.engines.base import pack

    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    loss_v = float("nan")
    for _ in range(steps):
        ps = [prompts[rng.randrange(len(prompts))] for _ in range(batch_size)]
        ids = [encode_prompt(tokenizer, p, chat_template) for p in ps]
        ans = [[*tokenizer(p.answer, add_special_tokens=False).input_ids, eos] for p in ps]
        b = pack(ids, ans, pad)
        lp = train.logprobs(b.input_ids, b.attention_mask, b.response_mask)
        loss = aggregate(-lp, b.response_mask, "token-mean")
        train.backward(loss)
        train.step()
        loss_v = float(loss.detach())
    return loss_v

"""The agentic multi-turn RL trainer: environment rollouts -> trajectories -> StarPO / GiGPO -> PPO.

:meth:`AgenticTrainer.step` is one RL step on one screen::

    collect (lock-step | env-level async | async + redundant environments; faulty envs dropped
    and replaced) -> build_batch (one sequence per episode, response_mask False on env tokens)
    -> advantages (registry name: "starpo" one per trajectory, "gigpo" one per step with
    state groups, or any outcome estimator) -> ppo_epochs x mini-batches x micro-batches of
    policy loss (registry name) + aggregate(global_normalizers) -> step -> push weights -> log

With ``rollout.max_staleness = 0`` (default) the step is synchronous: collect with the current
weights, then train. With ``max_staleness >= 1`` the next batch is collected in the background
while the current one trains (the engine takes the new weights between two generation
batches, so an episode may span a weight update); every turn records the policy version that
wrote it, and an episode is aborted and replaced as soon as one of its turns is more than
``max_staleness`` versions behind the trainer (:mod:`trainers.envs.episodes`).

Configuration: :class:`AgenticConfig`, loaded with :func:`trainers.config.load_config`
(``load_config(argv, base=AgenticConfig())``): the same YAML / ``key=value`` machinery as the
RLVR trainer, reusing its ``model``, ``train``, ``algorithm`` and ``logging`` sections.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollkit.advantages import anchor_state_index
from rollkit.losses import aggregate, global_normalizers
from rollkit.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, REGULARIZERS
from rollkit.trajectory import TrajectoryBatch
from trainers.config import AlgorithmConfig, LoggingConfig, ModelConfig, TrainConfig
from trainers.engines.base import SamplingParams, pack
from trainers.envs.episodes import MODES, EpisodeBatch, EpisodeRunner
from trainers.envs.turns import TurnEncoder
from trainers.tracking import Tracker

__all__ = [
    "AgenticConfig",
    "AgenticEvalConfig",
    "AgenticRolloutConfig",
    "AgenticTrainer",
    "EnvConfig",
    "WarmupConfig",
    "build_agentic_engines",
    "plot_history",
]


# --------------------------------------------------------------------------- config


@dataclass
class EnvConfig:
    """The environment: a registered name (``frozenlake``, ``sokoban``, ``calculator``,
    ``gem:<id>``) or ``"module:attr"``, its keyword arguments, and the episode limits."""

    name: str = "frozenlake"
    kwargs: dict = field(default_factory=lambda: {"size": 3, "hole_prob": 0.0, "max_turns": 6})
    max_turns: int = 6
    max_context: int = 1024  # tokens per episode, prompt included
    chat_template: str = "auto"  # "auto" (if the tokenizer has one), "on", "off"
    system_prompt: str = ""
    deadline_s: float = 30.0  # per reset / step; past it the env counts as hung and is replaced
    start_method: str = "forkserver"


@dataclass
class AgenticRolloutConfig:
    """Sampling and scheduling. A step trains ``groups_per_step x group_size`` trajectories;
    ``async`` launches ``num_env_groups`` task groups (``0``: ``groups_per_step``) of
    ``group_size + redundancy`` episodes and keeps the first finishers."""

    engine: str = "hf"
    mode: str = "async"  # "lockstep" or "async"
    groups_per_step: int = 4
    group_size: int = 4
    num_env_groups: int = 0
    redundancy: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16  # per turn
    max_batch_size: int | None = None
    # rollout weights' dtype: "" = model.dtype; "auto" = bfloat16 where its matmuls are fast
    # (CUDA with bf16, CPUs with AMX), else model.dtype; or "float32" / "bfloat16" / "float16"
    dtype: str = ""
    max_staleness: int = 0  # 0: synchronous; >= 1: overlap collection with training, per-turn bound
    max_attempts: int = 0  # episodes launched per group before it is abandoned (0: 3 x launched)


@dataclass
class WarmupConfig:
    """Optional supervised warm-up on well-formed random actions (teaches a tiny random model
    the action format, so that RL has successes to learn from). ``steps = 0``: off."""

    steps: int = 0
    batch_size: int = 16
    lr: float = 3e-3
    bare: bool = False  # target the action without \\boxed{} (the built-in games accept a bare word)


@dataclass
class AgenticEvalConfig:
    """Greedy success rate on ``episodes`` fixed tasks (seeds ``seed .. seed + episodes - 1``,
    disjoint from the training seeds), before training, every ``every`` steps and after."""

    episodes: int = 32
    every: int = 0
    before: bool = True
    max_tokens: int = 16
    seed: int = 1_000_000_000


def _default_algorithm() -> AlgorithmConfig:
    a = AlgorithmConfig()
    a.advantage = "starpo"
    return a


def _default_logging() -> LoggingConfig:
    log = LoggingConfig()
    log.dir = "runs/agentic"
    return log


@dataclass
class AgenticConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: AgenticRolloutConfig = field(default_factory=AgenticRolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=_default_algorithm)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    eval: AgenticEvalConfig = field(default_factory=AgenticEvalConfig)
    logging: LoggingConfig = field(default_factory=_default_logging)
    seed: int = 0


def _validate(cfg: AgenticConfig) -> None:
    r, a = cfg.rollout, cfg.algorithm
    for name, v in (
        ("rollout.groups_per_step", r.groups_per_step),
        ("rollout.group_size", r.group_size),
        ("rollout.max_tokens", r.max_tokens),
        ("env.max_turns", cfg.env.max_turns),
        ("env.max_context", cfg.env.max_context),
        ("train.micro_batch_size", cfg.train.micro_batch_size),
        ("train.ppo_epochs", cfg.train.ppo_epochs),
        ("eval.episodes", cfg.eval.episodes),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    for name, v in (
        ("rollout.redundancy", r.redundancy),
        ("rollout.max_staleness", r.max_staleness),
        ("rollout.num_env_groups", r.num_env_groups),
    ):
        if v < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
    if r.mode not in MODES:
        raise ValueError(f"rollout.mode: expected one of {MODES}, got {r.mode!r}")
    if r.num_env_groups and r.num_env_groups < r.groups_per_step:
        raise ValueError(
            f"rollout.num_env_groups: {r.num_env_groups} < rollout.groups_per_step {r.groups_per_step}"
        )
    if r.mode == "lockstep" and (r.redundancy or r.num_env_groups > r.groups_per_step):
        raise ValueError(
            "rollout.redundancy / num_env_groups: redundant environments need rollout.mode=async"
        )
    if r.temperature <= 0:
        raise ValueError(f"rollout.temperature: training needs sampling (> 0), got {r.temperature}")
    if cfg.env.chat_template not in ("auto", "on", "off"):
        raise ValueError(f"env.chat_template: expected auto, on or off, got {cfg.env.chat_template!r}")
    if a.kl.coef:
        raise ValueError("algorithm.kl.coef: the agentic trainer has no reference policy; set it to 0")
    for name, reg, value in (
        ("algorithm.advantage", ADVANTAGE_ESTIMATORS, a.advantage),
        ("algorithm.policy_loss", POLICY_LOSSES, a.policy_loss),
    ):
        if value not in reg:
            raise ValueError(f"{name}: unknown {reg.kind} {value!r}; known: {', '.join(sorted(reg.names()))}")


# --------------------------------------------------------------------------- engines


def build_agentic_engines(cfg: AgenticConfig) -> tuple[Any, Any, Any]:
    """``(rollout, train, tokenizer)``: the embedded transformers / PyTorch engines for
    ``cfg.model`` (``"tiny"``: a random tiny Qwen2 with the character tokenizer; ``""``: the
    embedded default SmolLM2-135M-Instruct; else a checkpoint directory)."""
    from trainers.engines import HFRolloutEngine, TorchTrainEngine
    from trainers.models import char_tokenizer, default_model_path, load_model, tiny_qwen2

    if cfg.rollout.engine != "hf" or cfg.train.engine != "torch":
        raise ValueError(
            f"rollout.engine={cfg.rollout.engine!r} / train.engine={cfg.train.engine!r}: only the embedded "
            "hf / torch engines are built here; pass other engines to AgenticTrainer(rollout_engine=, train_engine=)"
        )
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if cfg.model.dtype not in dtypes:
        raise ValueError(f"model.dtype: expected one of {sorted(dtypes)}, got {cfg.model.dtype!r}")
    dtype = dtypes[cfg.model.dtype]
    from trainers.sync_trainer import rollout_dtype, train_autocast

    # train.autocast / rollout.dtype as in the RLVR trainer (bfloat16 matmuls where fast)
    autocast, r_dtype = train_autocast(cfg, cfg.train.device), rollout_dtype(cfg, cfg.train.device)
    if cfg.model.path == "tiny":
        tok = char_tokenizer()
        model = tiny_qwen2(
            tok, seed=cfg.model.tiny_seed, dtype=dtype, max_positions=max(512, cfg.env.max_context)
        )
    else:
        path = cfg.model.path or default_model_path()
        if not Path(path).exists():
            raise ValueError(f"model.path: {path} does not exist (give a local HF checkpoint directory)")
        model, tok = load_model(path, dtype=dtype)
    rollout = HFRolloutEngine(
        copy.deepcopy(model),
        tok,
        device=cfg.train.device,
        dtype=r_dtype,
        max_batch_size=cfg.rollout.max_batch_size,
    )
    train = TorchTrainEngine(
        model,
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        grad_clip=cfg.train.grad_clip,
        dtype=dtype,
        device=cfg.train.device,
        autocast=autocast,
    )
    return rollout, train, tok


def _call(entry: Any, available: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    """Call a registered primitive with the tensors its ``in_keys`` name."""
    args = {a: available[k] for a, k in entry.in_keys.items() if available.get(k) is not None}
    missing = [a for a, req in entry.tensor_args().items() if req and a not in args]
    if missing:
        raise ValueError(
            f"{entry.name}: the agentic trainer has no input for {missing} (in_keys {entry.in_keys})"
        )
    return entry.fn(**args, **kwargs)


# --------------------------------------------------------------------------- trainer


class AgenticTrainer:
    """Multi-turn agentic RL (module docstring): ``fit()`` = evaluate, ``train.steps`` x
    :meth:`step`, evaluate.

    Args:
        cfg: the configuration.
        rollout_engine, train_engine, tokenizer: engines (default :func:`build_agentic_engines`);
            the rollout engine must start with the train engine's weights.
        runner: an :class:`~trainers.envs.workers.EnvWorkers` to play in (default: a new one).
    """

    def __init__(
        self,
        cfg: AgenticConfig,
        *,
        rollout_engine: Any = None,
        train_engine: Any = None,
        tokenizer: Any = None,
        runner: Any = None,
    ) -> None:
        _validate(cfg)
        self.cfg = cfg
        if rollout_engine is None or train_engine is None:
            rollout_engine, train_engine, tokenizer = build_agentic_engines(cfg)
        if tokenizer is None:
            raise ValueError("tokenizer: required when the engines are passed in")
        self.train, self.tok = train_engine, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        e = cfg.env
        template = None if e.chat_template == "auto" else e.chat_template == "on"
        self.encoder = TurnEncoder(tokenizer, chat_template=template, system_prompt=e.system_prompt or None)
        self.rollout = EpisodeRunner(
            rollout_engine,
            self.encoder,
            e.name,
            e.kwargs,
            max_turns=e.max_turns,
            max_context=e.max_context,
            workers=runner,
            deadline_s=e.deadline_s,
            start_method=e.start_method,
            max_batch_size=cfg.rollout.max_batch_size,
        )
        a = cfg.algorithm
        self.adv_entry = ADVANTAGE_ESTIMATORS.entry(a.advantage)
        self.loss_entry = POLICY_LOSSES.entry(a.policy_loss)
        self.version = 0  # optimizer steps applied = the policy version the engine serves
        self._seeds = random.Random(cfg.seed)
        self._calls = 0
        self._bg = (
            ThreadPoolExecutor(1, thread_name_prefix="agentic-collect") if cfg.rollout.max_staleness else None
        )
        self._next: Future | None = None
        torch.manual_seed(cfg.seed)

    # ------------------------------------------------------------------ rollout

    @property
    def launch_groups(self) -> int:
        r = self.cfg.rollout
        return r.num_env_groups or r.groups_per_step

    def version_floor(self) -> int:
        """The oldest policy version a turn may come from (``version - max_staleness``)."""
        return self.version - self.cfg.rollout.max_staleness

    def _params(self, temperature: float, max_tokens: int) -> SamplingParams:
        r = self.cfg.rollout
        self._calls += 1
        return SamplingParams(
            temperature=temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=max_tokens,
            seed=(self.cfg.seed * 1_000_003 + self._calls * 7919) % (2**31),
        )

    def collect(self) -> EpisodeBatch:
        """One batch of ``groups_per_step x group_size`` finished episodes (fresh task seeds)."""
        r = self.cfg.rollout
        seeds: list[int] = []
        while len(seeds) < self.launch_groups + 2:  # two spare tasks for abandoned groups
            s = self._seeds.randrange(self.cfg.eval.seed)
            if s not in seeds:
                seeds.append(s)
        return self.rollout.collect(
            seeds,
            self._params(r.temperature, r.max_tokens),
            groups=r.groups_per_step,
            group_size=r.group_size,
            mode=r.mode,
            redundancy=r.redundancy,
            launch_groups=self.launch_groups if r.mode == "async" else r.groups_per_step,
            version_floor=self.version_floor if r.max_staleness else None,
            max_attempts=r.max_attempts or None,
        )

    def prestart(self) -> None:
        """Start the environment workers a step needs (outside the timed steps)."""
        r = self.cfg.rollout
        self.rollout.prestart(self.launch_groups * (r.group_size + r.redundancy))

    # ------------------------------------------------------------------ advantages

    def advantages(self, batch: TrajectoryBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """``[B, T]`` advantages on the action tokens (0 on environment tokens and padding)."""
        a, mask = self.cfg.algorithm, batch.response_mask
        anchor, n_anchor = anchor_state_index(batch.step_group_ids, batch.state_ids)
        sizes = torch.bincount(anchor, minlength=n_anchor) if anchor.numel() else anchor
        metrics = {"adv/state_groups": float(n_anchor), "adv/state_groups_multi": float((sizes > 1).sum())}
        if "step_rewards" in self.adv_entry.in_keys.values():  # step-level (GiGPO): one value per turn
            steps = {
                "step_rewards": batch.step_rewards,
                "traj_ids": batch.traj_ids,
                "step_index": batch.step_index,
                "group_ids": batch.step_group_ids,
                "state_ids": batch.state_ids,
                "episode_returns": batch.episode_returns,
            }
            adv = batch.steps_to_tokens(_call(self.adv_entry, steps, a.advantage_kwargs))
        else:  # trajectory-level (StarPO, GRPO, RLOO, ...): one value per trajectory
            rows = {
                "rewards": batch.rewards,
                "group_ids": batch.group_ids,
                "response_mask": mask,
                "response_length": mask.sum(-1),
            }
            out = _call(self.adv_entry, rows, a.advantage_kwargs)
            out = out[0] if isinstance(out, tuple) else out
            adv = (out[:, None] if out.dim() == 1 else out) * mask
        adv = torch.where(mask, adv, torch.zeros((), dtype=adv.dtype))
        metrics["advantage/abs_mean"] = float(adv.abs().sum() / mask.sum().clamp(min=1))
        return adv, metrics

    # ------------------------------------------------------------------ the loop

    def step(self) -> dict[str, float]:
        """One RL step; returns its metrics."""
        cfg, a = self.cfg, self.cfg.algorithm
        t0 = time.perf_counter()
        if self._bg is None:
            result = self.collect()
        else:  # the batch was (being) collected while the previous step trained
            if self._next is None:
                self._next = self._bg.submit(self.collect)
            result = self._next.result()
            self._next = self._bg.submit(self.collect)
        t_rollout = time.perf_counter() - t0
        eps = result.episodes
        metrics: dict[str, float] = dict(result.metrics)
        versions = [v for e in eps for v in e.versions]
        stale = [self.version - v for v in versions]
        metrics.update(
            {
                "reward/mean": sum(e.total_reward for e in eps) / len(eps),
                "success/rate": sum(e.success for e in eps) / len(eps),
                "episode/turns_mean": sum(len(e.turns) for e in eps) / len(eps),
                "episode/action_tokens_mean": sum(len(t.action_ids) for e in eps for t in e.turns)
                / max(1, len(versions)),
                "episode/context_full": float(sum(e.context_full for e in eps)),
                "staleness/max": float(max(stale, default=0)),
                "staleness/mean": sum(stale) / max(1, len(stale)),
            }
        )

        # Trajectories -> one packed batch; env tokens are masked out of the response.
        batch = result.to_batch(max_context=cfg.env.max_context, pad_token_id=self.pad_id)
        mask = batch.response_mask
        adv, adv_metrics = self.advantages(batch)
        metrics.update(adv_metrics)

        # PPO epochs of micro-batched updates, global normalisers per mini-batch.
        t1 = time.perf_counter()
        B, mbs = mask.shape[0], cfg.train.micro_batch_size
        mini = cfg.train.mini_batch_size or B
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + self.version)
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        T = cfg.rollout.temperature
        for _ in range(cfg.train.ppo_epochs):
            order = (
                torch.randperm(B, generator=gen) if cfg.train.ppo_epochs > 1 or mini < B else torch.arange(B)
            )
            for m0 in range(0, B, mini):
                rows_m = order[m0 : m0 + mini]
                norms = global_normalizers(mask[rows_m])
                for u0 in range(0, len(rows_m), mbs):
                    rows = rows_m[u0 : u0 + mbs]
                    m = mask[rows]
                    lp, ent = self.train.logprobs(
                        batch.input_ids[rows], batch.attention_mask[rows], m, temperature=T, with_entropy=True
                    )
                    behavior = batch.behavior_logprobs[rows]
                    avail = {
                        "logprobs": lp,
                        "old_logprobs": behavior,
                        "behavior_logprobs": behavior,
                        "advantages": adv[rows],
                        "response_mask": m,
                    }
                    out = _call(self.loss_entry, avail, a.policy_loss_kwargs)
                    loss = aggregate(out.loss, m, a.aggregation, **norms)
                    if a.entropy_coef:
                        e = REGULARIZERS.get("entropy")(ent, m, coef=a.entropy_coef)
                        loss = loss + aggregate(e.loss, m, a.aggregation, **norms)
                    self.train.backward(loss)
                    w = int(m.sum())
                    for k, v in out.metrics.items():
                        sums[f"loss/{k}"] += float(v) * w
                        counts[f"loss/{k}"] += w
                    gap = (lp.detach() - behavior).abs()[m]
                    sums["train/logprob_gap"] += float(gap.sum())
                    counts["train/logprob_gap"] += w
                    sums["entropy"] += float(ent.detach()[m].sum())
                    counts["entropy"] += w
                for k, v in self.train.step().items():
                    sums[f"optim/{k}"] += v
                    counts[f"optim/{k}"] += 1
        metrics.update({k: sums[k] / max(counts[k], 1) for k in sums})
        t_train = time.perf_counter() - t1

        # Push the new weights (between two generation batches if a collection is running).
        t2 = time.perf_counter()
        self.version += 1
        self.rollout.server.update_weights(self.train.export_weights(), self.version)
        metrics.update(
            {
                "time/rollout": t_rollout,
                "time/train": t_train,
                "time/weight_sync": time.perf_counter() - t2,
                "time/step": time.perf_counter() - t0,
                "train/trajectories": float(B),
            }
        )
        return metrics

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, episodes: int | None = None) -> dict[str, float]:
        """Greedy success rate on the fixed evaluation tasks."""
        ev = self.cfg.eval
        n = ev.episodes if episodes is None else episodes
        seeds = [ev.seed + i for i in range(n + 2)]
        params = SamplingParams(temperature=0.0, max_tokens=ev.max_tokens, seed=0)
        res = self.rollout.collect(seeds, params, groups=n, group_size=1, mode="async", launch_groups=n)
        eps = res.episodes
        return {
            "eval/success_rate": sum(e.success for e in eps) / len(eps),
            "eval/reward_mean": sum(e.total_reward for e in eps) / len(eps),
            "eval/turns_mean": sum(len(e.turns) for e in eps) / len(eps),
        }

    # ------------------------------------------------------------------ warm-up

    def warmup(self, steps: int | None = None) -> float:
        """Supervised warm-up (``warmup.*``): contexts of random tasks after ``0 .. 2`` random
        turns (built in token space as the rollout builds them) -> a random well-formed action
        (the environment's ``sample_random_action``) + EOS; token-mean NLL through the train
        engine with its own AdamW; pushes the weights. Returns the last loss."""
        from trainers.envs.base import extract_boxed
        from trainers.envs.wrappers import build_inner

        w = self.cfg.warmup
        steps = w.steps if steps is None else steps
        if steps <= 0:
            return float("nan")
        env = build_inner(self.cfg.env.name, self.cfg.env.kwargs)
        rng = random.Random(self.cfg.seed + 17)
        params = [p for p in self.train.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=w.lr)
        eos = self.tok.eos_token_id

        def action() -> list[int]:
            text = env.sample_random_action()
            text = (extract_boxed(text) or text) if w.bare else text
            return [*self.tok(text, add_special_tokens=False).input_ids, eos]

        loss_v = float("nan")
        for _ in range(steps):
            contexts, answers = [], []
            while len(contexts) < w.batch_size:
                obs, _ = env.reset(seed=rng.randrange(self.cfg.eval.seed))
                context = self.encoder.prompt_ids(obs)
                for _ in range(rng.randrange(min(3, self.cfg.env.max_turns))):
                    act = action()
                    obs, _, terminated, truncated, _ = env.step(
                        self.tok.decode(act, skip_special_tokens=True)
                    )
                    if terminated or truncated:
                        break
                    context = context + act + self.encoder.obs_ids(obs, act)
                else:
                    if len(context) < self.cfg.env.max_context - 16:
                        contexts.append(context)
                        answers.append(action())
            b = pack(contexts, answers, self.pad_id)
            lp = self.train.logprobs(b.input_ids, b.attention_mask, b.response_mask)
            loss = aggregate(-lp, b.response_mask, "token-mean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            loss_v = float(loss.detach())
        opt.zero_grad(set_to_none=True)
        self.rollout.server.update_weights(self.train.export_weights(), self.version)
        return loss_v

    # ------------------------------------------------------------------ fit

    def fit(
        self, steps: int | None = None, *, on_step: Callable[[int, dict], None] | None = None
    ) -> dict[str, Any]:
        """Warm up (if configured), evaluate, train ``steps`` (default ``train.steps``), evaluate;
        writes ``metrics.jsonl`` (and TensorBoard) under ``logging.dir`` and a plot
        (``curves.png``); returns a summary."""
        cfg = self.cfg
        total = cfg.train.steps if steps is None else steps
        tracker = Tracker(cfg.logging.dir, tensorboard=cfg.logging.tensorboard, plot=False)
        for note in tracker.notes:
            print(f"[rollkit] {note}")
        if cfg.warmup.steps:
            t = time.perf_counter()
            loss = self.warmup()
            print(f"[warmup] {cfg.warmup.steps} steps, last loss {loss:.3f} ({time.perf_counter() - t:.0f}s)")
        self.prestart()
        before = None
        if cfg.eval.before:
            before = self.evaluate()
            tracker.log(0, before)
            print(f"[eval] step 0 greedy success rate {before['eval/success_rate']:.3f}", flush=True)
        t0 = time.perf_counter()
        start = self.version
        while self.version - start < total:
            m = self.step()
            k = self.version
            if cfg.eval.every and k % cfg.eval.every == 0 and k - start < total:
                m.update(self.evaluate())
            tracker.log(k, m)
            if on_step is not None:
                on_step(k, m)
            if cfg.logging.progress:
                ev = f" eval {m['eval/success_rate']:.3f}" if "eval/success_rate" in m else ""
                print(
                    f"[step {k:>4}/{start + total}] reward {m['reward/mean']:+.3f} success {m['success/rate']:.3f} "
                    f"turns {m['episode/turns_mean']:.1f} {m['time/step']:.1f}s "
                    f"({m['time/rollout']:.1f} rollout, {m['time/train']:.1f} train) "
                    f"env hang/error/died/replaced/cancelled {m['env/hang']:.0f}/{m['env/error']:.0f}/"
                    f"{m['env/died']:.0f}/{m['env/replaced']:.0f}/{m['env/cancelled']:.0f}{ev}",
                    flush=True,
                )
        train_time = time.perf_counter() - t0
        self._drain()
        after = self.evaluate()
        tracker.log(self.version, after)
        plot = plot_history(tracker.history, tracker.dir / "curves.png") if cfg.logging.plot else None
        tracker.close()
        steps_run = self.version - start
        return {
            "success_before": None if before is None else before["eval/success_rate"],
            "success_after": after["eval/success_rate"],
            "steps": steps_run,
            "train_seconds": train_time,
            "seconds_per_step": train_time / max(steps_run, 1),
            "metrics_file": str(tracker.jsonl),
            "plot": None if plot is None else str(plot),
            "history": tracker.history,
        }

    def _drain(self) -> None:
        """Wait for a background collection (its batch is discarded)."""
        if self._next is not None:
            try:
                self._next.result()
            finally:
                self._next = None

    def close(self) -> None:
        self._drain()
        if self._bg is not None:
            self._bg.shutdown(wait=True)
        self.rollout.close()

    def __enter__(self) -> AgenticTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plot_history(history: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Training success rate and reward per step, and the greedy evaluation success rate, to a
    PNG; ``None`` without matplotlib."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    low = -0.15
    for key, label, marker in (
        ("success/rate", "train success rate (sampled)", None),
        ("reward/mean", "train episode reward", None),
        ("eval/success_rate", "greedy success rate (held-out tasks)", "o"),
    ):
        pts = [(r["step"], r[key]) for r in history if r.get(key) is not None and math.isfinite(r[key])]
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=label)
            low = min(low, min(v for _, v in pts) - 0.05)
    ax.set_xlabel("step")
    ax.set_ylim(low, 1.02)
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path

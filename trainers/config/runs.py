"""The run configurations, composed from the sections of the components: :class:`Config` (the
RLVR trainers: sync, tail batching, async) and :class:`AgenticConfig`, and their validation.

Validation is one pass: :func:`~trainers.config.fields.check_fields` checks every field's own
rule (type, ``Literal`` choices, bounds, registry), then the sections' cross-field checks run.
A config that passed is stamped with a snapshot of its values, so the recipe's, the trainer's
and the loop's calls check it once (a changed field is checked again)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trainers.config.agentic import AgenticEvalConfig, AgenticRolloutConfig, EnvConfig, WarmupConfig
from trainers.config.algorithm import (
    RLVR_ONLY_ALGORITHM,
    AlgorithmConfig,
    CriticConfig,
    FilterConfig,
    check_algorithm,
    check_critic,
    check_registry_kwargs,
    check_rlvr_algorithm,
    critic_engine,
    critic_needed,
)
from trainers.config.capabilities import TRAIN_ENGINES
from trainers.config.data import DataConfig, check_data, check_vision
from trainers.config.engines import (
    ModelConfig,
    RolloutConfig,
    TrainConfig,
    check_remote_rollout,
    check_rlvr_rollout,
    check_rollout_engine,
    check_rollout_placement,
    check_train,
)
from trainers.config.fields import check_fields
from trainers.config.loop import (
    AsyncConfig,
    CheckpointConfig,
    EvalConfig,
    LoggingConfig,
    TailBatchingConfig,
    check_async,
    check_checkpoint,
    check_eval,
)
from trainers.config.pipelines import DistillSettings, OfflineAlgorithmConfig, OfflineDataConfig
from trainers.config.placement import PlacementConfig, RayConfig
from trainers.config.rewards import RewardConfig

__all__ = [
    "AgenticConfig",
    "Config",
    "DistillConfig",
    "OfflineConfig",
    "validate",
    "validate_agentic",
    "validate_async",
    "validate_distill",
    "validate_offline",
    "validate_run",
]


@dataclass
class Config:
    """The RLVR trainers' configuration (:class:`trainers.loops.SyncTrainer`, tail batching,
    :class:`trainers.loops.AsyncTrainer`)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    tail_batching: TailBatchingConfig = field(default_factory=TailBatchingConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 0


@dataclass
class AgenticConfig:
    """The agentic trainer's configuration (:class:`trainers.loops.AgenticTrainer`); load it
    with ``load_config(argv, base=AgenticConfig())``. It shares the ``model``, ``train``,
    ``algorithm`` and ``logging`` sections with :class:`Config`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: AgenticRolloutConfig = field(default_factory=AgenticRolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=lambda: AlgorithmConfig(advantage="starpo"))
    critic: CriticConfig = field(default_factory=CriticConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    eval: AgenticEvalConfig = field(default_factory=AgenticEvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(dir="runs/agentic"))
    # ray.enabled: the rollout, train and reference roles as Ray actors placed by `placement`, as in
    # the RLVR trainers (the environments stay in this process's workers)
    ray: RayConfig = field(default_factory=RayConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    seed: int = 0


@dataclass
class OfflineConfig:
    """The offline trainer's configuration (:class:`trainers.loops.offline.OfflineTrainer`);
    ``load_config(argv, base=OfflineConfig())``. It shares ``model``, ``train``, ``eval``
    (``every``, ``before``), ``checkpoint`` and ``logging`` with :class:`Config`; ``train.steps``
    optimizer steps, ``train.lr`` etc."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: OfflineDataConfig = field(default_factory=OfflineDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    offline: OfflineAlgorithmConfig = field(default_factory=OfflineAlgorithmConfig)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(every=0))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # curves.png plots reward and accuracy, which SFT does not have
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(dir="runs/offline", plot=False))
    seed: int = 0


@dataclass
class DistillConfig(Config):
    """:class:`Config` plus the ``distill`` section (:class:`trainers.loops.distill.DistillTrainer`);
    load it with ``load_config(argv, base=DistillConfig())``."""

    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(dir="runs/distill"))
    distill: DistillSettings = field(default_factory=DistillSettings)


_STAMP = "_rollkit_validated"


def _snapshot(cfg: Any) -> str:
    return repr(dataclasses.asdict(cfg))


def _validated(cfg: Any) -> bool:
    """Whether ``cfg`` passed validation with the values it has now."""
    return getattr(cfg, _STAMP, None) == _snapshot(cfg)


def _stamp(cfg: Any) -> None:
    object.__setattr__(cfg, _STAMP, _snapshot(cfg))


def _check_shared(cfg: Any) -> None:
    """What every trainer checks: the algorithm, the train engine (and the critic's), the
    critic, the rollout engine, the placement, the checkpoint, the registry kwargs."""
    check_algorithm(cfg.algorithm)
    check_train(cfg, critic_engine(cfg))
    check_critic(cfg)
    check_registry_kwargs(cfg)
    check_rollout_engine(cfg.rollout, cfg.rollout.engine)
    check_rollout_placement(cfg)
    check_checkpoint(cfg.checkpoint)


def validate(cfg: Config) -> None:
    """Check ``cfg`` before anything is built; a bad value raises ``ValueError`` naming its field.
    Each field's own rule first (:func:`~trainers.config.fields.check_fields`), then the checks
    across fields and sections; a config checked before with the same values is not checked again."""
    if _validated(cfg):
        return
    c = cfg
    check_fields(c)
    _check_shared(c)
    check_rlvr_rollout(c)
    check_rlvr_algorithm(c)
    check_data(c)
    check_eval(c.eval)
    check_remote_rollout(c, c.asynchronous.num_engines)
    check_vision(c)
    if c.asynchronous.enabled:
        check_async(c)
    _stamp(c)


def validate_async(cfg: Config) -> None:
    """The checks of the ``asynchronous`` section against placement and Ray
    (:class:`trainers.loops.AsyncTrainer`; :func:`validate` runs them when ``asynchronous.enabled``)."""
    check_async(cfg)


def validate_agentic(cfg: AgenticConfig) -> None:
    """Check an :class:`AgenticConfig`; a bad value raises ``ValueError`` naming its field."""
    if _validated(cfg):
        return
    check_fields(cfg)
    r, a = cfg.rollout, cfg.algorithm
    if r.sample_per == "turn" and r.max_tokens >= cfg.env.max_context:
        raise ValueError(
            f"rollout.sample_per=turn: rollout.max_tokens ({r.max_tokens}) must be below env.max_context "
            f"({cfg.env.max_context}), which bounds each turn's context and action"
        )
    if r.sample_per == "turn" and critic_needed(cfg):
        raise ValueError(
            f"rollout.sample_per=turn: algorithm.advantage={a.advantage} bootstraps a critic along the whole "
            "trajectory; use sample_per=trajectory, or a per-turn estimator (gigpo, discounted_return, starpo)"
        )
    if r.num_env_groups and r.num_env_groups < r.groups_per_step:
        raise ValueError(
            f"rollout.num_env_groups: {r.num_env_groups} < rollout.groups_per_step {r.groups_per_step}"
        )
    if r.mode == "lockstep" and (r.redundancy or r.num_env_groups > r.groups_per_step):
        raise ValueError(
            "rollout.redundancy / num_env_groups: redundant environments need rollout.mode=async"
        )
    for name, get, off in RLVR_ONLY_ALGORITHM:
        if get(a) != off:
            raise ValueError(
                f"{name}: wired in the RLVR trainers only (one reward per sample), not the agentic one; set it to {off}"
            )
    if cfg.placement.offload_train:
        raise ValueError(
            "placement.offload_train: not wired in the agentic trainer (its rollout and update overlap)"
        )
    check_remote_rollout(cfg)
    _check_shared(cfg)
    _stamp(cfg)


def validate_offline(cfg: OfflineConfig) -> None:
    """Check an :class:`OfflineConfig`: every field's rule, then what a reward model cannot do."""
    if _validated(cfg):
        return
    check_fields(cfg)
    o, t = cfg.offline, cfg.train
    if o.loss == "rm" and not TRAIN_ENGINES.supports(t.engine, "reward_model"):
        names = TRAIN_ENGINES.having(lambda s: s.reward_model)
        raise ValueError(f"train.engine: offline.loss=rm trains with the {names} engine, got {t.engine!r}")
    if o.loss == "rm" and t.lora_rank:
        raise ValueError("train.lora_rank: offline.loss=rm trains every weight (set train.lora_rank=0)")
    check_checkpoint(cfg.checkpoint)
    _stamp(cfg)


def validate_distill(cfg: DistillConfig) -> None:
    """:func:`validate` plus the ``distill`` section (its fields' rules are checked with the rest)."""
    validate(cfg)
    d = cfg.distill
    if d.task_coef and d.mode != "rl":
        raise ValueError(f"distill.task_coef={d.task_coef}: task advantages need distill.mode=rl")
    if critic_needed(cfg):
        raise ValueError(
            f"algorithm.advantage={cfg.algorithm.advantage}: distillation trains without a critic (its advantages "
            "are the teacher's per-token scores); use a critic-free estimator (grpo, rloo, ...)"
        )


def validate_run(cfg: Any) -> None:
    """The validator of ``cfg``'s pipeline: :func:`validate_distill`, :func:`validate`,
    :func:`validate_agentic` or :func:`validate_offline` (what :func:`trainers.config.load_config`
    runs on the config it returns)."""
    for cls, check in ((DistillConfig, validate_distill), (Config, validate), (AgenticConfig, validate_agentic),
                       (OfflineConfig, validate_offline)):  # fmt: skip
        if isinstance(cfg, cls):
            check(cfg)
            return
    raise TypeError(f"cfg: expected a run config (Config, AgenticConfig, OfflineConfig, DistillConfig), got {type(cfg).__name__}")

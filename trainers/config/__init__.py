"""Typed configuration of the reference trainers: dataclasses, YAML files, command-line overrides.

The sections live by component, each with its fields' rules and its cross-field checks:

* :mod:`trainers.config.engines` -- ``model``, ``rollout``, ``train``, checked against the engines'
  capabilities (:mod:`trainers.config.capabilities`: every rollout and train engine, one line each);
* :mod:`trainers.config.algorithm` -- ``algorithm`` (with ``kl``, ``correction``), ``critic``, ``filter``;
* :mod:`trainers.config.data` -- ``data`` and its domains;
* :mod:`trainers.config.rewards` -- ``reward``;
* :mod:`trainers.config.placement` -- ``ray``, ``placement``;
* :mod:`trainers.config.loop` -- ``eval``, ``checkpoint``, ``logging``, ``asynchronous``, ``tail_batching``;
* :mod:`trainers.config.agentic` -- the agentic trainer's ``env``, ``rollout``, ``warmup``, ``eval``;
* :mod:`trainers.config.pipelines` -- the offline trainer's ``data`` and ``offline``, distillation's ``distill``.

:mod:`trainers.config.runs` composes them into the run configs of every pipeline
(:class:`Config`, :class:`AgenticConfig`, :class:`OfflineConfig`, :class:`DistillConfig`) and validates them in one pass; :mod:`trainers.config.fields` is the one
mechanism that checks every field's declared rule (type, ``Literal`` choices, bounds, registry);
:mod:`trainers.config.cli` is the command line, YAML and ``--help``.

Every field has a type and a default. :func:`load_config` builds a :class:`Config` from an
optional YAML file (``--config file.yaml``) and then applies overrides, in order, written as
verl / ROLL users expect::

    train.lr=1e-5  --algorithm.advantage grpo  --rollout.n=8  algorithm.policy_loss_kwargs='{clip_high: 0.28}'

>>> cfg = load_config(["train.lr=3e-4", "--algorithm.advantage", "rloo", "--model", "tiny"])
>>> cfg.train.lr, cfg.algorithm.advantage, cfg.model.path
(0.0003, 'rloo', 'tiny')
"""

from trainers.config.agentic import (
    AGENTIC_MODES,
    AgenticEvalConfig,
    AgenticRolloutConfig,
    EnvConfig,
    WarmupConfig,
)
from trainers.config.algorithm import (
    CRITIC_KEYS,
    RLVR_ONLY_ALGORITHM,
    AlgorithmConfig,
    CorrectionConfig,
    CriticConfig,
    FilterConfig,
    KLConfig,
    check_registry_kwargs,
    critic_advantages,
    critic_ensemble,
    critic_needed,
)
from trainers.config.capabilities import (
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
    EngineTable,
    RolloutEngineSpec,
    TrainEngineSpec,
)
from trainers.config.cli import (
    ALIASES,
    FLAGS,
    apply_dict,
    apply_overrides,
    config_to_dict,
    help_text,
    load_config,
    parse_args,
    save_config,
    set_value,
)
from trainers.config.data import DOMAIN_KEYS, TASK_NAMES, DataConfig, DomainSpec, domain_specs
from trainers.config.engines import (
    DTYPE_NAMES,
    TINY_VLM_NAMES,
    ModelConfig,
    RolloutConfig,
    RolloutEngineConfig,
    TrainConfig,
    parse_length_dist,
    server_addresses,
)
from trainers.config.fields import check_fields, setting
from trainers.config.loop import AsyncConfig, CheckpointConfig, EvalConfig, LoggingConfig, TailBatchingConfig
from trainers.config.pipelines import (
    DISTILL_MODES,
    OFFLINE_LOSSES,
    PREFERENCE_LOSSES,
    REFERENCE_LOSSES,
    TEACHER_PLACEMENTS,
    DistillSettings,
    OfflineAlgorithmConfig,
    OfflineDataConfig,
)
from trainers.config.placement import PlacementConfig, RayConfig
from trainers.config.rewards import RewardConfig
from trainers.config.runs import (
    AgenticConfig,
    Config,
    DistillConfig,
    OfflineConfig,
    validate,
    validate_agentic,
    validate_async,
    validate_distill,
    validate_offline,
    validate_run,
)

__all__ = [
    "AGENTIC_MODES",
    "ALIASES",
    "CRITIC_KEYS",
    "critic_advantages",
    "critic_ensemble",
    "DISTILL_MODES",
    "DOMAIN_KEYS",
    "DTYPE_NAMES",
    "FLAGS",
    "OFFLINE_LOSSES",
    "PREFERENCE_LOSSES",
    "REFERENCE_LOSSES",
    "RLVR_ONLY_ALGORITHM",
    "ROLLOUT_ENGINES",
    "TASK_NAMES",
    "TEACHER_PLACEMENTS",
    "TINY_VLM_NAMES",
    "TRAIN_ENGINES",
    "AgenticConfig",
    "AgenticEvalConfig",
    "AgenticRolloutConfig",
    "AlgorithmConfig",
    "AsyncConfig",
    "CheckpointConfig",
    "Config",
    "CorrectionConfig",
    "CriticConfig",
    "DataConfig",
    "DistillConfig",
    "DistillSettings",
    "DomainSpec",
    "EngineTable",
    "EnvConfig",
    "EvalConfig",
    "FilterConfig",
    "KLConfig",
    "LoggingConfig",
    "ModelConfig",
    "OfflineAlgorithmConfig",
    "OfflineConfig",
    "OfflineDataConfig",
    "PlacementConfig",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "RolloutEngineSpec",
    "RolloutEngineConfig",
    "TailBatchingConfig",
    "TrainConfig",
    "TrainEngineSpec",
    "WarmupConfig",
    "apply_dict",
    "apply_overrides",
    "check_fields",
    "check_registry_kwargs",
    "config_to_dict",
    "critic_needed",
    "domain_specs",
    "help_text",
    "load_config",
    "parse_args",
    "parse_length_dist",
    "save_config",
    "server_addresses",
    "set_value",
    "setting",
    "validate",
    "validate_agentic",
    "validate_async",
    "validate_distill",
    "validate_offline",
    "validate_run",
]

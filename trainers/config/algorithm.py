"""The algorithm's sections: ``algorithm`` (registry-named primitives and their keyword arguments,
KL, the mismatch correction), ``critic`` and ``filter``, with their rules and cross-field checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rollkit import keys as K
from rollkit.registry import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from trainers.config.capabilities import TRAIN_ENGINES, OrEmpty
from trainers.config.engines import check_model_path
from trainers.config.fields import setting

__all__ = [
    "CRITIC_KEYS",
    "critic_advantages",
    "critic_ensemble",
    "RLVR_ONLY_ALGORITHM",
    "AlgorithmConfig",
    "CorrectionConfig",
    "CriticConfig",
    "FilterConfig",
    "KLConfig",
    "check_registry_kwargs",
    "critic_needed",
]


@dataclass
class KLConfig:
    """KL to the frozen initial policy: ``coef == 0`` disables it (no reference model)."""

    coef: float = setting(0.0, ge=0)
    estimator: str = setting("k3", registry=KL_ESTIMATORS)  # a name of rollkit.registry.KL_ESTIMATORS
    mode: Literal["loss", "reward"] = (
        "loss"  # "loss": a regularizer term; "reward": a per-sequence reward penalty
    )
    # > 0: the adaptive KL controller of Ziegler et al. 2019 (rollkit.losses.kl.AdaptiveKLController;
    # ROLL target_kl, verl algorithm.kl_ctrl.type=adaptive + kl_ctrl.target_kl): after each step
    # coef <- coef * (1 + clip(kl / target - 1, -0.2, 0.2) * batch_size / horizon), kl the measured
    # token-mean KL (kl/rollout). Needs mode=reward and coef > 0 (as in ROLL and verl). 0: fixed coef
    target: float = setting(0.0, ge=0)
    horizon: float = setting(
        10000.0, gt=0
    )  # the controller's horizon in samples (ROLL kl_horizon, verl kl_ctrl.horizon)


@dataclass
class CorrectionConfig:
    """``algorithm.correction``: the training-inference mismatch correction of
    :mod:`rollkit.correction` (docs/correction.md), the same for the sync, async and agentic
    loops. Three policies: behaviour (the rollout engine's log-probs), old / proximal (the
    trainer's recomputation before the update) and current."""

    # recompute the old log-probs on the trainer before the update (verl's default), so the PPO
    # ratio never mixes in the engine's numerics; the engine's log-probs become the behaviour
    # ones. Implied by level != "off". (Asynchronous runs: asynchronous.recompute_logprobs.)
    recompute_old: bool = False
    # "off", "token", "sequence", "geometric" or "segment" (agentic: per turn)
    level: Literal["off", "token", "sequence", "geometric", "segment"] = "off"
    truncate: float = setting(2.0, ge=0)  # cap C of the weight pi_old / mu (TIS); 0: no truncation
    mask_low: float = setting(0.0, ge=0)  # rejection: drop tokens (rows) whose weight is below this; 0: off
    mask_high: float = setting(0.0, ge=0)  # ... or above this; 0: off
    seq_k3_max: float = setting(0.0, ge=0)  # rejection of rows whose mean K3 divergence exceeds this; 0: off
    reject: Literal["token", "sequence"] = (
        "token"  # level=token: "token" drops the token, "sequence" the whole row
    )
    metrics: bool = True  # mismatch/* every step (behaviour vs the trainer's log-probs)


@dataclass
class AlgorithmConfig:
    """The rollkit primitives, chosen by registry name, and their keyword arguments (``*_kwargs``,
    checked against the registered function's signature at parse time: :func:`check_registry_kwargs`)."""

    advantage: str = "grpo"  # a name of ADVANTAGE_ESTIMATORS, or asyppo (checked by check_algorithm)
    advantage_kwargs: dict = field(default_factory=dict)
    policy_loss: str = setting("ppo", registry=POLICY_LOSSES)
    policy_loss_kwargs: dict = field(default_factory=dict)
    aggregation: str = setting("token-mean", registry=AGGREGATIONS)
    entropy_coef: float = setting(0.0, ge=0)
    reward_normalizer: bool = False  # running reward standardisation before the advantages
    # standardise the rewards over the batch, (r - mean) / (std + eps), before the advantages
    # (REINFORCE++ / ROLL's batch reward norm; rollkit.rewards.normalize_rewards). With
    # data.domains both normalisations (and their statistics) are per domain
    batch_reward_norm: bool = False
    # > 0: clamp each sequence reward to [-reward_clip, reward_clip] after the KL penalty and the
    # normaliser, before the advantages (ROLL reward_clip; rollkit.rewards.clip_rewards). 0: off
    reward_clip: float = setting(0.0, ge=0)
    # whiten the token advantages over the batch's response tokens, (A - mean) / sqrt(var + eps)
    # (ROLL whiten_advantages; rollkit.ops.masked_whiten), before advantage_clip
    whiten_advantages: bool = False
    # > 0: clamp each advantage to [-advantage_clip, advantage_clip] (ROLL advantage_clip;
    # rollkit.rewards.clip_advantages). 0: off
    advantage_clip: float = setting(0.0, ge=0)
    kl: KLConfig = field(default_factory=KLConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)


#: the batch keys of a learned critic's values: an estimator that reads one of them trains with a
#: critic (``values``: one, ``gae``; ``ensemble_values``: an ensemble, AsyPPO's ``asyppo``)
CRITIC_KEYS = (K.VALUES, K.ENSEMBLE_VALUES)


def critic_advantages() -> tuple[str, ...]:
    """The registered estimators that train with a learned critic (they read :data:`CRITIC_KEYS`)."""
    return tuple(n for n in ADVANTAGE_ESTIMATORS.names() if _critic_key(n) is not None)


def _critic_key(name: Any) -> str | None:
    """The critic key (:data:`CRITIC_KEYS`) that estimator ``name`` reads; None: none, or not registered."""
    if not isinstance(name, str) or name not in ADVANTAGE_ESTIMATORS:
        return None
    reads = set(ADVANTAGE_ESTIMATORS.entry(name).in_keys.values())
    return next((k for k in CRITIC_KEYS if k in reads), None)


@dataclass
class CriticConfig:
    """The learned critic of ``algorithm.advantage=gae`` (PPO) or ``asyppo`` (AsyPPO's
    mini-critics): a value model, its optimizer and its update (docs/ppo.md)."""

    # the value model: "" = the policy's checkpoint (model.path, or the tiny model) with a scalar
    # head on the final hidden states; else a Hugging Face checkpoint directory (a causal LM, or a
    # critic saved by a previous run: AutoModelForTokenClassification with one label)
    model_path: str = ""
    # "" = train.engine; else a name of trainers.config.TRAIN_ENGINES that trains a critic: "torch",
    # "deepspeed" (train.zero_stage) or "fsdp2"
    engine: str = setting("", registry=OrEmpty(TRAIN_ENGINES))
    lr: float = setting(
        1e-5, gt=0
    )  # its own AdamW learning rate (ROLL and verl train the critic faster than the actor)
    weight_decay: float = setting(0.0, ge=0)
    grad_clip: float = setting(1.0, gt=0)
    lr_warmup_steps: int = setting(0, ge=0)  # linear LR warm-up over this many critic optimizer steps
    lr_schedule: Literal["constant", "cosine"] = "constant"  # over train.steps, after the warm-up
    value_clip: float = setting(
        0.5, ge=0
    )  # clip the value update to old +- value_clip (verl cliprange_value); 0: plain MSE
    value_coef: float = setting(
        0.5, gt=0
    )  # the loss coef * max((V - R)^2, (V_clip - R)^2) (rollkit.losses.value_loss)
    # the first warmup_steps RL steps train the critic alone (the policy is not updated; ROLL critic_warmup)
    warmup_steps: int = setting(0, ge=0)
    # AsyPPO: the number of mini-critics (0: 1 for gae, 2 for asyppo, as in the paper); each trains
    # on its own shard of every batch and the values are their mean
    num_critics: int = setting(0, ge=0)
    shard_level: Literal["response", "prompt"] = (
        "response"  # AsyPPO shards: within each prompt (the paper's) or by prompt
    )
    # AsyPPO (rollkit.critics.disagreement_masks): the fraction of the batch's response tokens whose
    # advantage is masked, lowest inter-critic std first (the paper's k), and the fraction left out of
    # the entropy bonus, highest std first (its h; acts when algorithm.entropy_coef > 0)
    advantage_mask_frac: float = setting(0.2, ge=0, le=1)
    entropy_filter_frac: float = setting(0.2, ge=0, le=1)
    ppo_epochs: int = setting(
        0, ge=0
    )  # 0: train.ppo_epochs (the critic's micro-batching is the policy's: train.*)
    # whiten the GAE advantages over the batch's response tokens (verl's GAE always does; ROLL's PPO
    # configs set whiten_advantages), before AsyPPO's mask; algorithm.whiten_advantages is the same for every estimator
    whiten_advantages: bool = True


@dataclass
class FilterConfig:
    """Dynamic sampling: drop prompt groups whose rewards are all equal, and generate again
    (at most ``max_rounds`` generation rounds per step) until the batch is full."""

    zero_variance: bool = False
    max_rounds: int = setting(3, ge=1)
    # drop groups whose mean reward (pass rate) p is outside accuracy_low < p < accuracy_high and
    # generate again, like zero_variance (ROLL difficulty_mask with difficulty_low_threshold /
    # difficulty_high_threshold; rollkit.filters.accuracy_band_filter, inclusive="neither")
    accuracy_band: bool = False
    accuracy_low: float = setting(0.0, ge=0)
    accuracy_high: float = setting(1.0, ge=0)
    # no loss on samples that stopped at the length limit (finish_reason "length"): DAPO overlong
    # filtering (ROLL max_len_mask; rollkit.rewards.mask_truncated). They stay in the batch
    max_len_mask: bool = False


# --------------------------------------------------------------------------- checks across fields

#: what the RLVR loops give the estimator and the policy loss (batch keys)
RLVR_ADVANTAGE_INPUTS = (K.REWARDS, K.GROUP_IDS, K.RESPONSE_MASK, K.RESPONSE_LENGTH)
#: what every RLVR policy loss gets (the learner's ``logprobs`` and the step batch's keys)
RLVR_LOSS_INPUTS = (K.LOGPROBS, K.OLD_LOGPROBS, K.BEHAVIOR_LOGPROBS, K.ADVANTAGES, K.RESPONSE_MASK)


def rlvr_loss_inputs(cfg: Any) -> tuple[str, ...]:
    """The keys an RLVR policy loss can read in run ``cfg``: :data:`RLVR_LOSS_INPUTS`, the step
    batch's own (``rewards``, ``group_ids``, ``prompt_index``) and those its stages add for this
    config (``trainers.engines.step``): ``ref_logprobs`` and ``kl`` with a reference
    (``algorithm.kl.coef > 0``), ``values`` and ``returns`` with a critic (and ``entropy_keep``
    with an ensemble), ``token_keep`` with the correction or the max-length mask. A loss that
    needs another key is refused before any model loads; one that reads a key a stage adds needs
    that key named here."""
    a = cfg.algorithm
    keys = [*RLVR_LOSS_INPUTS, K.REWARDS, K.GROUP_IDS, "prompt_index"]
    if a.kl.coef > 0:
        keys += [K.REF_LOGPROBS, K.KL]
    if critic_needed(cfg):
        keys += [K.VALUES, K.RETURNS] + ([K.ENTROPY_KEEP] if critic_ensemble(cfg) else [])
    if a.correction.level != "off" or getattr(getattr(cfg, "filter", None), "max_len_mask", False):
        keys.append("token_keep")
    return tuple(keys)
#: Policy losses that weight by ``behavior_logprobs`` themselves (a second correction would double it).
SELF_CORRECTING_LOSSES = ("tis", "decoupled-ppo")
#: ``algorithm`` options of the RLVR credit (one reward per sample: its normalisation and clip)
#: that the agentic one (episode, turn and state-group rewards) does not have (field, value, off);
#: the shared update stage's options (whitening, advantage clip, adaptive KL) work in both
RLVR_ONLY_ALGORITHM = (
    ("algorithm.reward_clip", lambda a: a.reward_clip, 0.0),
    ("algorithm.reward_normalizer", lambda a: a.reward_normalizer, False),
    ("algorithm.batch_reward_norm", lambda a: a.batch_reward_norm, False),
)


def critic_needed(cfg: Any) -> bool:
    """Whether ``cfg.algorithm.advantage`` trains with a learned critic: its registered
    estimator reads a critic's values (:data:`CRITIC_KEYS`). The one place this is decided:
    :func:`~trainers.roles.build_roles` builds the critic role from it, and the update stage
    takes GAE over the critic where the roles have one."""
    return _critic_key(cfg.algorithm.advantage) is not None


def critic_ensemble(cfg: Any) -> bool:
    """Whether ``cfg.algorithm.advantage`` reads an ensemble of critics (``ensemble_values``:
    AsyPPO's mini-critics, two by default)."""
    return _critic_key(cfg.algorithm.advantage) == K.ENSEMBLE_VALUES


def check_registry_kwargs(cfg: Any) -> None:
    """Check the keyword arguments of every registry-named choice of ``cfg`` against the
    registered function's signature (:func:`rollkit.registry.check_kwargs`), the way the
    trainers pass them: ``algorithm.policy_loss_kwargs`` to ``POLICY_LOSSES[algorithm.policy_loss]``,
    ``algorithm.advantage_kwargs`` to ``ADVANTAGE_ESTIMATORS[algorithm.advantage]`` (with a
    critic, ``gae`` / ``asyppo``, they go to the critic's GAE: :func:`check_critic` checks them).
    (``env.kwargs`` is not checked here: the environments are a layer above the config, and
    ``make_env`` names a bad key when the trainer builds them.) Tensor inputs that the trainer
    reads from the batch are refused as keys; a function with ``**kwargs`` takes any other.
    :func:`~trainers.config.load_config` calls it; a bad key raises a one-line ``ValueError``
    naming the field, the key and the accepted keys. A name that is not registered is left to
    :func:`~trainers.config.validate` (which ``load_config`` runs next: register your own
    primitives before loading a config), as are ``gem:`` ids and ``module:attr`` environments.

    >>> from trainers.config import Config
    >>> cfg = Config()
    >>> cfg.algorithm.policy_loss_kwargs = {"clip_hihg": 0.28}
    >>> check_registry_kwargs(cfg)
    Traceback (most recent call last):
    ...
    ValueError: algorithm.policy_loss_kwargs: ppo does not take 'clip_hihg' (unknown key for the policy loss ppo_clip; accepted: clip_high, clip_low, dual_clip, log_ratio_clamp)
    """
    a = getattr(cfg, "algorithm", None)
    if isinstance(a, AlgorithmConfig):
        rows = [("algorithm.policy_loss_kwargs", POLICY_LOSSES, a.policy_loss, a.policy_loss_kwargs)]
        if not critic_needed(cfg):
            rows.append(("algorithm.advantage_kwargs", ADVANTAGE_ESTIMATORS, a.advantage, a.advantage_kwargs))
        for name, reg, value, kwargs in rows:
            if isinstance(value, str) and value in reg:
                reg.check_kwargs(value, kwargs, name)


def check_algorithm(a: AlgorithmConfig) -> None:
    """``algorithm.advantage`` (a registered estimator) and ``algorithm.correction`` (no double
    correction)."""
    if a.advantage not in ADVANTAGE_ESTIMATORS:
        names = ", ".join(sorted(ADVANTAGE_ESTIMATORS.names()))
        raise ValueError(
            f"algorithm.advantage: unknown {ADVANTAGE_ESTIMATORS.kind} {a.advantage!r}; known: {names}"
        )
    c = a.correction
    if c.mask_high and c.mask_low > c.mask_high:
        raise ValueError(
            f"algorithm.correction.mask_low ({c.mask_low:g}) must be <= mask_high ({c.mask_high:g})"
        )
    if c.level != "off" and POLICY_LOSSES.entry(a.policy_loss).name in SELF_CORRECTING_LOSSES:
        raise ValueError(
            f"algorithm.correction.level={c.level}: algorithm.policy_loss={a.policy_loss!r} already weights "
            "by the behaviour log-probs; use a loss without its own correction (e.g. ppo) or level=off"
        )


def critic_engine(cfg: Any) -> str | None:
    """The engine the critic trains on (``critic.engine``, else ``train.engine``), or None
    without a critic."""
    return (cfg.critic.engine or cfg.train.engine) if critic_needed(cfg) else None


def check_critic(c: Any) -> None:
    """``critic.*`` against the advantage: no critic settings without a critic advantage, the
    critic's GAE keyword arguments, AsyPPO's mini-critics, the warm-up within the run."""
    k = c.critic
    if k.model_path:
        check_model_path(k.model_path, "critic.model_path")
    if not critic_needed(c):
        if k.warmup_steps or k.num_critics:
            raise ValueError(
                f"critic.warmup_steps / critic.num_critics: algorithm.advantage={c.algorithm.advantage!r} trains "
                f"no critic; use one of {', '.join(critic_advantages())}"
            )
        return
    extra = sorted(set(c.algorithm.advantage_kwargs) - {"gamma", "lam"})
    if extra:
        raise ValueError(
            f"algorithm.advantage_kwargs: {extra} not taken by the critic's GAE (it takes gamma and lam; AsyPPO's "
            "fractions are critic.advantage_mask_frac / entropy_filter_frac)"
        )
    for key in ("gamma", "lam"):
        v = c.algorithm.advantage_kwargs.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ValueError(f"algorithm.advantage_kwargs.{key} must be a number in [0, 1], got {v!r}")
    if not critic_ensemble(c) and k.num_critics > 1:
        raise ValueError(
            f"critic.num_critics={k.num_critics}: several mini-critics are AsyPPO's; set algorithm.advantage=asyppo "
            "(or critic.num_critics=1)"
        )
    if k.warmup_steps >= c.train.steps > 0:
        raise ValueError(
            f"critic.warmup_steps ({k.warmup_steps}) must be < train.steps ({c.train.steps}): the policy would "
            "never be trained"
        )


def _check_inputs(name: str, entry: Any, available: tuple[str, ...], where: str) -> None:
    need = [k for arg, k in entry.in_keys.items() if entry.tensor_args().get(arg) and k not in available]
    if need:
        raise ValueError(
            f"{name}={entry.name!r} needs {need}, which {where} does not provide (it has {list(available)})"
        )


def check_rlvr_algorithm(c: Any) -> None:
    """The estimator and loss get the tensors the RLVR trainer gives them; group estimators
    get groups; ROLL's reward / advantage / filter / adaptive-KL options (docs/trainer.md)."""
    a = c.algorithm
    _check_inputs(
        "algorithm.policy_loss", POLICY_LOSSES.entry(a.policy_loss), rlvr_loss_inputs(c), "the RLVR trainer"
    )
    if not critic_needed(c):  # the critic path builds token rewards and values itself
        adv = ADVANTAGE_ESTIMATORS.entry(a.advantage)
        _check_inputs("algorithm.advantage", adv, RLVR_ADVANTAGE_INPUTS, "the RLVR trainer")
        if c.rollout.n == 1 and "group_ids" in adv.in_keys:
            raise ValueError(
                f"rollout.n=1: algorithm.advantage={a.advantage!r} compares the n samples of each prompt, so with "
                "one sample every advantage is 0 and nothing is learned; set rollout.n >= 2 or use a batch-level "
                "estimator (reinforce++, rebn)"
            )
    f, rw, kl = c.filter, c.reward, a.kl
    if not f.accuracy_low < f.accuracy_high <= 1:
        raise ValueError(
            f"filter.accuracy_low / accuracy_high: need 0 <= accuracy_low < accuracy_high <= 1 (groups with "
            f"low < mean reward < high are kept), got {f.accuracy_low!r}, {f.accuracy_high!r}"
        )
    if f.accuracy_band and c.tail_batching.enabled:
        raise ValueError(
            "filter.accuracy_band: not wired in tail batching (its policy filters with filter.zero_variance "
            "only); set tail_batching.enabled=false or filter.accuracy_band=false"
        )
    if rw.overlong_buffer > c.rollout.max_tokens:
        raise ValueError(
            f"reward.overlong_buffer ({rw.overlong_buffer}) must be <= rollout.max_tokens ({c.rollout.max_tokens})"
        )
    if kl.target:
        if kl.mode != "reward" or not kl.coef:
            raise ValueError(
                f"algorithm.kl.target: the adaptive KL controller drives the KL reward penalty (as in ROLL and "
                f"verl): set algorithm.kl.mode=reward and algorithm.kl.coef > 0 (got mode={kl.mode}, "
                f"coef={kl.coef:g})"
            )
        batch = c.rollout.prompts_per_step * c.rollout.n
        if batch > 5 * kl.horizon:
            raise ValueError(
                f"algorithm.kl.horizon ({kl.horizon:g}) must be >= batch size / 5 = {batch / 5:g} (a larger "
                "update could make the KL coefficient negative)"
            )

"""The loops' own sections: ``eval``, ``checkpoint``, ``logging``, ``asynchronous`` and
``tail_batching``, with the checks that relate their fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainers.config.fields import setting

__all__ = ["AsyncConfig", "CheckpointConfig", "EvalConfig", "LoggingConfig", "TailBatchingConfig"]


@dataclass
class TailBatchingConfig:
    """RollPacker tail batching in the synchronous trainer (:class:`rollkit.scheduling.
    TailBatchingPolicy`): short rounds over-provision prompts and responses, prompts that
    were still running when the quota filled wait for a long round. P0 is
    ``rollout.prompts_per_step``, R0 is ``rollout.n``; ``filter.zero_variance`` drops, rather
    than queues, deferred prompts whose rewards all agree. Needs a request-level rollout
    engine in the trainer's process (hf or vllm, not ``ray.enabled``); docs/scheduling.md."""

    enabled: bool = False
    eta_prompts: float = setting(
        1.25, ge=1
    )  # a short round launches ceil(eta_prompts * prompts_per_step) prompts
    eta_responses: float = setting(1.25, ge=1)  # each asking for ceil(eta_responses * n) responses


@dataclass
class AsyncConfig:
    """Asynchronous training (ROLL Flash): rollout keeps generating into a
    :class:`rollkit.buffer.SampleBuffer` while the trainer trains (:mod:`trainers.loops.asynchronous`)."""

    enabled: bool = False
    ratio: float = setting(
        1.0, ge=0
    )  # async ratio alpha: samples started by policies at most ceil(alpha) versions old
    extra_prompts: int = setting(
        0, ge=0
    )  # over-provisioning: prompts running beyond ceil((1 + alpha) * prompts_per_step)
    in_flight: Literal["keep", "abort"] = (
        "keep"  # at a weight update: "keep" partial samples and resubmit them, or "abort"
    )
    replicate: bool = True  # prompt replication: one request per sample (else one request per prompt)
    num_engines: int = setting(
        1, ge=1
    )  # rollout engines the queue scheduler dispatches to (least loaded first)
    # recompute the batch's log-probs under the trainer's weights before the update (the
    # proximal policy); the rollout's become behavior_logprobs (decoupled PPO / TIS / CISPO / TOPR)
    recompute_logprobs: bool = True
    # a reproducible schedule: the producer runs in the trainer's thread until a batch is ready,
    # then exactly overlap_steps scheduler steps while the trainer trains (scores gathered every
    # step), so a run, and a resumed run, are bit-identical for the same seeds (one process)
    deterministic: bool = False
    overlap_steps: int = setting(4, ge=0)


@dataclass
class EvalConfig:
    """Greedy held-out accuracy before training, every ``every`` steps (0: never) and after."""

    every: int = setting(10, ge=0)
    max_tokens: int = setting(12, ge=1)
    before: bool = True
    # > 1: also sample n responses per held-out prompt at `temperature` and report pass@k and
    # mean@k (Chen et al. 2021's unbiased estimator) for each k of `k`, per domain. 1: greedy only
    n: int = setting(1, ge=1)
    temperature: float = setting(1.0, gt=0)
    k: list = field(default_factory=list)  # the k of pass@k / mean@k ([]: 1 and n)


@dataclass
class CheckpointConfig:
    """``dir`` empty: no checkpoints. ``resume``: a checkpoint directory, or ``"auto"`` (the
    latest under ``dir``). ``keep > 0``: after each save only the newest ``keep`` ``step_<k>``
    directories under ``dir`` stay (never the one just written, never the one ``resume`` names)."""

    dir: str = ""
    every: int = setting(0, ge=0)
    resume: str = ""
    keep: int = setting(0, ge=0)  # 0: keep every checkpoint


@dataclass
class LoggingConfig:
    """Metrics go to ``<dir>/metrics.jsonl`` always, TensorBoard and a PNG plot when the
    packages are installed."""

    dir: str = "runs/rlvr"
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True
    save_model: bool = True  # the trained policy as a HF model directory: <dir>/model (and per checkpoint)
    wandb: bool = False  # Weights & Biases (offline unless logging.online): <dir>/wandb
    swanlab: bool = False  # SwanLab (offline unless logging.online)
    online: bool = False  # let W&B / SwanLab sync to their servers
    project: str = "rollkit"  # the W&B / SwanLab project
    run_name: str = ""  # "" : the trackers' own naming


# --------------------------------------------------------------------------- checks across fields


def check_eval(e: EvalConfig) -> None:
    """``eval.k``: each k in [1, eval.n], and pass@k needs n > 1."""
    for k in e.k:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e.n:
            raise ValueError(f"eval.k: every k must be an int in [1, eval.n={e.n}], got {k!r}")
    if e.k and e.n == 1:
        raise ValueError("eval.k: pass@k needs eval.n > 1 samples per prompt")


def check_checkpoint(ck: CheckpointConfig) -> None:
    """``checkpoint.resume``: an existing checkpoint, or ``auto`` with ``checkpoint.dir``."""
    if ck.resume and ck.resume != "auto" and not Path(ck.resume).exists():
        raise ValueError(f"checkpoint.resume: no such checkpoint: {ck.resume}")
    if ck.resume == "auto" and not ck.dir:
        raise ValueError(
            "checkpoint.resume=auto: set checkpoint.dir (where to look for the latest checkpoint)"
        )


def check_async(cfg: Any) -> None:
    """The ``asynchronous`` section against placement and Ray (:class:`trainers.loops.AsyncTrainer`)."""
    ac = cfg.asynchronous
    if cfg.placement.offload_train:
        raise ValueError(
            "placement.offload_train: the asynchronous trainer trains while the rollout generates, so the "
            "training state cannot leave the device between phases; set placement.offload_train=false"
        )
    if cfg.ray.enabled and cfg.placement.mode != "disaggregated":
        raise ValueError(
            f"placement.mode={cfg.placement.mode!r}: the asynchronous trainer generates while it "
            "trains, so on Ray the rollout and train actors need resources of their own: set "
            "placement.mode=disaggregated"
        )
    if cfg.ray.enabled and ac.num_engines not in (1, cfg.placement.rollout_workers):
        raise ValueError(
            f"asynchronous.num_engines={ac.num_engines}: on Ray the engines are the "
            f"placement.rollout_workers={cfg.placement.rollout_workers} rollout actors; set that instead"
        )
    if ac.deterministic and cfg.ray.enabled:
        raise ValueError(
            "asynchronous.deterministic: the reproducible schedule runs the engines in this process; "
            "Ray actors answer in their own time: set ray.enabled=false or asynchronous.deterministic=false"
        )

"""The ``ray`` and ``placement`` sections: Ray actors and the device mapping of the roles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainers.config.fields import setting

__all__ = ["PlacementConfig", "RayConfig"]


@dataclass
class RayConfig:
    """Run the roles as Ray actors (docs/distributed.md). ``address``: ``""`` joins
    ``RAY_ADDRESS`` where it is set (``ray job submit`` sets it), else starts a new local Ray
    (``ray.init(address="local")``: the address file of an earlier ``ray start`` is ignored);
    ``"auto"`` or ``"host:port"`` joins a running cluster."""

    enabled: bool = False
    address: str = ""
    num_cpus: int | None = None  # local ray.init only (None: every core)
    object_store_mb: int = 0  # local ray.init only (0: Ray's default)
    torch_threads: int = 0  # torch threads per actor (0: the actor's CPUs, at least 1)
    # deadline of every call to an actor (a generation request, an update, a weight load): past it
    # the run stops with an error naming the actor (hung, e.g. SIGSTOP, or overloaded)
    timeout_s: float = setting(1800.0, gt=0)
    # deadline of starting the actors (processes, constructors, model loads, the process group):
    # separate, so that a short timeout_s that catches a hung step does not fail a slow start
    startup_timeout_s: float = setting(600.0, gt=0)


@dataclass
class PlacementConfig:
    """The device mapping of the Ray roles. ``colocated``: rollout, train and reference actors
    share the bundles of one placement group (the rollout sleeps while training when
    ``offload``); ``disaggregated``: every role has bundles of its own. ``strategy``: the
    placement group strategy (``""``: PACK when colocated, SPREAD when disaggregated)."""

    mode: Literal["colocated", "disaggregated"] = "colocated"  # "colocated" or "disaggregated"
    strategy: Literal["", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = ""  # "": by mode
    rollout_workers: int = setting(1, ge=1)
    train_workers: int = setting(1, ge=1)  # data-parallel ranks (gloo on CPU, NCCL on GPUs)
    cpus_per_worker: float = setting(1.0, gt=0)  # CPUs per bundle (colocated: shared by the bundle's actors)
    gpus_per_worker: float | None = None  # GPUs per bundle (None: 1 if the cluster has GPUs, else 0)
    reference: Literal["train", "separate"] = (
        "train"  # "train": in train rank 0's bundle; "separate": a bundle of its own
    )
    # the critic actor (algorithm.advantage gae / asyppo): "train" or "separate", as reference
    critic: Literal["train", "separate"] = "train"
    offload: bool = True  # colocated: rollout.sleep() while training, wake() + update after
    sleep_level: Literal[1, 2] = 1  # 1: offload weights; 2: discard them (the update reloads them)
    # colocated (in process: always): the train engine's weights, gradients and optimizer state
    # move to the host while the rollout generates and back for the update (trainers.engines.offload)
    offload_train: bool = False
    rollout_resources: dict = field(default_factory=dict)  # custom node resources per rollout bundle
    train_resources: dict = field(default_factory=dict)  # custom node resources per train bundle

"""Device mapping of the Ray roles: placement groups, bundles and the actor options that use them.

A *bundle* is a slice of one node (``{"CPU": c, "GPU": g, **custom}``); a placement group
reserves its bundles atomically, on nodes chosen by its strategy (``PACK``: as few nodes as
possible, ``SPREAD``: as many as possible, ``STRICT_PACK``: one node, ``STRICT_SPREAD``: one
bundle per node). An actor scheduled with ``PlacementGroupSchedulingStrategy(pg, bundle)``
runs inside that bundle and takes its resources from it.

Two mappings (``placement.mode``):

* **colocated**: one group of ``max(rollout_workers, train_workers)`` bundles. Train rank ``r``
  and rollout actor ``r`` share bundle ``r`` (the reference, with ``reference="train"``, shares
  bundle 0, and so does the critic); each actor asks for ``1 / k`` of its bundle's CPUs and GPUs (``k`` actors in the
  bundle), so the roles time-share the same devices: the trainer puts the rollout to sleep
  while it trains and wakes it for the weight update (``placement.offload``).
* **disaggregated**: one group whose bundles are ``rollout_workers`` rollout bundles, then
  ``train_workers`` train bundles (then a reference bundle with ``reference="separate"``, and a
  critic bundle with ``critic="separate"``; with ``"train"`` they share train rank 0's bundle);
  every actor has a whole bundle. ``strategy="STRICT_SPREAD"`` puts every bundle on a
  different node; ``rollout_resources`` / ``train_resources`` add custom node resources to a
  role's bundles (``ray start --resources='{"rollout_node": 1}'``) to pin roles to nodes.

On a CPU machine the bundles are CPUs only; ``gpus_per_worker=None`` asks for one GPU per
bundle when the cluster has GPUs.

A distillation teacher on Ray gets a placement group of its own (:func:`plan_teacher`: one
bundle, one actor), so it can sit beside roles that run in process or on Ray alike.

>>> plan = plan_bundles("colocated", rollout_workers=2, train_workers=2, cpus=1.0, gpus=0.0)
>>> plan.bundles, [(a.role, a.bundle, a.num_cpus) for a in plan.actors][:3]
([{'CPU': 1.0}, {'CPU': 1.0}], [('train', 0, 0.5), ('train', 1, 0.5), ('rollout', 0, 0.5)])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainers.deps import require

__all__ = ["ActorSlot", "BundlePlan", "Placement", "plan_bundles", "plan_teacher"]

MODES = ("colocated", "disaggregated")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
ROLES = ("train", "rollout", "reference", "critic", "teacher")


@dataclass(frozen=True)
class ActorSlot:
    """Where one actor goes: its role, its index in the role, its bundle and its resources."""

    role: str
    index: int
    bundle: int
    num_cpus: float
    num_gpus: float


@dataclass
class BundlePlan:
    """The bundles of the placement group, its strategy and one :class:`ActorSlot` per actor."""

    bundles: list[dict[str, float]]
    strategy: str
    actors: list[ActorSlot] = field(default_factory=list)

    def slots(self, role: str) -> list[ActorSlot]:
        return [a for a in self.actors if a.role == role]


def _share(total: float, k: int) -> float:
    """``total / k``, rounded down to a whole number when above 1 (Ray requires whole numbers
    above 1) and never above what the bundle holds."""
    x = total / k
    if x > 1:
        x = float(math.floor(x))
    return x


def plan_bundles(
    mode: str,
    *,
    rollout_workers: int,
    train_workers: int,
    cpus: float,
    gpus: float,
    reference: str | None = None,
    critic: str | None = None,
    strategy: str = "",
    rollout_resources: dict[str, float] | None = None,
    train_resources: dict[str, float] | None = None,
) -> BundlePlan:
    """The placement plan of the module docstring (pure: no Ray call).

    ``reference``: ``None`` (no reference actor), ``"train"`` (in train rank 0's bundle) or
    ``"separate"`` (a bundle of its own when disaggregated; in bundle 0 when colocated).
    ``critic``: the critic actor (``algorithm.advantage`` gae / asyppo), placed the same way.
    """
    if mode not in MODES:
        raise ValueError(f"placement.mode must be one of {MODES}, got {mode!r}")
    for name, v in (
        ("placement.rollout_workers", rollout_workers),
        ("placement.train_workers", train_workers),
    ):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not cpus > 0:
        raise ValueError(f"placement.cpus_per_worker must be > 0, got {cpus}")
    if gpus < 0:
        raise ValueError(f"placement.gpus_per_worker must be >= 0, got {gpus}")
    for name, v in (("placement.reference", reference), ("placement.critic", critic)):
        if v not in (None, "train", "separate"):
            raise ValueError(f"{name} must be 'train' or 'separate', got {v!r}")
    strategy = strategy or ("PACK" if mode == "colocated" else "SPREAD")
    if strategy not in STRATEGIES:
        raise ValueError(f"placement.strategy must be one of {STRATEGIES} or '', got {strategy!r}")

    def bundle(extra: dict[str, float] | None) -> dict[str, float]:
        b = {"CPU": float(cpus)}
        if gpus:
            b["GPU"] = float(gpus)
        b.update({k: float(v) for k, v in (extra or {}).items()})
        return b

    slots: list[tuple[str, int, int]] = []  # (role, index, bundle)
    if mode == "colocated":
        if rollout_resources or train_resources:
            raise ValueError("placement.rollout_resources / train_resources: only for mode=disaggregated")
        n = max(rollout_workers, train_workers)
        bundles = [bundle(None) for _ in range(n)]
        slots += [("train", r, r) for r in range(train_workers)]
        slots += [("rollout", i, i) for i in range(rollout_workers)]
        if reference is not None:
            slots.append(("reference", 0, 0))
        if critic is not None:
            slots.append(("critic", 0, 0))
    else:
        bundles = [bundle(rollout_resources) for _ in range(rollout_workers)]
        bundles += [bundle(train_resources) for _ in range(train_workers)]
        slots += [("rollout", i, i) for i in range(rollout_workers)]
        slots += [("train", r, rollout_workers + r) for r in range(train_workers)]
        if reference == "separate":
            bundles.append(bundle(train_resources))
            slots.append(("reference", 0, len(bundles) - 1))
        elif reference == "train":
            slots.append(("reference", 0, rollout_workers))
        if critic == "separate":
            bundles.append(bundle(train_resources))
            slots.append(("critic", 0, len(bundles) - 1))
        elif critic == "train":
            slots.append(("critic", 0, rollout_workers))
    occupants = [sum(1 for _, _, b in slots if b == i) for i in range(len(bundles))]
    actors = [
        ActorSlot(role, idx, b, _share(cpus, occupants[b]), _share(gpus, occupants[b]) if gpus else 0.0)
        for role, idx, b in slots
    ]
    return BundlePlan(bundles, strategy, actors)


def plan_teacher(
    *, cpus: float, gpus: float, resources: dict[str, float] | None = None, strategy: str = "PACK"
) -> BundlePlan:
    """One bundle ``{"CPU": cpus, "GPU": gpus, **resources}`` holding the teacher actor, which
    takes the whole bundle (pure: no Ray call).

    >>> plan = plan_teacher(cpus=2.0, gpus=0.0)
    >>> plan.bundles, plan.slots("teacher")
    ([{'CPU': 2.0}], [ActorSlot(role='teacher', index=0, bundle=0, num_cpus=2.0, num_gpus=0.0)])
    """
    if not cpus > 0:
        raise ValueError(f"distill.teacher_cpus must be > 0, got {cpus}")
    if gpus < 0:
        raise ValueError(f"distill.teacher_gpus must be >= 0, got {gpus}")
    if strategy not in STRATEGIES:
        raise ValueError(f"placement.strategy must be one of {STRATEGIES}, got {strategy!r}")
    bundle = {"CPU": float(cpus)}
    if gpus:
        bundle["GPU"] = float(gpus)
    bundle.update({k: float(v) for k, v in (resources or {}).items()})
    slot = ActorSlot("teacher", 0, 0, _share(float(cpus), 1), _share(float(gpus), 1) if gpus else 0.0)
    return BundlePlan([bundle], strategy, [slot])


class Placement:
    """A reserved placement group for a :class:`BundlePlan`; :meth:`options` gives an actor's
    ``.options(...)`` (resources and ``PlacementGroupSchedulingStrategy``).

    Args:
        plan: the bundles and actor slots.
        timeout_s: how long to wait for the cluster to reserve the bundles; past it a
            ``RuntimeError`` says which resources were asked for and what the cluster has.
    """

    def __init__(self, plan: BundlePlan, *, timeout_s: float = 120.0) -> None:
        ray = require("ray")
        self.plan = plan
        self.pg = require("ray.util.placement_group").placement_group(plan.bundles, strategy=plan.strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(
                f"placement: the cluster could not reserve bundles {plan.bundles} with strategy "
                f"{plan.strategy} in {timeout_s:.0f}s (cluster resources: {ray.cluster_resources()}); "
                "lower placement.cpus_per_worker / gpus_per_worker or the worker counts, or add nodes"
            )

    def options(self, slot: ActorSlot) -> dict[str, Any]:
        PlacementGroupSchedulingStrategy = require(
            "ray.util.scheduling_strategies"
        ).PlacementGroupSchedulingStrategy
        return {
            "num_cpus": slot.num_cpus,
            "num_gpus": slot.num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg,
                placement_group_bundle_index=slot.bundle,
                placement_group_capture_child_tasks=True,
            ),
        }

    def remove(self) -> None:
        require("ray").util.remove_placement_group(self.pg)

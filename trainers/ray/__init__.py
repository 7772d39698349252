"""Ray roles for the reference trainers: placement groups (:mod:`trainers.ray.placement`) and
the rollout / train / reference actors with the proxies the trainer talks to
(:mod:`trainers.ray.workers`). See docs/distributed.md. ``ray`` is imported when used."""

from trainers.ray.placement import ActorSlot, BundlePlan, Placement, plan_bundles
from trainers.ray.workers import (
    ActorCallError,
    RayReference,
    RayRequestEngine,
    RayRoles,
    RayRolloutGroup,
    RayTrainGroup,
    ReferenceWorker,
    RolloutWorker,
    TrainWorker,
    build_ray_roles,
    init_ray,
)

__all__ = [
    "ActorCallError",
    "ActorSlot",
    "BundlePlan",
    "Placement",
    "RayReference",
    "RayRequestEngine",
    "RayRoles",
    "RayRolloutGroup",
    "RayTrainGroup",
    "ReferenceWorker",
    "RolloutWorker",
    "TrainWorker",
    "build_ray_roles",
    "init_ray",
    "plan_bundles",
]

"""Ray roles for the reference trainers: placement groups (:mod:`trainers.ray.placement`) and
the rollout / train / reference / critic / teacher actors (:mod:`trainers.ray.workers`) and the
proxies the trainer talks to (:mod:`trainers.ray.handles`). See docs/distributed.md. ``ray`` is imported when used."""

from trainers.ray.handles import (
    RayCritic,
    RayReference,
    RayRequestEngine,
    RayRoles,
    RayRolloutGroup,
    RayTeacher,
    RayTrainGroup,
    build_ray_roles,
    build_ray_teacher,
)
from trainers.ray.placement import ActorSlot, BundlePlan, Placement, plan_bundles, plan_teacher
from trainers.ray.workers import (
    ActorCallError,
    CriticWorker,
    ReferenceWorker,
    RolloutWorker,
    TeacherWorker,
    TrainWorker,
    batch_topk_logprobs,
    init_ray,
    response_topk_logprobs,
    teacher_engine,
)

__all__ = [
    "ActorCallError",
    "ActorSlot",
    "BundlePlan",
    "CriticWorker",
    "Placement",
    "RayCritic",
    "RayReference",
    "RayRequestEngine",
    "RayRoles",
    "RayRolloutGroup",
    "RayTeacher",
    "RayTrainGroup",
    "ReferenceWorker",
    "RolloutWorker",
    "TeacherWorker",
    "TrainWorker",
    "batch_topk_logprobs",
    "build_ray_roles",
    "build_ray_teacher",
    "init_ray",
    "plan_bundles",
    "plan_teacher",
    "response_topk_logprobs",
    "teacher_engine",
]

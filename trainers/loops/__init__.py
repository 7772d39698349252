"""The training loops, composed from the parts below them: sync, async (ROLL Flash) and agentic.

* :class:`SyncTrainer` (:mod:`trainers.loops.sync`): collect -> advantages -> PPO update -> push weights.
* :class:`AsyncTrainer` (:mod:`trainers.loops.asynchronous`): the same update fed by a producer
  thread through a freshness-bounded sample buffer.
* :class:`AgenticTrainer` (:mod:`trainers.loops.agentic`): multi-turn episodes -> trajectories
  -> StarPO / GiGPO -> the same PPO update.
* :class:`DistillTrainer` (:mod:`trainers.loops.distill`): on-policy distillation from a teacher.
* :class:`OfflineTrainer` (:mod:`trainers.loops.offline`): SFT, DPO and relatives on a file.
"""

from trainers.loops.agentic import AgenticTrainer
from trainers.loops.asynchronous import AsyncTrainer
from trainers.loops.distill import DistillTrainer
from trainers.loops.offline import OfflineTrainer
from trainers.loops.sync import SyncTrainer

__all__ = ["AgenticTrainer", "AsyncTrainer", "DistillTrainer", "OfflineTrainer", "SyncTrainer"]

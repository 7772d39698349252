"""Text environments for agentic RL: the GEM-style interface, built-in games and tools, GEM
adapter, and a deadline-aware process runner.

* :mod:`trainers.envs.base`: :class:`Env` (``reset`` / ``step`` / ``state_key``), the registry
  (:func:`make_env`, :func:`register_env`) and :func:`stable_state_id`.
* :mod:`trainers.envs.frozenlake`, :mod:`trainers.envs.sokoban`, :mod:`trainers.envs.calculator`:
  the built-in environments (no extra dependency).
* :mod:`trainers.envs.gem`: GEM's environments (``make_env("gem:game:Sokoban-v0-easy")``).
* :mod:`trainers.envs.runner`: :class:`EnvRunner`, environments in worker processes with a
  per-call deadline; :mod:`trainers.envs.chaos` has environments that fail on purpose.
* :mod:`trainers.envs.trajectory`: text episodes to token turns for
  :func:`rollkit.trajectory.build_trajectory` (imports torch; not imported here).
* :mod:`trainers.envs.rollout`: lock-step, environment-level asynchronous and redundant
  multi-turn rollout with fault handling and per-turn staleness (imports torch; not imported
  here); :mod:`trainers.envs.wrappers`: state ids in ``info``, simulated latency and failures.

Importing this package loads no torch and no GEM: worker processes start fast.
"""

from trainers.envs.base import Env, list_envs, make_env, register_env, stable_state_id
from trainers.envs.runner import EnvResult, EnvRunner

__all__ = ["Env", "EnvResult", "EnvRunner", "list_envs", "make_env", "register_env", "stable_state_id"]

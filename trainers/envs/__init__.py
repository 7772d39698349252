"""Text environments for agentic RL: the GEM-style interface, built-in games and tools, the GEM
adapter, environments in worker processes, and the episode runner. Guide: ``docs/agentic.md``.

* :mod:`trainers.envs.base`: :class:`Env` (``reset`` / ``step`` / ``state_key``),
  :func:`stable_state_id` and the action / seed helpers of the built-in games.
* :mod:`trainers.envs.registry`: :func:`make_env`, :func:`register_env`, :func:`list_envs`;
  GEM's environments as ``make_env("gem:game:Sokoban-v0-easy")`` (imported only then).
* :mod:`trainers.envs.frozenlake`, :mod:`trainers.envs.sokoban`, :mod:`trainers.envs.calculator`:
  the built-in environments (no extra dependency); :mod:`trainers.envs.gem`: the GEM adapter.
* :mod:`trainers.envs.tools`: the tool registry, the sandboxed Python tool and the tool-call
  parsers; :mod:`trainers.envs.python_tool_env`: word problems solved with that tool (both import
  the sandbox, hence torch: they are not exported here). Guide: ``docs/tools.md``.
* :mod:`trainers.envs.workers`: :class:`EnvWorkers`, environments in worker processes with a
  per-call deadline; :mod:`trainers.envs.chaos` has environments that fail on purpose;
  :mod:`trainers.envs.wrappers`: state ids in ``info``, simulated latency and failures.
* :mod:`trainers.envs.turns`: text episodes to token turns (:class:`~trainers.envs.turns.TurnEncoder`,
  :func:`~trainers.envs.turns.run_episode`) for :func:`rollkit.trajectory.build_trajectory`.
* :mod:`trainers.envs.episodes`: :class:`~trainers.envs.episodes.EpisodeRunner`, lock-step,
  environment-level asynchronous and redundant episode scheduling with fault handling and
  per-turn staleness, returning an :class:`~trainers.envs.episodes.EpisodeBatch`.

The names exported here load no torch and no GEM, because this package is what every
environment worker process imports (the forkserver preloads it; ``spawn`` imports it per
worker). :mod:`trainers.envs.turns` and :mod:`trainers.envs.episodes` import torch: import
their names from those modules.
"""

from trainers.envs.base import Env, StepResult, stable_state_id
from trainers.envs.registry import ENVS, list_envs, make_env, register_env
from trainers.envs.workers import STATUSES, EnvResult, EnvWorkers
from trainers.envs.wrappers import LatencyEnv, StateIdEnv

__all__ = [
    "ENVS",
    "STATUSES",
    "Env",
    "EnvResult",
    "EnvWorkers",
    "LatencyEnv",
    "StateIdEnv",
    "StepResult",
    "list_envs",
    "make_env",
    "register_env",
    "stable_state_id",
]

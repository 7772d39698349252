"""Environment wrappers used by the episode runner (:mod:`trainers.envs.episodes`).

* :class:`StateIdEnv` reports ``info["state_id"] = stable_state_id(env.state_key())`` with every
  ``reset`` / ``step``: the environment lives in an :class:`~trainers.envs.workers.EnvWorkers`
  worker process, so the state id (GiGPO's anchor state) must travel back with the reply
  instead of costing another round trip.
* :class:`LatencyEnv` makes a real environment slow and flaky, the way production tool /
  simulator environments are: each ``step`` first sleeps a latency drawn from a Gaussian
  truncated at 0 and, with probability ``fail_prob``, fails (raises, hangs, or kills its
  process). It is the W3 workload of ``benchmarks/bench_agentic.py`` (ROLL Flash, Lu et al.,
  2025, arXiv:2510.11345, simulate per-turn latency with mean 10 s, std 1-10 s; scaled down
  here).

Both take the inner environment as a registered name (or ``"module:attr"`` / a class) plus its
keyword arguments, so they stay picklable for the worker processes. Neither imports torch.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Hashable
from typing import Any

from trainers.envs.base import Env, StepResult, stable_state_id
from trainers.envs.registry import make_env, resolve_factory

__all__ = ["FAIL_MODES", "LatencyEnv", "StateIdEnv", "build_inner"]

#: the failure kinds of :class:`LatencyEnv`
FAIL_MODES = ("raise", "hang", "kill")


def build_inner(env: str | Callable[..., Env], kwargs: dict[str, Any] | None) -> Env:
    """``make_env(env, **kwargs)`` for a registered name, else ``env(**kwargs)``."""
    kwargs = dict(kwargs or {})
    if isinstance(env, str) and (env.startswith("gem:") or ":" not in env):
        return make_env(env, **kwargs)
    return resolve_factory(env)(**kwargs)


class StateIdEnv(Env):
    """``env`` with ``info["state_id"]`` (:func:`~trainers.envs.base.stable_state_id` of the state the
    *next* action is taken from) added to the replies of ``reset`` and ``step``.

    >>> env = StateIdEnv("frozenlake", {"size": 3, "hole_prob": 0.0})
    >>> obs, info = env.reset(seed=0)
    >>> info["state_id"] == stable_state_id(env.state_key())
    True
    """

    def __init__(self, env: str | Callable[..., Env], env_kwargs: dict[str, Any] | None = None) -> None:
        self.inner = build_inner(env, env_kwargs)
        self.max_turns = getattr(self.inner, "max_turns", 1 << 30)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        obs, info = self.inner.reset(seed=seed)
        return obs, {**info, "state_id": stable_state_id(self.inner.state_key())}

    def step(self, action: str) -> StepResult:
        obs, reward, terminated, truncated, info = self.inner.step(action)
        return (
            obs,
            reward,
            terminated,
            truncated,
            {**info, "state_id": stable_state_id(self.inner.state_key())},
        )

    def state_key(self) -> Hashable:
        return self.inner.state_key()

    def close(self) -> None:
        self.inner.close()


class LatencyEnv(Env):
    """A real environment whose ``step`` is slow and sometimes fails (module docstring).

    Args:
        env, env_kwargs: the inner environment (default FrozenLake).
        latency_mean_s, latency_std_s: each ``step`` sleeps ``max(0, N(mean, std))`` seconds
            before stepping the inner environment.
        fail_prob: probability that a ``step`` fails, after its sleep.
        fail_mode: ``"raise"`` (``RuntimeError``), ``"hang"`` (sleeps ``hang_s``, far past any
            deadline) or ``"kill"`` (``SIGKILL`` to its own process).
        seed: seeds the latency / failure draws (``None``: from ``os.urandom``, so that
            redundant copies of one task do not share their latencies).

    >>> env = LatencyEnv("frozenlake", {"size": 3, "hole_prob": 0.0}, latency_mean_s=0.0, latency_std_s=0.0)
    >>> obs, _ = env.reset(seed=0)
    >>> env.step("down")[1:4]
    (0.0, False, False)
    """

    def __init__(
        self,
        env: str | Callable[..., Env] = "frozenlake",
        env_kwargs: dict[str, Any] | None = None,
        *,
        latency_mean_s: float = 0.5,
        latency_std_s: float = 0.5,
        fail_prob: float = 0.0,
        fail_mode: str = "raise",
        hang_s: float = 3600.0,
        seed: int | None = None,
    ) -> None:
        for name, v in (("latency_mean_s", latency_mean_s), ("latency_std_s", latency_std_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name}: expected a number >= 0, got {v!r}")
        if isinstance(fail_prob, bool) or not isinstance(fail_prob, (int, float)) or not 0 <= fail_prob <= 1:
            raise ValueError(f"fail_prob: expected a number in [0, 1], got {fail_prob!r}")
        if fail_mode not in FAIL_MODES:
            raise ValueError(f"fail_mode: expected one of {FAIL_MODES}, got {fail_mode!r}")
        self.inner = build_inner(env, env_kwargs)
        self.max_turns = getattr(self.inner, "max_turns", 1 << 30)
        self.latency_mean_s = float(latency_mean_s)
        self.latency_std_s = float(latency_std_s)
        self.fail_prob = float(fail_prob)
        self.fail_mode = fail_mode
        self.hang_s = float(hang_s)
        self._rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

    def latency(self) -> float:
        """One draw of the truncated Gaussian (the next step's sleep)."""
        return max(0.0, self._rng.gauss(self.latency_mean_s, self.latency_std_s))

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return self.inner.reset(seed=seed)

    def step(self, action: str) -> StepResult:
        time.sleep(self.latency())
        if self.fail_prob and self._rng.random() < self.fail_prob:
            if self.fail_mode == "raise":
                raise RuntimeError("simulated environment failure")
            if self.fail_mode == "hang":
                time.sleep(self.hang_s)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.step(action)

    def state_key(self) -> Hashable:
        return self.inner.state_key()

    def close(self) -> None:
        self.inner.close()

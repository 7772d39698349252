"""Environments that misbehave on purpose, to exercise :class:`trainers.envs.workers.EnvWorkers`.

Each is a real, small :class:`~trainers.envs.base.Env` (a counter: the observation is the step
number) that fails in one way at a chosen step -- the failure modes a rollout must survive:

* :class:`HangingEnv`: *fail-slow* -- ``step`` sleeps far past any deadline.
* :class:`RaisingEnv`: *fail-stop* -- ``step`` raises ``RuntimeError``.
* :class:`DyingEnv`: *fail-stop* -- the process dies: ``os._exit`` (``how="exit"``) or
  ``SIGKILL`` to itself (``how="kill"``, what the kernel's out-of-memory killer does).
* :class:`UnpicklableEnv`: returns a result that cannot cross a process boundary.
* :class:`FaultOnceEnv`: a healthy counter, except that chosen tasks fail in a chosen way the
  *first* time they reach a chosen step (recorded with a marker file), so the replacement
  episode of the same task succeeds -- for episode runners that drop and replace.

``fail_at`` is the 1-based step that fails (``0``: ``reset`` fails). Never run these in the
caller's process except to test that they misbehave: the worker processes isolate them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Hashable
from typing import Any

from trainers.envs.base import Env, StepResult, check_action, check_seed

__all__ = ["CounterEnv", "DyingEnv", "FaultOnceEnv", "HangingEnv", "RaisingEnv", "UnpicklableEnv"]


class CounterEnv(Env):
    """A well-behaved baseline: observation ``"step k (seed s)"``, reward 1 on step ``max_turns``."""

    def __init__(self, max_turns: int = 3, fail_at: int = -1, delay_s: float = 0.0) -> None:
        self.max_turns = max_turns
        self.fail_at = fail_at
        self.delay_s = delay_s
        self.seed: int | None = None
        self.t = 0

    def fail(self) -> None:  # overridden by the faulty envs
        pass

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        check_seed(seed)
        if self.fail_at == 0:
            self.fail()
        self.seed, self.t = seed, 0
        return f"step 0 (seed {seed})", {"pid": os.getpid()}

    def step(self, action: str) -> StepResult:
        check_action(action)
        self.t += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.t == self.fail_at:
            self.fail()
        done = self.t >= self.max_turns
        return (
            f"step {self.t} (seed {self.seed}) after {action!r}",
            float(done),
            done,
            False,
            {"pid": os.getpid()},
        )

    def state_key(self) -> Hashable:
        return ("counter", self.seed, self.t)


class HangingEnv(CounterEnv):
    """Sleeps ``hang_s`` seconds (default: an hour) at step ``fail_at``."""

    def __init__(self, max_turns: int = 3, fail_at: int = 1, hang_s: float = 3600.0) -> None:
        super().__init__(max_turns, fail_at)
        self.hang_s = hang_s

    def fail(self) -> None:
        time.sleep(self.hang_s)


class RaisingEnv(CounterEnv):
    """Raises ``RuntimeError(message)`` at step ``fail_at``."""

    def __init__(self, max_turns: int = 3, fail_at: int = 1, message: str = "environment exploded") -> None:
        super().__init__(max_turns, fail_at)
        self.message = message

    def fail(self) -> None:
        raise RuntimeError(self.message)


class DyingEnv(CounterEnv):
    """Ends its own process at step ``fail_at``: ``os._exit(exit_code)`` or ``SIGKILL``."""

    def __init__(self, max_turns: int = 3, fail_at: int = 1, how: str = "exit", exit_code: int = 3) -> None:
        if how not in ("exit", "kill"):
            raise ValueError(f"how: expected 'exit' or 'kill', got {how!r}")
        super().__init__(max_turns, fail_at)
        self.how = how
        self.exit_code = exit_code

    def fail(self) -> None:
        if self.how == "exit":
            os._exit(self.exit_code)
        os.kill(os.getpid(), signal.SIGKILL)


class UnpicklableEnv(CounterEnv):
    """Returns an ``info`` holding a lock (cannot be pickled) from ``step`` number ``fail_at``."""

    def __init__(self, max_turns: int = 3, fail_at: int = 1) -> None:
        super().__init__(max_turns, fail_at)

    def step(self, action: str) -> StepResult:
        obs, reward, terminated, truncated, info = super().step(action)
        if self.t == self.fail_at:
            info["lock"] = threading.Lock()
        return obs, reward, terminated, truncated, info


class FaultOnceEnv(CounterEnv):
    """A :class:`CounterEnv` whose task ``seed`` in ``faults`` fails once: ``faults = {seed: (how,
    step)}`` with ``how`` in ``"hang"`` / ``"raise"`` / ``"kill"``. The first episode of that seed
    to reach ``step`` creates ``<marker_dir>/fault-<seed>`` and fails; later episodes (other
    processes included) find the marker and play normally. Observations echo the action, so a
    transcript shows which episode wrote what.
    """

    def __init__(
        self, marker_dir: str, faults: dict[int, tuple[str, int]], max_turns: int = 3, hang_s: float = 3600.0
    ) -> None:
        for seed, (how, step) in faults.items():
            if how not in ("hang", "raise", "kill") or step < 1:
                raise ValueError(
                    f"faults[{seed}]: expected (hang|raise|kill, step >= 1), got {(how, step)!r}"
                )
        super().__init__(max_turns)
        self.marker_dir = marker_dir
        self.faults = dict(faults)
        self.hang_s = hang_s

    def step(self, action: str) -> StepResult:
        fault = self.faults.get(self.seed)  # type: ignore[arg-type]
        if fault is not None and self.t + 1 == fault[1]:
            try:
                fd = os.open(os.path.join(self.marker_dir, f"fault-{self.seed}"), os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                fd = None
            if fd is not None:
                os.close(fd)
                if fault[0] == "hang":
                    time.sleep(self.hang_s)
                elif fault[0] == "raise":
                    raise RuntimeError(f"task {self.seed} exploded at step {fault[1]}")
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action)

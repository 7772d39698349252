"""GEM environments behind rollkit's :class:`~trainers.envs.base.Env` interface.

GEM (Axon-RL's General Experience Maker, PyPI ``gem-llm``; Liu et al., 2025,
arXiv:2510.01051) has the same ``reset`` / ``step`` API; :class:`GemEnv` adds what rollkit
relies on:

* self-contained observations: with ``append_suffix=True`` (default) GEM's ``info["suffix"]``
  (the board) is appended to every observation; ``info`` is passed on unchanged;
* :meth:`GemEnv.state_key`: for the games of :data:`STATE_ATTRIBUTES` a frozen copy of those
  attributes, otherwise the latest observation text; ``state_fn(gem_env) -> hashable`` chooses;
* GEM's rewards and flags, unchanged;
* GEM's tool use: ``tools=["python"]`` wraps the game in GEM's own
  ``gem.tools.tool_env_wrapper.ToolEnvWrapper`` with :class:`SandboxedPythonCodeTool`, GEM's
  ``PythonCodeTool`` (its parsing of ``<python>`` / ````` ```python ````` blocks, its instruction
  and its ``"Code execution result: ..."`` observation) whose code runs in rollkit's sandbox
  (:func:`trainers.rewards.sandbox.run_python`) instead of GEM's ``sandbox_type="none"``
  subprocess; e.g. ``make_env("gem:rg:products", tools=["python"])``. GEM's other tools
  (``SearchTool``, ``MCPTool``) call servers over the network (a retrieval server, an MCP server)
  and are refused by name.

``make_env("gem:<id>")`` builds one (ids such as ``"game:Sokoban-v0-easy"``; :func:`gem_env_ids`
lists them). GEM's ``reset(seed)`` seeds Python's and NumPy's global generators: run GEM
environments in :class:`~trainers.envs.workers.EnvWorkers`. Installing GEM and the details:
docs/agentic.md (GEM environments).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from trainers.deps import require
from trainers.envs.base import Env, StepResult, check_action, check_seed
from trainers.envs.tools import format_run
from trainers.rewards.sandbox import check_options, run_python

__all__ = ["GEM_TOOLS", "STATE_ATTRIBUTES", "GemEnv", "SandboxedPythonCodeTool", "gem_env_ids"]

#: the GEM tools ``GemEnv(tools=...)`` takes
GEM_TOOLS = ("python",)

#: GEM game class name -> the attributes that make up its state (for :meth:`GemEnv.state_key`)
STATE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "SokobanEnv": ("room_state", "player_position"),
    "GuessTheNumberEnv": ("previous_guesses",),
    "MastermindEnv": ("previous_guesses",),
    "MinesweeperEnv": ("revealed", "flags"),
}


def _freeze(x: Any) -> Hashable:
    """A hashable, process-independent copy of a game attribute."""
    if hasattr(x, "tobytes") and hasattr(x, "shape"):  # numpy array
        return ("array", tuple(x.shape), str(x.dtype), x.tobytes())
    if isinstance(x, (set, frozenset)):
        return ("set", tuple(sorted(repr(_freeze(v)) for v in x)))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((repr(k), _freeze(v)) for k, v in x.items())))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x if isinstance(x, (int, float, str, bool, type(None))) else repr(x)


def _gem() -> Any:
    try:
        return require("gem")
    except ImportError as e:
        raise ImportError(
            "GEM environments need the 'gem-llm' package: pip install reasoning-gym==0.1.23 && "
            "pip install --no-deps gem-llm==0.1.0"
        ) from e


def _registry() -> dict[str, Any]:
    """GEM's ``gem.envs.registration.ENV_REGISTRY`` (id -> spec)."""
    return require("gem.envs.registration").ENV_REGISTRY


def gem_env_ids(prefix: str = "game:") -> list[str]:
    """GEM's registered ids starting with ``prefix`` (``""``: all)."""
    _gem()
    return sorted(k for k in _registry() if k.startswith(prefix))


class SandboxedPythonCodeTool:
    """GEM's ``PythonCodeTool`` with rollkit's sandbox as the executor (a GEM tool: what
    ``ToolEnvWrapper`` calls, ``instruction_string()`` and ``execute_action(action)``).

    GEM's own tool parses the action and writes the instruction; only the execution changes:
    :func:`~trainers.rewards.sandbox.run_python` with ``timeout_s`` and the sandbox ``options``.
    ``execute_action`` returns GEM's ``(is_valid, has_error, observation, parsed_action)``.
    """

    tool_type = "python_code"
    name = "python"

    def __init__(self, timeout_s: float = 5.0, keep_error_last_line: bool = False, **options: Any) -> None:
        self.options = dict(options, timeout_s=float(timeout_s))
        self.options.setdefault("memory_mb", 256)
        check_options(**self.options)
        self._gem = require("gem.tools.python_code_tool").PythonCodeTool(
            timeout=timeout_s, keep_error_last_line=keep_error_last_line
        )
        self.keep_error_last_line = bool(keep_error_last_line)

    def instruction_string(self) -> str:
        return self._gem.instruction_string()

    def execute_action(self, action: str) -> tuple[bool, bool, str, str]:
        code, parsed_action, is_valid = self._gem._parse_action(action)
        if not is_valid:
            return False, True, "", parsed_action
        r = run_python(code, **self.options)
        stderr = r.stderr if r.status in ("ok", "error") else format_run(r, self.options["timeout_s"])[0]
        if stderr and self.keep_error_last_line:
            stderr = stderr.split("\n")[-1]
        result = f"{r.stdout}\n{stderr}" if stderr else r.stdout
        return True, not r.ok, "Code execution result: " + result.lstrip(" \n") + "\n", parsed_action


def _gem_tools(tools: Any, options: dict[str, Any] | None) -> list[Any]:
    if isinstance(tools, str) or not all(isinstance(t, str) for t in tools):
        raise ValueError(f"tools: expected a list of tool names {list(GEM_TOOLS)}, got {tools!r}")
    out = []
    for t in tools:
        if t != "python":
            raise ValueError(
                f"tools: {t!r} is not available; GEM's search and MCP tools call servers over the "
                f"network (a retrieval / MCP server), which rollkit does not run; available: {list(GEM_TOOLS)}"
            )
        out.append(SandboxedPythonCodeTool(**(options or {})))
    return out


class GemEnv(Env):
    """A GEM environment (``gem.make(env_id, **kwargs)``) as a rollkit :class:`Env`.

    Args:
        env_id: a GEM id, e.g. ``"game:GuessTheNumber-v0-easy"``.
        append_suffix: append ``info["suffix"]`` (the board / the prompt for the next move)
            to every observation.
        state_fn: ``gem_env -> hashable`` for :meth:`state_key` (default: module docstring).
        tools: GEM tools to wrap the environment with (``["python"]``: GEM's ``ToolEnvWrapper``
            with :class:`SandboxedPythonCodeTool`); ``()``: none.
        tool_options: :class:`SandboxedPythonCodeTool`'s options (``timeout_s``, sandbox ones).
        max_tool_uses: ``ToolEnvWrapper``'s limit of tool calls per episode.
        **kwargs: passed to ``gem.make`` (they override the registered defaults).
    """

    def __init__(
        self,
        env_id: str,
        *,
        append_suffix: bool = True,
        state_fn: Callable[[Any], Hashable] | None = None,
        tools: Sequence[str] = (),
        tool_options: dict[str, Any] | None = None,
        max_tool_uses: int = 10,
        **kwargs: Any,
    ) -> None:
        if not isinstance(env_id, str) or not env_id:
            raise ValueError(f"env_id: expected a GEM id such as 'game:Sokoban-v0-easy', got {env_id!r}")
        gem = _gem()
        registry = _registry()
        if env_id not in registry:
            close = sorted(k for k in registry if k.split("-")[0] == env_id.split("-")[0])
            raise ValueError(
                f"env_id: GEM has no environment {env_id!r}" + (f"; did you mean {close}?" if close else "")
            )
        self.env_id = env_id
        self.append_suffix = bool(append_suffix)
        if state_fn is not None and not callable(state_fn):
            raise TypeError(f"state_fn: expected a callable or None, got {type(state_fn).__name__}")
        self.state_fn = state_fn
        self.env = gem.make(env_id, **kwargs)
        if tools:
            wrapper = require("gem.tools.tool_env_wrapper").ToolEnvWrapper
            self.env = wrapper(self.env, _gem_tools(tools, tool_options), max_tool_uses=max_tool_uses)
        self.max_turns = getattr(self.env, "max_turns", None)
        self._last = ""

    def _text(self, obs: Any, info: dict[str, Any]) -> str:
        text = str(obs)
        suffix = info.get("suffix") if isinstance(info, dict) else None
        if self.append_suffix and suffix:
            text = f"{text}\n{suffix}"
        return text

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        check_seed(seed)
        obs, info = self.env.reset(seed=seed)
        suffix = info.get("suffix", "") if isinstance(info, dict) else ""
        self._last = str(suffix)
        return self._text(obs, info), info

    def step(self, action: str) -> StepResult:
        check_action(action)
        obs, reward, terminated, truncated, info = self.env.step(action)
        text = self._text(obs, info)
        self._last = text
        return text, float(reward), bool(terminated), bool(truncated), info

    def state_key(self) -> Hashable:
        game = self.env.unwrapped
        if self.state_fn is not None:
            return ("gem", self.env_id, self.state_fn(game))
        attrs = STATE_ATTRIBUTES.get(type(game).__name__)
        if attrs and all(hasattr(game, a) for a in attrs):
            return ("gem", self.env_id, tuple(_freeze(getattr(game, a)) for a in attrs))
        return ("gem", self.env_id, self._last)

    def sample_random_action(self) -> str:
        return self.env.sample_random_action()

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

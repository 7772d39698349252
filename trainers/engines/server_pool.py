"""The servers behind :class:`~trainers.engines.server_rollout.ServerRolloutEngine`: which are
live, which one takes the next request, why one was dropped, and its replacement.

:class:`ServerPool` owns the routing and health half of the server engine (the engine owns the
requests): the clients, the live set, the processes rollkit started, drops with their cause (the
exit code and the error lines of the server's log), and replacements started in the background.
docs/server.md ("Failures").
"""

from __future__ import annotations

import signal
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from trainers.engines.vllm_server import (
    LocalServer,
    ServerClient,
    ServerError,
    resolve_api_key,
    start_server,
    stop_servers,
    wait_healthy,
)

__all__ = ["ServerPool"]

_PROBE = "Hello, 12+34=46."


def _stop_local(servers: list[LocalServer]) -> None:
    stop_servers(servers)


def _signal_name(code: int) -> str:
    """`` (SIGKILL)`` for the exit code 137 (128 + a signal, as the guard reports one), else ``""``."""
    try:
        return f" ({signal.Signals(code - 128).name})" if code > 128 else ""
    except ValueError:
        return ""


class ServerPool:
    """The servers of one engine, by index (``clients[i]``); the first ``len(local_servers)``
    are processes rollkit started, stopped by :meth:`close` (or when the pool is collected, or
    at exit) and, with ``restart``, replaced in the background when one is dropped.

    ``on_replace(client)`` prepares a replacement before it joins (the engine loads the current
    weights into it); a replacement that fails to start or to prepare is stopped and its cause
    recorded.

    Keys: a client of a server rollkit started sends that server's own key
    (``LocalServer.api_key``; a replacement gets a new one); a client of any other address sends
    ``api_key``, else what :func:`~trainers.engines.vllm_server.resolve_api_key` finds (the
    ``VLLM_API_KEY`` environment variable)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float,
        api_key: str | None = None,
        local_servers: Sequence[LocalServer] = (),
        restart: bool = True,
        restart_kw: dict[str, Any] | None = None,
    ) -> None:
        if len(local_servers) > len(urls):
            raise ValueError(f"local_servers: {len(local_servers)} servers for {len(urls)} addresses")
        self.timeout_s = float(timeout_s)
        keys = [s.api_key or None for s in local_servers] + [None] * (len(urls) - len(local_servers))
        self.clients = [
            ServerClient(u, timeout_s=timeout_s, api_key=k or resolve_api_key(u, api_key))
            for u, k in zip(urls, keys)
        ]
        self.local_servers: list[LocalServer] = list(local_servers)  # every server started, to stop
        self.procs: dict[int, LocalServer] = dict(enumerate(local_servers))  # server index -> process
        self.restart, self.restart_kw = bool(restart), dict(restart_kw or {})
        self.live: set[int] = set(range(len(self.clients)))
        self.dropped = self.restarted = 0
        self.causes: list[str] = []  # why each server was dropped or not replaced, oldest first
        self.on_replace: Callable[[ServerClient], None] | None = None
        self.closed = False
        self._lock = threading.Lock()
        # the servers rollkit started stop with the pool (and at exit, whichever comes first)
        self._finalizer = weakref.finalize(self, _stop_local, self.local_servers)

    # ------------------------------------------------------------------ routing

    def pick(self, load: dict[int, int]) -> int:
        """The live server with the fewest outstanding requests (``load``; lowest index on ties)."""
        with self._lock:
            live = sorted(self.live)
        if not live:
            raise ServerError(f"no live servers left ({self.dropped} dropped{self._last_cause()})")
        return min(live, key=lambda i: (load.get(i, 0), i))

    def _last_cause(self) -> str:
        return f"; last: {self.causes[-1]}" if self.causes else ""

    # ------------------------------------------------------------------ the model they serve

    def check_models(self) -> tuple[str, int | None]:
        """Every server answers ``/v1/models`` with one model, the same one."""
        seen: list[tuple[str, str, int | None]] = []
        for c in self.clients:
            models = c.models()
            if len(models) != 1:
                raise ServerError(f"server {c.url}: serves {len(models)} models, expected exactly one")
            m = models[0]
            seen.append((str(m.get("id")), str(m.get("root")), m.get("max_model_len")))
        if len({(i, r, n) for i, r, n in seen}) > 1:
            pairs = ", ".join(f"{c.url}: {r} (max_model_len {n})" for c, (_, r, n) in zip(self.clients, seen))
            raise ServerError(f"model mismatch between servers: {pairs}")
        return seen[0][0], seen[0][2]

    def check_tokenizer(self, tokenizer: Any, model_name: str) -> None:
        """The trainer's tokenizer and the servers' encode a probe text the same way."""
        mine = list(tokenizer(_PROBE, add_special_tokens=False).input_ids)
        for c in self.clients:
            try:
                theirs = c.post(
                    "/tokenize", {"model": model_name, "prompt": _PROBE, "add_special_tokens": False}
                )
            except ServerError as e:
                if e.status == 404:  # a tokens-only server has no tokenizer to compare
                    continue
                raise
            if list(theirs.get("tokens", [])) != mine:
                raise ServerError(
                    f"model mismatch: server {c.url} ({model_name}) encodes {_PROBE!r} as "
                    f"{theirs.get('tokens')}, the trainer's tokenizer as {mine}"
                )

    # ------------------------------------------------------------------ health

    def check_health(self) -> int:
        """``GET /health`` on every live server; drop those that fail. Returns the live count."""
        for i in sorted(self.live):
            if not self.clients[i].healthy(timeout=min(5.0, self.timeout_s)):
                self.drop(i, "GET /health did not answer")
        return len(self.live)

    def healthy(self, server: int) -> bool:
        return self.clients[server].healthy(timeout=min(5.0, self.timeout_s))

    def cause(self, server: int, why: str) -> str:
        """One line: which server failed and why; for a process rollkit started, its exit code
        (if it exited) and the error lines of its log (what a user would look for there)."""
        url, local = self.clients[server].url, self.procs.get(server)
        if local is None:
            return f"server {url}: {why}"
        code = local.process.poll()
        if code is None:
            state = f"failed ({why})"
        else:
            state = f"exited with code {code}{_signal_name(code)}"
        errors = local.log_errors()
        return f"server {url} {state}{': ' + errors if errors else ''} (log {local.log_path})"

    def drop(self, server: int, why: str) -> None:
        """Take ``server`` out of the rotation, record why, stop its process and start its
        replacement (``restart``) when rollkit started it."""
        with self._lock:
            if server not in self.live:
                return
            self.live.discard(server)
            self.dropped += 1
        self.causes.append(self.cause(server, why))
        local = self.procs.get(server)
        if local is not None:
            local.stop()
            if self.restart and self.restart_kw and not self.closed:
                threading.Thread(target=self._replace, args=(server,), daemon=True).start()

    def _replace(self, server: int) -> None:
        """Background: start a new local server in place of a dead one, prepare it
        (``on_replace``), then put it back in the rotation."""
        kw = dict(self.restart_kw)
        model_path, run_dir, deadline = kw.pop("model_path"), kw.pop("run_dir"), kw.pop("startup_timeout_s")
        try:
            new = start_server(model_path, run_dir, index=len(self.local_servers), **kw)
        except ServerError as e:  # the process is exiting
            self.causes.append(f"replacement of server {server} not started: {e}")
            return
        with self._lock:
            self.local_servers.append(new)  # stopped with the pool even before it joins
            closed = self.closed
        if closed:  # the pool closed while the process started
            new.stop()
            return
        try:
            wait_healthy([new], deadline)
            client = ServerClient(new.url, timeout_s=self.timeout_s, api_key=new.api_key)
            if self.on_replace is not None:
                self.on_replace(client)
        except Exception as e:
            new.stop()
            self.causes.append(f"replacement of server {server} failed: {e}")
            return
        with self._lock:
            if self.closed:  # the engine was shut down meanwhile
                new.stop()
                return
            self.clients[server], self.procs[server] = client, new
            self.live.add(server)
            self.restarted += 1

    # ------------------------------------------------------------------ metrics, shutdown

    def metrics(self) -> dict[str, Any]:
        """``server/live``, ``server/dropped``, ``server/restarted`` and, once a server was
        dropped, ``server/drop_cause`` (the latest cause, a string: metrics.jsonl keeps it, the
        scalar trackers skip it)."""
        out: dict[str, Any] = {
            "server/live": float(len(self.live)),
            "server/dropped": float(self.dropped),
            "server/restarted": float(self.restarted),
        }
        if self.causes:
            out["server/drop_cause"] = self.causes[-1]
        return out

    def close(self) -> None:
        """Stop every server rollkit started (replacements still starting included)."""
        with self._lock:
            self.closed = True
        self._finalizer()

"""API keys for the HTTP servers rollkit runs: checking a bearer token, and vLLM's gap closed.

``vllm serve --api-key`` (or ``VLLM_API_KEY``) guards only the paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` (``GUARDED_PREFIX`` in vLLM 0.32's
``vllm/entrypoints/serve/middleware/authenticate.py``): the routes that change a running policy
(``/collective_rpc``, which reloads weights from any path; ``/pause``, ``/resume``,
``/abort_requests``, ``/update_weights``, ``/update_weight_version``, ``/sleep``,
``/reset_prefix_cache``, ...) and ``/invocations`` (a generation) answer anyone.
:class:`BearerAuthMiddleware` is the ASGI middleware every ``vllm serve`` rollkit starts loads
(``--middleware``): it answers 401 to any request without ``Authorization: Bearer <key>``
before vLLM sees it, on every path but ``/health``. The key is read from the server's
environment (``VLLM_API_KEY``, which vLLM's own check reads too), never from its command line,
where ``ps`` would show it. docs/server.md ("API keys").

:func:`bearer_ok` is the constant-time check that this middleware and
:class:`~trainers.envs.http_agent.AgentEndpoint` share.

>>> bearer_ok("Bearer s3cret", "s3cret"), bearer_ok("bearer s3cret", "s3cret")
(True, True)
>>> bearer_ok("Bearer s3cre", "s3cret"), bearer_ok(None, "s3cret"), bearer_ok("Basic s3cret", "s3cret")
(False, False, False)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from typing import Any

__all__ = ["API_KEY_ENV", "OPEN_PATHS", "BearerAuthMiddleware", "bearer_ok", "check_api_key"]

#: the environment variable that carries a server's key (vLLM's own name for it)
API_KEY_ENV = "VLLM_API_KEY"
#: the paths a rollkit-started server answers without the key: its liveness, nothing else
OPEN_PATHS = frozenset({"/health"})

_KEY = re.compile(r"[\x21-\x7e]+")  # visible ASCII: a header value without spaces or controls


def check_api_key(api_key: Any, name: str = "api_key") -> str:
    """``api_key`` if it can be a bearer token (a non-empty ``str`` of visible ASCII, no spaces),
    else ``ValueError`` naming ``name`` (never echoing the value: it may be a real key)."""
    if not isinstance(api_key, str) or not _KEY.fullmatch(api_key):
        what = f"a str of {len(api_key)} characters" if isinstance(api_key, str) else type(api_key).__name__
        raise ValueError(
            f"{name}: expected a non-empty str of visible ASCII characters (no spaces), got {what}"
        )
    return api_key


def _digest(value: str | bytes) -> bytes:
    raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
    return hashlib.sha256(raw).digest()


def _bearer_matches(authorization: bytes | None, digest: bytes) -> bool:
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(_digest(token.strip()), digest)


def bearer_ok(authorization: str | bytes | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (the scheme in any case).
    The tokens are compared as SHA-256 digests with :func:`hmac.compare_digest`: the time taken
    tells nothing about the key, not even its length."""
    if isinstance(authorization, str):
        authorization = authorization.encode("latin-1", "replace")
    return _bearer_matches(authorization, _digest(api_key))


class BearerAuthMiddleware:
    """ASGI middleware: every HTTP or WebSocket request needs ``Authorization: Bearer <key>``,
    except those to :data:`OPEN_PATHS`; the key is ``VLLM_API_KEY`` of the process environment.

    A request without the right key is answered 401 (``{"error": {"message", "type", "code"}}``,
    vLLM's error shape, and ``WWW-Authenticate: Bearer``) and never reaches the application, so
    it changes nothing; a WebSocket is closed before it is accepted (code 1008). Methods are not
    exempt (``OPTIONS`` included: rollkit's clients send no pre-flight requests). Load it with
    ``vllm serve --middleware trainers.engines.server_auth.BearerAuthMiddleware`` and the key in
    ``VLLM_API_KEY`` (vLLM then guards its ``/v1`` routes with the same key). Without a key it
    raises ``RuntimeError`` where the application is built, so no request reaches vLLM's routes:
    a server never runs open by mistake.
    """

    def __init__(self, app: Any) -> None:
        key = os.environ.get(API_KEY_ENV, "")
        if not key:
            raise RuntimeError(
                f"{API_KEY_ENV} is not set: BearerAuthMiddleware needs the server's API key in its environment"
            )
        self.app = app
        self._digest = _digest(check_api_key(key, API_KEY_ENV))

    def _allowed(self, scope: dict[str, Any]) -> bool:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if path in OPEN_PATHS:
            return True
        header = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), None)
        return _bearer_matches(header, self._digest)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(
            {
                "error": {
                    "message": "unauthorized: this server needs 'Authorization: Bearer <its API key>'",
                    "type": "Unauthorized",
                    "code": 401,
                }
            }
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})

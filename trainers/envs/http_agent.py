"""An OpenAI-compatible endpoint that any agent trains through: :class:`AgentEndpoint`.

rollkit serves ``/v1/chat/completions`` and ``/v1/models`` on a thread of the trainer's
process. An *agent* is any Python callable ``agent(base_url, task) -> reward`` (or scored by
a verifier) that talks to ``base_url`` with an OpenAI-style client; each episode gets its own
``base_url`` (a session). Every call is recorded token-exact by a :class:`ChatRecorder`: the
chat template is applied once, on rollkit's side, and turn ``k + 1``'s prompt is turn ``k``'s
prompt ids + the sampled ids + the ids of the messages the agent added (the template's glue
included), never a re-tokenisation of the whole conversation. The calls are forwarded to the
rollout engine (a :class:`~trainers.engines.server_rollout.ServerRolloutEngine` or any
rollout engine), and :func:`collect_agent_episodes` turns each episode into the turns of an
:class:`~trainers.envs.episodes.EpisodeRecord` (the agent's and tools' tokens are observation
tokens, masked out of the loss), ready for the agentic loop's advantage estimators and the
mismatch correction. docs/server.md ("Agents over HTTP").

OpenAI function calling: a request's ``tools`` are rendered by the tokenizer's chat template
(``apply_chat_template(..., tools=...)``; a template that does not render them, or no template,
answers 400), the answer's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
(Hermes / Qwen2.5's format) come back as ``tool_calls`` (``finish_reason="tool_calls"``), and
the agent's assistant messages with ``tool_calls`` and its ``tool`` messages are accepted back.
The recording stays token-exact: the model's own tokens are recorded, never the template's
re-rendering of its tool calls; the template only writes the glue and the new messages.
``stream: true`` answers with server-sent events in OpenAI's chunk format, ending with
``data: [DONE]`` (the answer is generated whole, then sent as chunks). ``n > 1``: see
:class:`AgentEndpoint`. Every call has a deadline (``deadline_s``).

An endpoint that listens beyond loopback (``host`` not ``127.0.0.1`` / ``::1`` /
``localhost``) requires a bearer token (``api_key``, generated when none is given, and said so
in one line on stderr at start): a call without ``Authorization: Bearer <token>`` is answered
401 and nothing is recorded. :func:`collect_agent_episodes` hands the token to agents that take
an ``api_key`` argument.
"""

from __future__ import annotations

import dataclasses
import inspect
import ipaddress
import json
import re
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rollkit.trajectory import Turn
from trainers.engines.base import Generation, SamplingParams
from trainers.engines.server_auth import bearer_ok, check_api_key
from trainers.envs.base import stable_state_id
from trainers.envs.episodes import EpisodeBatch, EpisodeRecord
from trainers.envs.tools import parse_tool_calls

__all__ = [
    "AgentEndpoint",
    "ChatDriftError",
    "ChatRecorder",
    "DeadlineError",
    "collect_agent_episodes",
    "is_loopback",
    "split_tool_calls",
]

Agent = Callable[[str, Any], Any]


class ChatDriftError(ValueError):
    """The agent sent a conversation that does not extend the one rollkit recorded."""


def _arguments(args: Any) -> Any:
    """Tool-call arguments as a dict (the OpenAI wire format sends a JSON string)."""
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args


def _message(m: Any) -> dict[str, Any]:
    """A message in the recorder's normal form (also what the chat template is given): role and
    text content; an assistant's ``tool_calls`` as ``{"type", "function": {"name", "arguments":
    dict}}`` (ids dropped); a tool message's ``tool_call_id`` / ``name`` kept."""
    if not isinstance(m, dict) or "role" not in m:
        raise ValueError(f"messages: each message needs a role and content, got {m!r}")
    content = m.get("content") or ""
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out: dict[str, Any] = {"role": str(m["role"]), "content": str(content)}
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            f = (c or {}).get("function", c) if isinstance(c, dict) else None
            if not isinstance(f, dict) or "name" not in f:
                raise ValueError(f"messages: a tool call needs a function name, got {c!r}")
            calls.append(
                {
                    "type": "function",
                    "function": {"name": str(f["name"]), "arguments": _arguments(f.get("arguments"))},
                }
            )
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if out["role"] == "tool" and m.get(key):
            out[key] = str(m[key])
    return out


def _state_part(m: dict[str, Any]) -> tuple[str, ...]:
    """A message's part of a turn's state id (role and content; tool fields when there are any)."""
    extra = {k: v for k, v in m.items() if k not in ("role", "content")}
    return (
        (m["role"], m["content"], json.dumps(extra, sort_keys=True)) if extra else (m["role"], m["content"])
    )


_TOOL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)


def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of an answer: each ``<tool_call>{json}</tool_call>`` whose JSON
    has a ``name`` and object ``arguments`` becomes an OpenAI tool call (``arguments`` as a JSON
    string, as the API sends it) and leaves the content; a malformed block stays in the content.

    >>> split_tool_calls('ok <tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
    ('ok', [{'id': 'call_0', 'type': 'function', 'function': {'name': 'python', 'arguments': '{"code": "print(1)"}'}}])
    """
    calls, kept, pos = [], [], 0
    for m in _TOOL_BLOCK.finditer(text):
        parsed = parse_tool_calls(m.group(0), formats=("tool_call",))
        c = parsed[0] if parsed else None
        if c is None or not c.name or not isinstance(c.arguments, dict):
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        fn = {"name": c.name, "arguments": json.dumps(c.arguments)}
        calls.append({"id": f"call_{len(calls)}", "type": "function", "function": fn})
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


_PROBE = {
    "type": "function",
    "function": {
        "name": "rollkit_probe_tool",
        "description": "",
        "parameters": {"type": "object", "properties": {}},
    },
}


class ChatRecorder:
    """One episode's conversation in token space (module docstring).

    Args:
        tokenizer: the policy's tokenizer.
        chat_template: use the tokenizer's chat template (``None``: when it has one); without
            it the conversation is ``"role: content\\n"`` lines and the generation prompt is
            ``"assistant: "``.

    :meth:`prompt` gives the token ids of the next call's prompt and :meth:`record` stores the
    sampled answer; ``turns`` are the episode's :class:`~rollkit.trajectory.Turn` s and
    ``replies`` the OpenAI messages rollkit answered. ``tools`` (the first call's, which every
    later call must repeat) are rendered by the template.
    """

    def __init__(self, tokenizer: Any, *, chat_template: bool | None = None) -> None:
        self.tokenizer = tokenizer
        has = bool(getattr(tokenizer, "chat_template", None))
        if chat_template and not has:
            raise ValueError("chat_template: the tokenizer has no chat template")
        self.chat_template = has if chat_template is None else bool(chat_template)
        self.messages: list[dict[str, Any]] = []  # the conversation so far, rollkit's answers included
        self.context: list[int] = []  # its token ids
        self.turns: list[Turn] = []
        self.versions: list[int] = []
        self.texts: list[str] = []
        self.replies: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None
        self._closing = self._closing_text()

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def render(self, messages: Sequence[dict[str, Any]], generation_prompt: bool, tools: Any = None) -> str:
        """The conversation as text (the chat template, or the plain format)."""
        if self.chat_template:
            kw = {"tools": list(tools)} if tools else {}
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation_prompt, **kw
            )
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if generation_prompt else "")

    def supports_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (a probe tool's name appears)."""
        if not self.chat_template:
            return False
        try:
            return "rollkit_probe_tool" in self.render([{"role": "user", "content": "U"}], True, [_PROBE])
        except Exception:  # a template that chokes on tools has no tool support
            return False

    def _closing_text(self) -> str:
        """What the template writes after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        before = self.render([{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}], False)
        return before[before.rindex("A") + 1 :]

    def _check_tools(self, tools: Any) -> list[dict[str, Any]] | None:
        tools = list(tools) if tools else None
        if tools and not self.supports_tools():
            why = (
                "has no chat template"
                if not self.chat_template
                else "has a chat template that does not render tools"
            )
            raise ValueError(
                f"tools: function calling needs a chat template with tool support; this tokenizer {why}"
            )
        if self.turns and json.dumps(tools, sort_keys=True) != json.dumps(self.tools, sort_keys=True):
            raise ChatDriftError(
                "tools: a call's tools differ from the episode's first call's (send the same tools)"
            )
        return tools

    def prompt(
        self, messages: Sequence[Any], tools: Sequence[Any] | None = None
    ) -> tuple[list[int], list[int]]:
        """``(new_ids, prompt_ids)`` of a call with ``messages`` (and ``tools``): the first call
        renders the whole conversation; a later one must extend the recorded conversation with
        the same tools (raises :class:`ChatDriftError` otherwise) and only its new messages are
        encoded."""
        msgs = [_message(m) for m in messages]
        if not msgs:
            raise ValueError("messages: at least one message is needed")
        tools = self._check_tools(tools)
        if not self.turns:
            self.tools = tools
            new = self._encode(self.render(msgs, True, tools))
            return new, new
        n = len(self.messages)
        if msgs[:n] != self.messages:
            k = (
                next(i for i, (a, b) in enumerate(zip(msgs, self.messages)) if a != b)
                if len(msgs) >= n
                else len(msgs)
            )
            raise ChatDriftError(
                f"messages: the conversation does not extend the recorded one (message {k} differs or "
                "is missing); send the assistant's replies back unchanged"
            )
        if len(msgs) == n:
            raise ValueError("messages: nothing new since the last reply")
        before = self.render(self.messages, False, tools)
        after = self.render(msgs, True, tools)
        if not after.startswith(before):
            raise ChatDriftError(
                "chat_template: the template re-renders earlier turns; incremental encoding is impossible"
            )
        closing = self._closing
        last = self.turns[-1].action_ids
        written = self.tokenizer.decode(list(last)[-1:]) if len(last) else ""
        if written and closing.startswith(written):  # the model wrote the end-of-turn token itself
            closing = closing[len(written) :]
        new = self._encode(closing + after[len(before) :])
        return new, self.context + new

    def reply(self, g: Generation) -> dict[str, Any]:
        """The OpenAI assistant message of ``g``: its text, split into content and ``tool_calls``
        when the episode has tools."""
        text = self.tokenizer.decode(list(g.token_ids), skip_special_tokens=True)
        if not self.tools:
            return {"role": "assistant", "content": text}
        content, calls = split_tool_calls(text)
        return (
            {"role": "assistant", "content": content or None, "tool_calls": calls}
            if calls
            else {"role": "assistant", "content": text}
        )

    def record(self, messages: Sequence[Any], new_ids: list[int], g: Generation) -> str:
        """Store the answer ``g`` to a call whose prompt :meth:`prompt` gave; returns its text."""
        text = self.tokenizer.decode(list(g.token_ids), skip_special_tokens=True)
        msgs = [_message(m) for m in messages]
        state = stable_state_id(tuple(_state_part(m) for m in msgs))
        self.turns.append(Turn(list(new_ids), list(g.token_ids), list(g.logprobs), state_id=state))
        self.versions.append(int(g.policy_version))
        self.context = self.context + list(new_ids) + list(g.token_ids)
        reply = self.reply(g)
        self.messages = [*msgs, _message(reply)]
        self.replies.append(reply)
        self.texts.append(text)
        return text


@dataclass
class _Session:
    recorder: ChatRecorder
    params: SamplingParams
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: int = 0
    errors: list[str] = field(default_factory=list)
    context_full: bool = False


class DeadlineError(TimeoutError):
    """A call ran past the endpoint's ``deadline_s`` (the agent gets a 504)."""


def _request(body: Any, default_tokens: int) -> dict[str, Any]:
    """The options of a chat-completion request, checked (``ValueError`` naming the field)."""
    if not isinstance(body, dict):
        raise ValueError("body: expected a JSON object")
    n = body.get("n", 1) if body.get("n") is not None else 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
        raise ValueError(f"n: expected an int in [1, 64], got {n!r}")
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools: expected a list of {'type': 'function', 'function': {...}} objects")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ValueError(f"tool_choice: only 'auto' and 'none' are supported, got {choice!r}")
    want = body.get("max_completion_tokens") or body.get("max_tokens") or default_tokens
    return {
        "messages": body.get("messages") or [],
        "n": n,
        "tools": None if choice == "none" else tools,
        "max_tokens": int(want),
        "stream": bool(body.get("stream")),
    }


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address only this machine reaches (``localhost`` or a
    literal loopback IP); anything else (``0.0.0.0``, ``""``, a name, a LAN address) is not.

    >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("localhost"), is_loopback("0.0.0.0")
    (True, True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _choice(index: int, message: dict[str, Any], g: Generation) -> dict[str, Any]:
    finish = "tool_calls" if message.get("tool_calls") else g.finish_reason
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": None}


class AgentEndpoint:
    """An OpenAI-compatible HTTP endpoint on a thread of this process (module docstring).

    Args:
        engine: the rollout engine the calls go to (its thread-safe ``generate_one`` when it has
            one, else ``generate`` one call at a time).
        tokenizer: the policy's tokenizer.
        params: how every call samples (temperature, top-k, top-p: the trainer replays them,
            so the agent's own ``temperature`` / ``top_p`` are ignored); ``max_tokens`` caps the
            agent's ``max_tokens``.
        max_context: the longest prompt + answer of an episode (a call with no room left
            answers 400 and the episode is marked ``context_full``).
        chat_template: as :class:`ChatRecorder`.
        model_name: the model id ``/v1/models`` lists.
        host, port: where to listen (port 0: a free one).
        api_key: the bearer token every call must carry (``Authorization: Bearer <api_key>``,
            what the ``openai`` client sends as its ``api_key``); a call without it answers 401
            and records nothing. ``None``: on a loopback ``host`` no token is required; beyond
            loopback one is generated (``secrets.token_urlsafe(32)``) and the endpoint says so
            on stderr at start. The token is :attr:`api_key`; :func:`collect_agent_episodes`
            passes it to agents that take an ``api_key`` argument.
        deadline_s: the longest one call may take, waiting for the episode's previous call and
            generating; past it the call answers 504, the session records the error (the
            episode is dropped) and the engine's late answer is discarded. Socket reads and
            writes of a connection time out after it too.
        serve_unrecorded: also answer ``POST {url}/v1/chat/completions`` (no session): calls
            that are not recorded (evaluation, best-of-n sampling).

    ``base_url(session)`` is the address an agent gets (``http://host:port/s/<session>/v1``).

    **n > 1.** Inside a session a call must ask for one choice (``n > 1`` answers 400): a
    session records one conversation, and the reward an agent returns belongs to the path it
    continued, so the other choices would be turns without a reward. Unrecorded calls
    (``serve_unrecorded=True``) take ``n`` up to 64: ``n`` samples of the same prompt (sampling
    seeds ``seed, seed + 1, ...`` when ``params.seed`` is set), nothing recorded.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        params: SamplingParams,
        max_context: int = 1024,
        chat_template: bool | None = None,
        model_name: str = "rollkit",
        host: str = "127.0.0.1",
        port: int = 0,
        deadline_s: float = 300.0,
        serve_unrecorded: bool = False,
        api_key: str | None = None,
    ) -> None:
        if params.n != 1:
            raise ValueError(f"params.n: one answer per call, got {params.n}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s: expected > 0, got {deadline_s!r}")
        if api_key is not None:
            check_api_key(api_key)
        elif not is_loopback(host):
            api_key = secrets.token_urlsafe(32)
        #: the bearer token calls must carry (``None``: none required, a loopback endpoint)
        self.api_key: str | None = api_key
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.max_context, self.chat_template, self.model_name = int(max_context), chat_template, model_name
        self.deadline_s, self.serve_unrecorded = float(deadline_s), bool(serve_unrecorded)
        self._sessions: dict[str, _Session] = {}
        self._engine_lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._calls = ThreadPoolExecutor(max_workers=32, thread_name_prefix="rollkit-agent-call")
        self._httpd = ThreadingHTTPServer((host, port), _handler(self))
        self._httpd.daemon_threads = True
        self.host, self.port = host, int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="rollkit-agent-endpoint", daemon=True
        )
        self._thread.start()
        if self.api_key is not None and not is_loopback(host):
            print(
                f"rollkit: AgentEndpoint listens on {host or '0.0.0.0'}:{self.port}, beyond loopback: every "
                "call needs 'Authorization: Bearer <token>' (the token is AgentEndpoint.api_key; "
                "collect_agent_episodes passes it to agents that take an api_key argument)",
                file=sys.stderr,
                flush=True,
            )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def open_session(self, params: SamplingParams | None = None) -> str:
        """A new episode; returns its session id."""
        sid = uuid.uuid4().hex[:16]
        rec = ChatRecorder(self.tokenizer, chat_template=self.chat_template)
        self._sessions[sid] = _Session(rec, params or self.params)
        return sid

    def base_url(self, session: str) -> str:
        return f"{self.url}/s/{session}/v1"

    def close_session(self, session: str) -> _Session:
        return self._sessions.pop(session)

    def _generate(self, prompt_ids: list[int], params: SamplingParams, deadline: float) -> Generation:
        """One sample, or :class:`DeadlineError` at ``deadline`` (``time.monotonic()``)."""

        def run() -> Generation:
            one = getattr(self.engine, "generate_one", None)
            if callable(one):
                return one(prompt_ids, params)
            with self._engine_lock:
                return self.engine.generate([prompt_ids], params)[0]

        future = self._calls.submit(run)
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FuturesTimeout:
            future.cancel()
            raise DeadlineError(f"deadline: no answer within {self.deadline_s:g} s") from None

    def _prompt(self, rec: ChatRecorder, req: dict[str, Any]) -> tuple[list[int], list[int]]:
        with self._tok_lock:  # fast tokenizers are not safe to share across threads
            return rec.prompt(req["messages"], req["tools"])

    def chat(self, session: str | None, body: dict[str, Any]) -> dict[str, Any]:
        """Answer one chat-completion request of ``session`` (``None``: unrecorded); the
        handler calls :meth:`complete` and streams when asked."""
        return self.complete(session, body)[0]

    def complete(self, session: str | None, body: dict[str, Any]) -> tuple[dict[str, Any], list[Generation]]:
        """``(chat.completion object, the generations)`` of one request (see :meth:`chat`)."""
        deadline = time.monotonic() + self.deadline_s
        if session is None:
            return self._unrecorded(body, deadline)
        s = self._sessions.get(session)
        if s is None:
            raise KeyError(f"unknown session {session!r}")
        req = _request(body, s.params.max_tokens)
        if req["n"] != 1:
            raise ValueError(
                f"n: a recorded session answers one choice per call, got {req['n']} (n > 1 only on the "
                "endpoint's unrecorded route: AgentEndpoint(serve_unrecorded=True))"
            )
        if not s.lock.acquire(
            timeout=max(deadline - time.monotonic(), 0.0)
        ):  # one call of an episode at a time
            raise DeadlineError(
                f"deadline: the episode's previous call still ran after {self.deadline_s:g} s"
            )
        try:
            new_ids, prompt_ids = self._prompt(s.recorder, req)
            p = self._params(s, prompt_ids, req["max_tokens"], s.params)
            g = self._generate(prompt_ids, p, deadline)
            with self._tok_lock:
                s.recorder.record(req["messages"], new_ids, g)
            s.calls += 1
            message = s.recorder.replies[-1]
        finally:
            s.lock.release()
        return self._completion(prompt_ids, [message], [g]), [g]

    def _params(
        self, s: _Session | None, prompt_ids: list[int], want: int, params: SamplingParams
    ) -> SamplingParams:
        room = self.max_context - len(prompt_ids)
        if room < 1:
            if s is not None:
                s.context_full = True
            raise ValueError(
                f"context: the prompt has {len(prompt_ids)} tokens, max_context is {self.max_context}"
            )
        return dataclasses.replace(params, max_tokens=max(1, min(int(want), params.max_tokens, room)))

    def _unrecorded(self, body: dict[str, Any], deadline: float) -> tuple[dict[str, Any], list[Generation]]:
        if not self.serve_unrecorded:
            raise KeyError(
                "no session: use the base_url of a session (or AgentEndpoint(serve_unrecorded=True))"
            )
        req = _request(body, self.params.max_tokens)
        rec = ChatRecorder(self.tokenizer, chat_template=self.chat_template)
        _, prompt_ids = self._prompt(rec, req)
        p = self._params(None, prompt_ids, req["max_tokens"], self.params)
        gens = []
        for i in range(req["n"]):
            pi = p if p.seed is None else dataclasses.replace(p, seed=p.seed + i)
            gens.append(self._generate(prompt_ids, pi, deadline))
        with self._tok_lock:
            messages = [rec.reply(g) for g in gens]
        return self._completion(prompt_ids, messages, gens), gens

    def _completion(
        self, prompt_ids: list[int], messages: list[dict[str, Any]], gens: list[Generation]
    ) -> dict[str, Any]:
        n_out = sum(len(g.token_ids) for g in gens)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [_choice(i, m, g) for i, (m, g) in enumerate(zip(messages, gens))],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": n_out,
                "total_tokens": len(prompt_ids) + n_out,
            },
        }

    def stream_chunks(
        self, completion: dict[str, Any], gens: list[Generation], usage: bool = False
    ) -> list[dict[str, Any]]:
        """The ``chat.completion.chunk`` objects of a completion, OpenAI's streaming format: per
        choice a first chunk with the role, one content delta per token (the whole content in
        one delta when the choice calls tools, then one delta per tool call), a last chunk with
        the finish reason; with ``usage`` a final chunk with the token counts."""
        base = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return base | {
                "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}]
            }

        out = []
        for c, g in zip(completion["choices"], gens):
            i, msg = c["index"], c["message"]
            out.append(chunk(i, {"role": "assistant", "content": ""}))
            if msg.get("tool_calls"):
                if msg.get("content"):
                    out.append(chunk(i, {"content": msg["content"]}))
                for k, tc in enumerate(msg["tool_calls"]):
                    out.append(chunk(i, {"tool_calls": [{"index": k, **tc}]}))
            else:
                with self._tok_lock:
                    texts = [
                        self.tokenizer.decode(list(g.token_ids[: j + 1]), skip_special_tokens=True)
                        for j in range(len(g.token_ids))
                    ]
                prev = ""
                for t in texts:
                    if len(t) > len(prev) and t.startswith(prev):
                        out.append(chunk(i, {"content": t[len(prev) :]}))
                        prev = t
                if prev != (msg.get("content") or ""):  # decoding was not incremental: the rest at once
                    out.append(chunk(i, {"content": (msg.get("content") or "")[len(prev) :]}))
            out.append(chunk(i, {}, c["finish_reason"]))
        if usage:
            out.append(base | {"choices": [], "usage": completion["usage"]})
        return out

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._httpd.server_close()
        self._calls.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> AgentEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: the largest body a refused (401) call is read to its end (larger ones are left unread)
_DRAIN_LIMIT = 1 << 20


def _authorized(h: BaseHTTPRequestHandler, api_key: str | None) -> bool:
    """Whether a call may go on (no token required, or it carries the token); else it is answered
    401 (a JSON error and ``WWW-Authenticate: Bearer``) before anything reaches a session, so
    nothing is recorded."""
    if api_key is None or bearer_ok(h.headers.get("authorization"), api_key):
        return True
    try:  # read a small body, so that closing the socket does not reset the answer away
        length = int(h.headers.get("content-length") or 0)
        if 0 < length <= _DRAIN_LIMIT:
            h.rfile.read(length)
    except (ValueError, OSError):
        pass
    message = "unauthorized: this endpoint needs 'Authorization: Bearer <token>' (AgentEndpoint.api_key)"
    raw = json.dumps({"error": {"message": message, "type": "authentication_error", "code": 401}}).encode()
    h.close_connection = True
    h.send_response(401)
    for k, v in (("content-type", "application/json"), ("content-length", str(len(raw)))):
        h.send_header(k, v)
    h.send_header("www-authenticate", "Bearer")
    h.end_headers()
    h.wfile.write(raw)
    return False


def _handler(endpoint: AgentEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = endpoint.deadline_s  # socket reads / writes of one connection

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _send(self, code: int, data: dict[str, Any]) -> None:
            raw = json.dumps(data).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _stream(self, chunks: list[dict[str, Any]]) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("cache-control", "no-cache")
            self.send_header("connection", "close")
            self.end_headers()
            self.close_connection = True
            for c in chunks:
                self.wfile.write(b"data: " + json.dumps(c).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def _error(self, code: int, message: str) -> None:
            kind = {400: "invalid_request_error", 404: "not_found_error", 504: "timeout"}.get(
                code, "server_error"
            )
            self._send(code, {"error": {"message": message, "type": kind, "code": code}})

        def _session(self) -> tuple[str | None, str]:
            parts = self.path.split("?")[0].strip("/").split("/")
            if len(parts) >= 3 and parts[0] == "s":
                return parts[1], "/" + "/".join(parts[2:])
            return None, "/" + "/".join(parts)

        def do_GET(self) -> None:
            if not _authorized(self, endpoint.api_key):
                return
            _, route = self._session()
            if route == "/v1/models":
                model = {"id": endpoint.model_name, "object": "model", "owned_by": "rollkit"}
                return self._send(200, {"object": "list", "data": [model]})
            self._error(404, f"no route GET {route}")

        def _fail(self, sid: str | None, code: int, message: str) -> None:
            s = endpoint._sessions.get(sid) if sid is not None else None
            if s is not None:
                s.errors.append(message)
            self._error(code, message)

        def do_POST(self) -> None:
            if not _authorized(self, endpoint.api_key):
                return
            sid, route = self._session()
            if route != "/v1/chat/completions":
                return self._error(404, f"no route POST {self.path} (use the base_url of a session)")
            try:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                completion, gens = endpoint.complete(sid, body)
                if isinstance(body, dict) and body.get("stream"):
                    opts = body.get("stream_options") or {}
                    usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
                    return self._stream(endpoint.stream_chunks(completion, gens, usage))
                self._send(200, completion)
            except KeyError as e:
                self._error(404, str(e).strip("'\""))
            except DeadlineError as e:
                self._fail(sid, 504, str(e))
            except (ValueError, TypeError) as e:
                self._fail(sid, 400, str(e))
            except Exception as e:  # the engine failed: the agent sees a 500, the episode an error
                self._fail(sid, 500, f"{type(e).__name__}: {e}")

    return Handler


def _episode(
    uid: int, group: int, seed: int, s: _Session, reward: float | None, error: str | None
) -> EpisodeRecord:
    rec = s.recorder
    turns = list(rec.turns)
    status = "done" if error is None and turns else "error"
    if status == "done":
        turns[-1] = dataclasses.replace(turns[-1], reward=float(reward or 0.0))
    return EpisodeRecord(
        uid=uid,
        group=group,
        seed=seed,
        status=status,
        turns=turns,
        versions=list(rec.versions),
        observations=[m["content"] for m in rec.messages if m["role"] != "assistant"],
        actions=list(rec.texts),
        terminated=status == "done",
        context_full=s.context_full,
        error=error if error is not None else (None if turns else "the agent made no call"),
    )


def _takes_api_key(agent: Callable[..., Any]) -> bool:
    """Whether ``agent`` can be called with an ``api_key`` keyword argument."""
    try:
        params = inspect.signature(agent).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: called as before
        return False
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == "api_key" and p.kind is not p.POSITIONAL_ONLY) for p in params
    )


def collect_agent_episodes(
    endpoint: AgentEndpoint,
    agent: Agent,
    tasks: Sequence[Any],
    *,
    group_size: int = 1,
    params: SamplingParams | None = None,
    verifier: Callable[[Any, list[str]], float] | None = None,
    max_workers: int = 8,
) -> EpisodeBatch:
    """Play ``group_size`` episodes of each task with ``agent`` through ``endpoint``.

    Each episode runs ``agent(endpoint.base_url(session), task)`` on a thread (with
    ``api_key=endpoint.api_key`` when the endpoint requires a token and the agent takes an
    ``api_key`` argument, or ``**kwargs``: give it to the ``openai`` client); its reward is
    what the agent returns (a number or a bool), or ``verifier(task, answers)`` when given (the
    texts of rollkit's answers). The reward goes on the last turn. An episode whose agent raised
    or made no call is dropped (``agent/errors``); the kept ones are grouped by task
    (``group_ids``), as the agentic loop's estimators expect. ``params``: sampling for these
    episodes instead of the endpoint's (e.g. greedy evaluation).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    jobs = [(g, j, endpoint.open_session(params)) for g in range(len(tasks)) for j in range(group_size)]
    extra = {"api_key": endpoint.api_key} if endpoint.api_key is not None and _takes_api_key(agent) else {}

    def play(job: tuple[int, int, str]) -> tuple[float | None, str | None]:
        g, _, sid = job
        try:
            out = agent(endpoint.base_url(sid), tasks[g], **extra)
            if verifier is not None:
                out = verifier(tasks[g], list(endpoint._sessions[sid].recorder.texts))
            return float(out), None
        except Exception as e:  # an agent's failure is the episode's, not the collection's
            return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rollkit-agent") as pool:
        results = list(pool.map(play, jobs))
    episodes, group_ids = [], []
    for uid, ((g, _, sid), (reward, error)) in enumerate(zip(jobs, results)):
        rec = _episode(uid, g, g, endpoint.close_session(sid), reward, error)
        if rec.status == "done":
            episodes.append(rec)
            group_ids.append(g)
    n = max(len(episodes), 1)
    metrics = {
        "agent/episodes": float(len(episodes)),
        "agent/errors": float(len(jobs) - len(episodes)),
        "agent/success_rate": sum(e.success for e in episodes) / n,
        "agent/reward_mean": sum(e.total_reward for e in episodes) / n,
        "agent/turns_mean": sum(len(e.turns) for e in episodes) / n,
        "time/agent_s": time.perf_counter() - t0,
    }
    return EpisodeBatch(episodes, group_ids, {g: g for g in range(len(tasks))}, metrics)

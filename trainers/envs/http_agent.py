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
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rollkit.trajectory import Turn
from trainers.engines.base import Generation, SamplingParams
from trainers.envs.base import stable_state_id
from trainers.envs.episodes import EpisodeBatch, EpisodeRecord

__all__ = ["AgentEndpoint", "ChatDriftError", "ChatRecorder", "collect_agent_episodes"]

Agent = Callable[[str, Any], Any]


class ChatDriftError(ValueError):
    """The agent sent a conversation that does not extend the one rollkit recorded."""


def _message(m: Any) -> dict[str, str]:
    if not isinstance(m, dict) or "role" not in m:
        raise ValueError(f"messages: each message needs a role and content, got {m!r}")
    content = m.get("content") or ""
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {"role": str(m["role"]), "content": str(content)}


class ChatRecorder:
    """One episode's conversation in token space (module docstring).

    Args:
        tokenizer: the policy's tokenizer.
        chat_template: use the tokenizer's chat template (``None``: when it has one); without
            it the conversation is ``"role: content\\n"`` lines and the generation prompt is
            ``"assistant: "``.

    :meth:`prompt` gives the token ids of the next call's prompt and :meth:`record` stores the
    sampled answer; ``turns`` are the episode's :class:`~rollkit.trajectory.Turn` s.
    """

    def __init__(self, tokenizer: Any, *, chat_template: bool | None = None) -> None:
        self.tokenizer = tokenizer
        has = bool(getattr(tokenizer, "chat_template", None))
        if chat_template and not has:
            raise ValueError("chat_template: the tokenizer has no chat template")
        self.chat_template = has if chat_template is None else bool(chat_template)
        self.messages: list[dict[str, str]] = []  # the conversation so far, rollkit's answers included
        self.context: list[int] = []  # its token ids
        self.turns: list[Turn] = []
        self.versions: list[int] = []
        self.texts: list[str] = []
        self._closing = self._closing_text()

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def render(self, messages: Sequence[dict[str, str]], generation_prompt: bool) -> str:
        """The conversation as text (the chat template, or the plain format)."""
        if self.chat_template:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation_prompt
            )
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if generation_prompt else "")

    def _closing_text(self) -> str:
        """What the template writes after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        before = self.render([{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}], False)
        return before[before.rindex("A") + 1 :]

    def prompt(self, messages: Sequence[Any]) -> tuple[list[int], list[int]]:
        """``(new_ids, prompt_ids)`` of a call with ``messages``: the first call renders the
        whole conversation; a later one must extend the recorded conversation (raises
        :class:`ChatDriftError` otherwise) and only its new messages are encoded."""
        msgs = [_message(m) for m in messages]
        if not msgs:
            raise ValueError("messages: at least one message is needed")
        if not self.turns:
            new = self._encode(self.render(msgs, True))
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
        before = self.render(self.messages, False)
        after = self.render(msgs, True)
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

    def record(self, messages: Sequence[Any], new_ids: list[int], g: Generation) -> str:
        """Store the answer ``g`` to a call whose prompt :meth:`prompt` gave; returns its text."""
        text = self.tokenizer.decode(list(g.token_ids), skip_special_tokens=True)
        msgs = [_message(m) for m in messages]
        state = stable_state_id(tuple((m["role"], m["content"]) for m in msgs))
        self.turns.append(Turn(list(new_ids), list(g.token_ids), list(g.logprobs), state_id=state))
        self.versions.append(int(g.policy_version))
        self.context = self.context + list(new_ids) + list(g.token_ids)
        self.messages = [*msgs, {"role": "assistant", "content": text}]
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

    ``base_url(session)`` is the address an agent gets (``http://host:port/s/<session>/v1``).
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
    ) -> None:
        if params.n != 1:
            raise ValueError(f"params.n: one answer per call, got {params.n}")
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.max_context, self.chat_template, self.model_name = int(max_context), chat_template, model_name
        self._sessions: dict[str, _Session] = {}
        self._engine_lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((host, port), _handler(self))
        self._httpd.daemon_threads = True
        self.host, self.port = host, int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="rollkit-agent-endpoint", daemon=True
        )
        self._thread.start()

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

    def _generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        one = getattr(self.engine, "generate_one", None)
        if callable(one):
            return one(prompt_ids, params)
        with self._engine_lock:
            return self.engine.generate([prompt_ids], params)[0]

    def chat(self, session: str, body: dict[str, Any]) -> dict[str, Any]:
        """Answer one chat-completion request of ``session`` (the endpoint's handler calls this)."""
        s = self._sessions.get(session)
        if s is None:
            raise KeyError(f"unknown session {session!r}")
        if body.get("stream"):
            raise ValueError("stream: streaming answers are not supported; set stream=false")
        if body.get("n", 1) != 1:
            raise ValueError(f"n: one answer per call, got {body.get('n')}")
        want = body.get("max_completion_tokens") or body.get("max_tokens") or s.params.max_tokens
        with s.lock:  # one call of an episode at a time
            with self._tok_lock:  # fast tokenizers are not safe to share across threads
                new_ids, prompt_ids = s.recorder.prompt(body.get("messages") or [])
            room = self.max_context - len(prompt_ids)
            if room < 1:
                s.context_full = True
                raise ValueError(
                    f"context: the prompt has {len(prompt_ids)} tokens, max_context is {self.max_context}"
                )
            p = dataclasses.replace(s.params, max_tokens=max(1, min(int(want), s.params.max_tokens, room)))
            g = self._generate(prompt_ids, p)
            with self._tok_lock:
                text = s.recorder.record(body["messages"], new_ids, g)
            s.calls += 1
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": g.finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(g.token_ids),
                "total_tokens": len(prompt_ids) + len(g.token_ids),
            },
        }

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._httpd.server_close()

    def __enter__(self) -> AgentEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _handler(endpoint: AgentEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _send(self, code: int, data: dict[str, Any]) -> None:
            raw = json.dumps(data).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _error(self, code: int, message: str) -> None:
            kind = {400: "invalid_request_error", 404: "not_found_error"}.get(code, "server_error")
            self._send(code, {"error": {"message": message, "type": kind, "code": code}})

        def _session(self) -> tuple[str | None, str]:
            parts = self.path.split("?")[0].strip("/").split("/")
            if len(parts) >= 3 and parts[0] == "s":
                return parts[1], "/" + "/".join(parts[2:])
            return None, "/" + "/".join(parts)

        def do_GET(self) -> None:
            _, route = self._session()
            if route == "/v1/models":
                model = {"id": endpoint.model_name, "object": "model", "owned_by": "rollkit"}
                return self._send(200, {"object": "list", "data": [model]})
            self._error(404, f"no route GET {route}")

        def do_POST(self) -> None:
            sid, route = self._session()
            if route != "/v1/chat/completions" or sid is None:
                return self._error(404, f"no route POST {self.path} (use the base_url of a session)")
            try:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                self._send(200, endpoint.chat(sid, body))
            except KeyError as e:
                self._error(404, str(e).strip("'\""))
            except (ValueError, TypeError) as e:
                s = endpoint._sessions.get(sid)
                if s is not None:
                    s.errors.append(str(e))
                self._error(400, str(e))
            except Exception as e:  # the engine failed: the agent sees a 500, the episode an error
                s = endpoint._sessions.get(sid)
                if s is not None:
                    s.errors.append(f"{type(e).__name__}: {e}")
                self._error(500, f"{type(e).__name__}: {e}")

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

    Each episode runs ``agent(endpoint.base_url(session), task)`` on a thread; its reward is
    what the agent returns (a number or a bool), or ``verifier(task, answers)`` when given (the
    texts of rollkit's answers). The reward goes on the last turn. An episode whose agent raised
    or made no call is dropped (``agent/errors``); the kept ones are grouped by task
    (``group_ids``), as the agentic loop's estimators expect. ``params``: sampling for these
    episodes instead of the endpoint's (e.g. greedy evaluation).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    jobs = [(g, j, endpoint.open_session(params)) for g in range(len(tasks)) for j in range(group_size)]

    def play(job: tuple[int, int, str]) -> tuple[float | None, str | None]:
        g, _, sid = job
        try:
            out = agent(endpoint.base_url(sid), tasks[g])
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

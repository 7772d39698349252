"""OpenAI function calling, streaming and n > 1 through :class:`AgentEndpoint`, with the real
``openai`` client.

A random tiny model does not write valid tool calls, so the round trip uses
:class:`ScriptedEngineTestDouble`: a rollout engine that answers each call with the next
scripted text (tokenised, plus ``<|im_end|>``), a test double of the *model's text only*; the
endpoint, the chat template, the recorder, the tools (the Python tool in the real sandbox) and
the client are real. Streaming and ``n > 1`` run a real tiny Qwen2 on the transformers engine.
The tokenizer is SmolLM2's (ChatML tokens) with Qwen2.5-Instruct's chat template, which renders
``tools`` and ``<tool_call>`` blocks; SmolLM2's own template has no tool support.
"""

import json
import os
import threading
import time
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytest.importorskip("transformers")
pytest.importorskip("openai")

import httpx
import openai

from rollkit.trajectory import build_trajectory
from trainers.engines import Generation, HFRolloutEngine, SamplingParams
from trainers.envs.http_agent import AgentEndpoint, collect_agent_episodes
from trainers.envs.tools import ToolRegistry, python_tool
from trainers.models import char_tokenizer, default_model_path, tiny_qwen2

warnings.filterwarnings("ignore", message="trainers.rewards.sandbox")

#: Qwen2.5-Instruct's chat template (tool calling), verbatim
QWEN2_5_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- else %}\n'
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n'
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)


class ScriptedEngineTestDouble:
    """TEST DOUBLE of the model's text only: answers call k with ``script[k]`` (+ ``<|im_end|>``),
    log-probs 0; records the prompt ids it was given. ``delay_s`` makes it slow."""

    def __init__(self, tok, script, delay_s=0.0):
        self.tok, self.script, self.delay_s = tok, list(script), delay_s
        self.prompts = []
        self.lock = threading.Lock()

    def generate_one(self, prompt_ids, params):
        time.sleep(self.delay_s)
        with self.lock:
            text = self.script[len(self.prompts) % len(self.script)]
            self.prompts.append(list(prompt_ids))
        ids = [
            *self.tok(text, add_special_tokens=False).input_ids,
            self.tok.convert_tokens_to_ids("<|im_end|>"),
        ]
        return Generation(0, list(prompt_ids), ids, [0.0] * len(ids), "stop")


def call(code):
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def qwen_tok():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    tok.chat_template = QWEN2_5_TEMPLATE
    return tok


#: The looping program is stopped by its CPU limit (2 CPU-seconds: RLIMIT_CPU, whatever the
#: machine's load), not by the wall clock: a wall-clock limit that the programs which must finish
#: are sure to meet is one that a loaded machine can still miss (at load 12-16 on 2 cores, printing
#: one line took over 10 s); 120 s of wall clock only bounds a starved run.
TOOLS = ToolRegistry([python_tool(timeout_s=120.0, cpu_s=2)])
CPU_LIMIT = "error: the program was killed (killed by SIG"


def tool_agent(base_url, task, *, stream=False, api_key="unused"):
    """An agent with the openai client: sends the tools, runs every tool call the model makes
    with the registry (errors and timeouts are tool messages), stops at an answer without calls.
    ``api_key``: the endpoint's token, when it requires one."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=60, max_retries=0)
    messages = [{"role": "user", "content": task}]
    for _ in range(6):
        kw = dict(model="rollkit", messages=messages, tools=TOOLS.schemas(), max_tokens=64)
        msg = collect_stream(client.chat.completions.create(stream=True, **kw)) if stream else None
        if msg is None:
            msg = client.chat.completions.create(**kw).choices[0].message.model_dump(exclude_none=True)
        messages.append(msg)
        if not msg.get("tool_calls"):
            return messages
        for c in msg["tool_calls"]:
            r = TOOLS.call(c["function"]["name"], c["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": r.content})
    return messages


def collect_stream(stream):
    """The assistant message put together from streamed chunks."""
    content, calls = "", {}
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                calls[tc.index] = {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
    msg = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    return msg


SCRIPT = [
    "Let me divide." + call("print(1 / 0)"),
    call("while True: pass"),
    "Now the product.\n" + call("print(347 * 1289)"),
    "The answer is 447283.",
]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_is_token_exact(qwen_tok, stream):
    """tools -> tool_calls -> tool messages (an error, a program stopped by its CPU limit, a
    result) -> final answer.
    The streamed variant runs on an endpoint bound beyond loopback: its token reaches the agent
    through ``collect_agent_episodes`` and every streamed call carries it."""
    engine = ScriptedEngineTestDouble(qwen_tok, SCRIPT)
    params = SamplingParams(temperature=1.0, max_tokens=64, seed=0)
    host = "0.0.0.0" if stream else "127.0.0.1"
    with AgentEndpoint(engine, qwen_tok, params=params, max_context=2048, host=host) as ep:
        assert (ep.api_key is not None) == stream
        seen = []

        def agent(url, task, api_key="unused"):
            seen.append(tool_agent(url, task, stream=stream, api_key=api_key))
            return 1.0 if "447283" in (seen[-1][-1].get("content") or "") else 0.0

        batch = collect_agent_episodes(ep, agent, ["What is 347 * 1289?"])
    assert batch.metrics["agent/errors"] == 0
    msgs = seen[0]
    assert [m["role"] for m in msgs] == ["user"] + ["assistant", "tool"] * 3 + ["assistant"]
    assert msgs[1]["content"] == "Let me divide." and msgs[5]["content"] == "Now the product."
    assert msgs[3].get("content") is None
    assert json.loads(msgs[1]["tool_calls"][0]["function"]["arguments"]) == {"code": "print(1 / 0)"}
    error, stopped, result = [m["content"] for m in msgs if m["role"] == "tool"]
    assert (error, result) == ("error: ZeroDivisionError: division by zero", "447283")
    assert stopped.startswith(CPU_LIMIT) and "RLIMIT_CPU" in stopped, stopped
    assert msgs[-1].get("content") == "The answer is 447283." and "tool_calls" not in msgs[-1]
    # the first prompt is the template's rendering with the tools
    first = qwen_tok.apply_chat_template(
        msgs[:1], tools=TOOLS.schemas(), add_generation_prompt=True, tokenize=False
    )
    assert engine.prompts[0] == qwen_tok(first, add_special_tokens=False).input_ids
    assert '"name": "python"' in first
    (e,) = batch.episodes
    assert len(e.turns) == 4 and e.turns[-1].reward == 1.0
    for k in range(1, 4):  # each prompt extends the previous prompt + the model's own tokens
        prev = engine.prompts[k - 1] + list(e.turns[k - 1].action_ids)
        assert engine.prompts[k][: len(prev)] == prev
    traj = build_trajectory(e.turns)
    assert traj.input_ids.tolist() == engine.prompts[-1] + list(e.turns[-1].action_ids)
    obs = qwen_tok.decode(list(e.turns[2].obs_ids))  # the tool's answer, as the template wraps it
    assert f"<tool_response>\n{stopped}\n</tool_response>" in obs


def test_tools_need_a_template_with_tool_support():
    from transformers import AutoTokenizer

    smol = AutoTokenizer.from_pretrained(default_model_path())  # ChatML without tools
    char = char_tokenizer()  # no chat template at all
    for tok, why in ((smol, "does not render tools"), (char, "has no chat template")):
        engine = ScriptedEngineTestDouble(smol, ["x"])
        with AgentEndpoint(engine, tok, params=SamplingParams(max_tokens=8)) as ep:
            client = openai.OpenAI(
                base_url=ep.base_url(ep.open_session()), api_key="x", max_retries=0, timeout=30
            )
            with pytest.raises(openai.BadRequestError, match=why):
                client.chat.completions.create(
                    model="rollkit", messages=[{"role": "user", "content": "hi"}], tools=TOOLS.schemas()
                )
        assert engine.prompts == []


def test_deadline_answers_504_and_the_episode_is_dropped(qwen_tok):
    engine = ScriptedEngineTestDouble(qwen_tok, ["late"], delay_s=3.0)
    with AgentEndpoint(engine, qwen_tok, params=SamplingParams(max_tokens=8), deadline_s=0.5) as ep:
        sid = ep.open_session()
        client = openai.OpenAI(base_url=ep.base_url(sid), api_key="x", max_retries=0, timeout=30)
        t0 = time.perf_counter()
        with pytest.raises(openai.InternalServerError, match="deadline"):
            client.chat.completions.create(model="rollkit", messages=[{"role": "user", "content": "hi"}])
        assert time.perf_counter() - t0 < 2.5
        s = ep.close_session(sid)
    assert s.errors and "deadline" in s.errors[0] and s.recorder.turns == []


@pytest.fixture(scope="module")
def tiny():
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0, hidden_size=64, heads=2, kv_heads=1)
    return tok, HFRolloutEngine(model, tok)


def test_streaming_matches_the_plain_answer_and_ends_with_done(tiny):
    tok, engine = tiny
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    msgs = [{"role": "user", "content": "Q 3*7"}]
    with AgentEndpoint(engine, tok, params=params) as ep:
        plain_sid, stream_sid, raw_sid = ep.open_session(), ep.open_session(), ep.open_session()
        plain = openai.OpenAI(base_url=ep.base_url(plain_sid), api_key="x", max_retries=0, timeout=60)
        want = plain.chat.completions.create(model="rollkit", messages=msgs).choices[0]
        streamed = openai.OpenAI(base_url=ep.base_url(stream_sid), api_key="x", max_retries=0, timeout=60)
        chunks = list(
            streamed.chat.completions.create(
                model="rollkit", messages=msgs, stream=True, stream_options={"include_usage": True}
            )
        )
        with httpx.Client(timeout=60) as http:
            raw = http.post(
                ep.base_url(raw_sid) + "/chat/completions",
                json={"model": "rollkit", "messages": msgs, "stream": True},
            )
        recorded = ep.close_session(stream_sid).recorder
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.message.content and len(text) > 1
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # more than one delta
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [want.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(recorded.turns[0].action_ids)
    assert recorded.texts == [want.message.content]  # a streamed call is recorded like any other
    assert raw.headers["content-type"] == "text/event-stream"
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_n_choices_refused_in_a_session_served_unrecorded(tiny):
    tok, engine = tiny
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
    msgs = [{"role": "user", "content": "Q 3*7"}]
    with AgentEndpoint(engine, tok, params=params, serve_unrecorded=True) as ep:
        sid = ep.open_session()
        client = openai.OpenAI(base_url=ep.base_url(sid), api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="one choice per call"):
            client.chat.completions.create(model="rollkit", messages=msgs, n=3)
        assert ep.close_session(sid).recorder.turns == []
        root = openai.OpenAI(base_url=ep.url + "/v1", api_key="x", max_retries=0, timeout=60)
        out = root.chat.completions.create(model="rollkit", messages=msgs, n=3)
        again = root.chat.completions.create(model="rollkit", messages=msgs, n=3)
        streamed = list(root.chat.completions.create(model="rollkit", messages=msgs, n=2, stream=True))
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) > 1  # seeds 0, 1, 2
    assert texts == [c.message.content for c in again.choices]  # seeded: reproducible
    by_index = {0: "", 1: ""}
    for c in streamed:
        for ch in c.choices:
            by_index[ch.index] += ch.delta.content or ""
    assert [by_index[0], by_index[1]] == texts[:2]
    with AgentEndpoint(engine, tok, params=params) as ep:  # unrecorded calls are opt-in
        root = openai.OpenAI(base_url=ep.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.NotFoundError, match="no session"):
            root.chat.completions.create(model="rollkit", messages=msgs)

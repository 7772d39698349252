"""Tools: the registry (errors and timeouts are answers, never exceptions), the Python tool in
rollkit's real sandbox (runs code, times out, no files, no network), the python-tool
environment, and GEM's ToolEnvWrapper with the sandboxed Python tool."""

import socket
import threading
import warnings

import pytest

from trainers.envs.python_tool_env import PythonToolEnv, number_words
from trainers.envs.registry import make_env
from trainers.envs.tools import Tool, ToolRegistry, parse_tool_calls, python_tool
from trainers.rewards.sandbox import bwrap_status

warnings.filterwarnings("ignore", message="trainers.rewards.sandbox")
needs_bwrap = pytest.mark.skipif(not bwrap_status()[0], reason="bubblewrap is not usable here")

ADD = Tool(
    "add",
    "Add two integers.",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    lambda a, b: a + b,
)


def test_registry_answers_every_failure_as_text():
    def boom():
        raise RuntimeError("kaput")

    release, finished = threading.Event(), threading.Event()

    def blocked():  # runs until the test releases it (at most 120 s)
        release.wait(120)
        finished.set()

    slow = Tool("slow", "sleeps", {"type": "object"}, blocked, timeout_s=0.3)
    reg = ToolRegistry([ADD, slow, Tool("boom", "raises", {"type": "object"}, boom)])
    assert reg.schemas()[0] == {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers.", "parameters": dict(ADD.parameters)},
    }
    assert reg.call("add", '{"a": 2, "b": 3}').content == "5"
    cases = [
        ("add", '{"a": 2', "bad_arguments", "error: arguments are not valid JSON"),
        ("add", {"a": 2}, "bad_arguments", "error: missing required argument 'b'"),
        ("add", {"a": 2, "b": "3"}, "bad_arguments", "error: argument 'b': expected integer, got str"),
        ("add", {"a": 2, "b": 3, "c": 1}, "bad_arguments", "error: unknown argument 'c'"),
        ("add", {"a": True, "b": 3}, "bad_arguments", "error: argument 'a': expected integer, got bool"),
        ("nope", {}, "unknown_tool", "error: unknown tool 'nope' (tools: add, slow, boom)"),
        ("boom", None, "exception", "error: RuntimeError: kaput"),
    ]
    for name, args, kind, text in cases:
        r = reg.call(name, args)
        assert not r.ok and r.error == kind and r.content.startswith(text), (name, args, r)
    r = reg.call("slow", {})
    # the answer came while the tool was still running: at the deadline, not at the tool's end
    assert not finished.is_set()
    assert (r.ok, r.error, r.content) == (False, "timeout", "error: tool 'slow' timed out after 0.3 s")
    release.set()
    with pytest.raises(ValueError, match="already registered"):
        reg.register(ADD)
    with pytest.raises(ValueError, match="parameters"):
        Tool("x", "", {"type": "string"}, print)


def test_parse_tool_calls_in_both_formats():
    text = (
        'a <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> b\n'
        "```python\nprint(1)\n```\n<tool_call>not json</tool_call>"
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("python", {"code": "print(1)\n"}),
        ("", "not json"),
        ("add", {"a": 1}),  # arguments as a JSON string; a block left open at the end counts
    ]
    assert [c.id for c in calls] == ["call_0", "call_1", "call_2", "call_3"]
    assert parse_tool_calls("no call") == []


def test_python_tool_runs_in_the_sandbox_and_reports_errors_and_timeouts():
    reg = ToolRegistry([python_tool(timeout_s=60.0)])  # the programs that end: a deadline never reached
    assert reg.call("python", {"code": "print(347 * 1289)"}).content == "447283"
    assert reg.call("python", {"code": "x = 1"}).content == "(no output)"
    r = reg.call("python", {"code": "print('partial')\nraise ValueError('bad input')"})
    assert (r.ok, r.error, r.content) == (False, "error", "partial\nerror: ValueError: bad input")
    # the sandbox's own timeout answers, not the registry's (3 + 5 s for the sandbox's start)
    r = ToolRegistry([python_tool(timeout_s=3.0)]).call("python", {"code": "while True: pass"})
    assert (r.ok, r.error, r.content) == (False, "timeout", "error: the program timed out after 3 s")
    r = reg.call("python", {"code": "x = bytearray(2**31)"})
    assert not r.ok and "MemoryError" in r.content
    with pytest.raises(TypeError):
        python_tool(timeout_s=1.0, memry_mb=10)  # a misspelt sandbox option fails when built


@needs_bwrap
def test_python_tool_cannot_write_files_or_reach_the_network(tmp_path):
    reg = ToolRegistry([python_tool(timeout_s=60.0, isolation="bwrap")])  # they all end: never reached
    target = tmp_path / "written.txt"
    r = reg.call("python", {"code": f"open({str(target)!r}, 'w').write('x')\nprint('wrote')"})
    assert not r.ok and "No such file or directory" in r.content and not target.exists()
    r = reg.call("python", {"code": "print(open('/etc/passwd').read())"})
    assert not r.ok and "root:" not in r.content
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    )
    r = reg.call("python", {"code": code})
    assert (
        not r.ok and "connected" not in r.content and ("refused" in r.content or "unreachable" in r.content)
    )
    # the program has ended: a connection it made would wait in the listener's queue now
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()


#: the sandbox's wall-clock limit where a test runs both a program that must finish and one that
#: loops: the interpreter's start counts, and on a loaded 2-core machine (load 12) printing one
#: line took over 3 s; the looping program then waits this long
TOOL_TIMEOUT_S = 10.0


def test_python_tool_env_episode():
    env = make_env("python-tool", tool_timeout_s=TOOL_TIMEOUT_S)
    assert isinstance(env, PythonToolEnv)
    obs, info = env.reset(seed=3)
    a, b = env.operands
    assert info["answer"] == a * b and f"{a}" in obs and f"{b}" in obs and "```python" in obs
    obs, r, term, trunc, info = env.step(f"Let me compute.\n```python\nprint({a} * {b})\n```")
    assert (obs, r, term, trunc) == (f"<result>{a * b}</result>", 0.0, False, False)
    call = '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>'
    obs, r, term, trunc, info = env.step(call)
    assert obs == "<result>error: the program timed out after 10 s</result>" and info["tool_errors"] == [
        "timeout"
    ]
    assert not term and not trunc
    assert env.step(f"\\boxed{{{a * b:,}}}")[1:3] == (1.0, True)  # thousands separators are fine
    env.reset(seed=3)
    assert env.step("\\boxed{12}")[1:3] == (0.0, True)
    env.reset(seed=3)
    obs, r, term, _, _ = env.step("I think it is big.")
    assert r < 0 and term and "no ```python block" in obs
    env.reset(seed=3)
    obs, *_ = env.step('<tool_call>{"name": "calc", "arguments": {}}</tool_call>')
    assert obs == "<result>error: unknown tool 'calc' (tools: python)</result>"
    obs, _, _, trunc, _ = env.step("```python\nprint(1)\n```")
    assert obs == "<result>1</result>"
    assert env.step("```python\nprint(2)\n```")[3]  # truncated after max_turns (3)
    assert env.state_key() == ("python-tool", env.question, env.results)


def test_python_tool_env_random_actions_are_well_formed_and_words_mode():
    env = PythonToolEnv(ops=("mul", "add", "sub"), words=True)
    seen = set()
    for seed in range(20):
        env.reset(seed=seed)
        assert not any(ch.isdigit() for ch in env.question)
        for _ in range(3):
            act = env.sample_random_action()
            assert parse_tool_calls(act) or act.startswith("\\boxed{")
            seen.add(act[:5])
    assert seen == {"```py", "\\boxe"}
    assert number_words(1289) == "one thousand two hundred eighty-nine"
    with pytest.raises(ValueError, match="ops"):
        PythonToolEnv(ops=("div",))


def test_gem_tool_env_wrapper_runs_python_in_rollkits_sandbox():
    pytest.importorskip("gem")
    env = make_env("gem:rg:products", tools=["python"], tool_options={"timeout_s": TOOL_TIMEOUT_S})
    obs, _ = env.reset(seed=0)
    assert "```python" in obs  # GEM's own tool instruction
    obs, r, term, _, info = env.step("```python\nprint(6 * 2)\n```")
    assert obs.startswith("Code execution result: 12") and not term and info["tool_type"] == "python_code"
    obs, *_ = env.step("<python>while True: pass</python>")
    assert obs == "Code execution result: error: the program timed out after 10 s\n"
    obs, r, term, *_ = env.step("\\boxed{12}")
    assert (r, term) == (1.0, True)
    with pytest.raises(ValueError, match=r"search.*network"):
        make_env("gem:rg:products", tools=["search"])

"""trainers.rewards.code: code extraction, test formats, the verifier, HumanEval, timeout policies."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainers.data import Prompt
from trainers.rewards import get_verifier
from trainers.rewards.code import (
    CodeProblem,
    CodeVerifier,
    StdioCase,
    build_program,
    extract_code,
    humaneval_path,
    humaneval_prompts,
    load_humaneval,
    outputs_match,
    run_tests,
)

pytestmark = pytest.mark.filterwarnings("ignore:trainers.rewards.sandbox:RuntimeWarning")

ADD = CodeProblem("add", stdio=(StdioCase("2 3\n", "5\n"), StdioCase("10 -1\n", "9"), StdioCase("0 0", "0")))
ADD_CODE = "a, b = map(int, input().split())\nprint(a + b)\n"
SQUARE = CodeProblem(
    "square",
    assert_tests="def check(f):\n    assert f(3) == 9\n    assert f(-2) == 4\n",
    entry_point="square",
    prefix="def square(x):\n",
)

code_text = st.text(st.characters(blacklist_characters="`", blacklist_categories=("Cs",)), max_size=200)


# ------------------------------------------------------------------ pure helpers (property tests)


@given(code_text, code_text, st.sampled_from(["python", "py", "Python", "python3"]))
def test_extract_last_python_block(code, prose, lang):
    body = code if code.endswith("\n") else code + "\n"
    text = f"{prose}\n```\nnot this\n```\n```{lang}\n{body}```\n{prose}"
    assert extract_code(text) == body


@given(code_text)
def test_extract_raw_text_without_fences(code):
    assert extract_code(code) == code


def test_extract_untagged_block_and_last_of_many():
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("```python\nold\n```\ntext\n```python\nnew\n```") == "new\n"
    assert extract_code("```bash\nls\n```\n```python\nx\n```\n```text\nout\n```") == "x\n"
    with pytest.raises(TypeError, match="completion"):
        extract_code(None)  # type: ignore[arg-type]


@given(
    st.lists(st.text(st.characters(blacklist_categories=("Cs", "Zl", "Zp", "Cc")), max_size=20), max_size=6)
)
def test_outputs_match_ignores_trailing_whitespace(lines):
    s = "\n".join(lines)
    padded = "\n".join(ln + " \t" for ln in lines) + "\n\n"
    assert outputs_match(padded, s)
    assert outputs_match(s, s)


def test_outputs_match_is_strict_on_content():
    assert (
        not outputs_match("5", "6") and not outputs_match("1 2", "1  2") and not outputs_match("a\nb", "ab")
    )


@given(
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20),
    st.lists(st.tuples(code_text, code_text), min_size=1, max_size=4),
)
def test_problem_json_round_trip(pid, cases):
    p = CodeProblem(pid, stdio=tuple(StdioCase(i, o) for i, o in cases))
    assert CodeProblem.from_json(p.to_json()) == p
    assert CodeProblem.from_json(SQUARE.to_json()) == SQUARE


def test_problem_validation():
    with pytest.raises(ValueError, match="exactly one"):
        CodeProblem("x")
    with pytest.raises(ValueError, match="exactly one"):
        CodeProblem("x", stdio=(StdioCase("", ""),), assert_tests="assert True")
    with pytest.raises(ValueError, match="problem_id"):
        CodeProblem("", assert_tests="assert True")
    with pytest.raises(ValueError, match="entry_point"):
        CodeProblem("x", assert_tests="assert True", entry_point="not an id")
    with pytest.raises(TypeError, match="StdioCase"):
        CodeProblem("x", stdio=(("in", "out"),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a code problem"):
        CodeProblem.from_json("42")
    with pytest.raises(ValueError, match="not a code problem"):
        CodeProblem.from_json('{"problem_id": "x"}')


def test_build_program_prefix_only_when_entry_point_missing():
    body = "    return x * x\n"
    assert build_program(body, SQUARE).startswith("def square(x):\n    return x * x\n")
    full = "def square(x):\n    return x ** 2\n"
    prog = build_program(full, SQUARE)
    assert prog.startswith(full) and prog.count("def square") == 1 and prog.rstrip().endswith("check(square)")
    assert build_program(ADD_CODE, ADD) == ADD_CODE


#: The deadline for programs that must finish (correct or wrong answers, never loops): it only
#: bounds a hang. 5 s failed under two busy processes beside the suite (a correct program scored
#: 0.0: its Python started too slowly), so it leaves a loaded machine room.
OK_S = 60.0


# ------------------------------------------------------------------ scoring in the sandbox


def test_stdio_all_and_fraction():
    v_all, v_frac = CodeVerifier(timeout_s=OK_S), CodeVerifier(mode="fraction", timeout_s=OK_S)
    assert v_all(f"```python\n{ADD_CODE}```", ADD) == 1.0
    half = "a, b = map(int, input().split())\nprint(a + b if a else 99)\n"
    assert v_all(half, ADD) == 0.0
    assert v_frac(half, ADD) == pytest.approx(2 / 3)
    assert v_all("", ADD) == 0.0 and v_all("   \n", ADD) == 0.0


def test_all_mode_stops_at_first_failure():
    rep = run_tests("print(0)", ADD, timeout_s=OK_S)
    assert rep.score == 0.0 and len(rep.results) == 1 and rep.total == 3
    rep = run_tests("print(0)", ADD, mode="fraction", timeout_s=OK_S)
    assert rep.passed == 1 and len(rep.results) == 3  # "0 0" -> "0" passes


def test_assert_style():
    v = CodeVerifier(timeout_s=OK_S)
    assert v("    return x * x\n", SQUARE) == 1.0
    assert v("```python\ndef square(x):\n    return abs(x) * abs(x)\n```", SQUARE) == 1.0
    assert v("    return x + x\n", SQUARE) == 0.0  # f(3) == 6
    assert v("    return x * x\nraise SystemExit(0)", SQUARE) == 1.0  # exiting before check: scored
    assert CodeVerifier(timeout_s=0.5)("    while True: pass\n", SQUARE) == 0.0


def test_prompt_answer_and_side_mapping():
    v = CodeVerifier(timeout_s=OK_S, problems={"add-problem": ADD})
    prompt = Prompt("Add two numbers read from stdin.", ADD.to_json(), "code")
    assert v(ADD_CODE, prompt) == 1.0  # a Prompt (RewardPool style)
    assert v(ADD_CODE, prompt.answer) == 1.0  # the answer string (sync trainer style)
    assert v(ADD_CODE, Prompt("Add.", "add-problem")) == 1.0  # key into the side mapping
    with pytest.raises(ValueError, match="not a code problem"):
        v(ADD_CODE, Prompt("a+b=", "5"))
    with pytest.raises(TypeError, match="prompt"):
        v(ADD_CODE, 5)


def test_bad_verifier_arguments():
    with pytest.raises(ValueError, match="mode"):
        CodeVerifier(mode="most")
    with pytest.raises(TypeError, match="timeout_policy"):
        CodeVerifier(timeout_policy=object())
    with pytest.raises(ValueError, match="mode"):
        run_tests(ADD_CODE, ADD, mode="any")


class RecordingPolicy:
    """Test double of a timeout *policy* (the interface under test): answers the timeouts ``ts``
    in turn, records the calls."""

    def __init__(self, *ts):
        self.ts, self.seen = list(ts), []

    def timeout(self, problem_id):
        return self.ts.pop(0)

    def observe(self, problem_id, run_seconds, *, correct):
        self.seen.append((problem_id, run_seconds, correct))


def test_timeout_policy_is_asked_and_told():
    # 60 s for the correct program (a loaded machine starts it slowly), then 0.5 s
    pol = RecordingPolicy(60.0, 0.5)
    v = CodeVerifier(timeout_s=120, timeout_policy=pol)
    assert v("    return x * x\n", SQUARE) == 1.0
    assert v("    import time; time.sleep(600)\n", SQUARE) == 0.0
    assert v.last_report.results[0].status == "timeout"  # the policy's 0.5 s, not timeout_s=120
    (p1, s1, c1), (p2, s2, c2) = pol.seen
    assert (p1, c1, p2, c2) == ("square", True, "square", False) and pol.ts == []
    assert 0 < s1 < 60 and 0.5 <= s2 < 60  # the run seconds: at least the deadline, far below 600


def test_adaptive_timeout_from_rollkit_scheduling():
    sched = pytest.importorskip(
        "rollkit.scheduling", reason="rollkit.scheduling (AdaptiveTimeout) not written yet"
    )
    # t_min 1 s: a correct run on a loaded machine must not time out once the policy adapted
    pol = sched.AdaptiveTimeout(lam=3.0, t_min=1.0, t_max=60.0)
    v = CodeVerifier(timeout_policy=pol)
    for _ in range(3):  # a few fast correct runs teach the policy this problem's run time
        assert v("    return x * x\n", SQUARE) == 1.0
    t = pol.timeout("square")
    assert t < 60.0 and t == max(1.0, 3.0 * pol.anchor("square"))
    assert v("    while True: pass\n", SQUARE) == 0.0
    assert v.last_report.max_run_s < 60.0  # the adapted timeout ended it, not t_max


# ------------------------------------------------------------------ HumanEval


def test_humaneval_loads_from_package_data():
    assert humaneval_path().name == "HumanEval.jsonl.gz"
    probs = load_humaneval()
    assert len(probs) == 164 and probs[0].problem_id == "HumanEval/0"
    assert all(p.entry_point and p.assert_tests and p.prefix and p.reference for p in probs)
    assert [p.problem_id for p in load_humaneval(ids=["HumanEval/5", "HumanEval/1"])] == [
        "HumanEval/5",
        "HumanEval/1",
    ]
    with pytest.raises(ValueError, match="unknown"):
        load_humaneval(ids=["HumanEval/999"])


IDS = ["HumanEval/0", "HumanEval/2", "HumanEval/10", "HumanEval/32", "HumanEval/53", "HumanEval/163"]


def test_humaneval_canonical_solutions_pass_and_wrong_fail():
    probs = load_humaneval(ids=IDS)
    prompts = humaneval_prompts(probs)
    v = CodeVerifier(timeout_s=OK_S)
    for p, prompt in zip(probs, prompts):
        assert prompt.text == p.prefix and prompt.data_source == "humaneval"
        assert v(p.reference, prompt) == 1.0, (p.problem_id, v.last_report)
        assert v("    return None\n", prompt) == 0.0, p.problem_id
    # a full solution in a fenced block (not a continuation) also scores
    p0 = probs[0]
    full = f"Here it is:\n```python\n{p0.prefix}{p0.reference}```"
    assert v(full, prompts[0]) == 1.0
    wrong = f"```python\nfrom typing import List\ndef {p0.entry_point}(numbers: List[float], threshold: float) -> bool:\n    return True\n```"
    assert v(wrong, prompts[0]) == 0.0


# ------------------------------------------------------------------ the W2 benchmark does not rot


@pytest.mark.slow
def test_bench_sandbox_tiny(capsys):
    import importlib.util
    import math
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_sandbox.py"
    spec = importlib.util.spec_from_file_location("_bench_sandbox", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    mod.main(
        ["--steps", "2", "--prompts", "2", "--group", "4", "--fixed", "1", "--t-min", "0.2", "--runs", "2"]
    )
    out = capsys.readouterr().out
    rows = {
        m.group(1): [float(x) for x in m.groups()[1:]]
        for m in re.finditer(r"^(fixed|adaptive)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$", out, re.M)
    }
    assert set(rows) == {"fixed", "adaptive"}, out
    assert rows["fixed"][2] == 1.0 and all(math.isfinite(v) and v > 0 for r in rows.values() for v in r)
    over = dict(re.findall(r"^(plain subprocess|rlimit fallback|bwrap)\s+[\d.]+\s+([\d.]+)x$", out, re.M))
    assert over["plain subprocess"] == "1.00" and "rlimit fallback" in over, out
    # the local policy implements the documented rule
    pol = mod.LocalAdaptiveTimeout(lam=2.0, t_min=0.5, t_max=3.0)
    assert pol.timeout("p") == 3.0
    pol.observe("p", 0.1, correct=False)
    assert pol.timeout("p") == 3.0
    pol.observe("p", 0.1, correct=True)
    assert pol.timeout("p") == 0.5
    pol.observe("p", 1.0, correct=True)
    assert pol.timeout("p") == 2.0
    pol.observe("p", 5.0, correct=True)
    assert pol.timeout("p") == 3.0


def test_verifier_checks_its_options_when_built():
    with pytest.raises(TypeError, match=r"sandbox options: unknown \['memroy_mb'\]"):
        CodeVerifier(memroy_mb=128)
    with pytest.raises(ValueError, match="timeout_s must be a positive finite number"):
        CodeVerifier(timeout_s=0)
    with pytest.raises(ValueError, match="isolation must be one of"):
        CodeVerifier(isolation="docker")
    with pytest.raises(ValueError, match="problems: a sequence must hold CodeProblems with distinct"):
        CodeVerifier(problems=[ADD, ADD])
    with pytest.raises(TypeError, match="problems must be a mapping or a sequence"):
        CodeVerifier(problems=3)


def test_verifier_by_name_with_a_problem_table():
    """``get_verifier("code", problems=[...])``: prompts whose answer is a problem id."""
    verify = get_verifier("code", problems=[ADD, SQUARE], timeout_s=OK_S, isolation="rlimit")
    assert isinstance(verify, CodeVerifier) and sorted(verify.problems) == ["add", "square"]
    assert verify(ADD_CODE, Prompt("add two numbers", "add")) == 1.0
    assert verify("    return x * x\n", Prompt("square it", "square")) == 1.0
    assert verify("print(5)", Prompt("add two numbers", "add")) == 0.0

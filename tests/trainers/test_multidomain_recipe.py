"""``recipes/rlvr_multidomain.py`` and ``recipes/evaluate.py`` end to end on the tiny Qwen2 (one
step, real verifiers: Math-Verify, the code sandbox, IFEval's checks), and their one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("math_verify")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))

import evaluate  # noqa: E402
import rlvr_multidomain  # noqa: E402

SMALL = {
    "arithmetic": {
        "task": "addition",
        "task_options": {"digits": 1},
        "verifier": "math_verify",
        "eval_size": 3,
    },
    "code": {"task": "functions", "verifier": "code", "eval_size": 2},
    "format": {"task": "formats", "verifier": "ifeval", "eval_size": 3, "weight": 2},
}
TINY = [
    "--model",
    "tiny",
    f"data.domains={json.dumps(SMALL)}",
    "rollout.prompts_per_step=4",
    "rollout.n=2",
    "rollout.max_tokens=4",
    "eval.max_tokens=4",
    "train.micro_batch_size=8",
    "reward.backend=inline",
    "logging.progress=false",
    "rollout.dtype=float32",
    "train.autocast=off",
]


def test_recipe_trains_one_step_with_three_domains(tmp_path, capsys):
    out = rlvr_multidomain.main([*TINY, "train.steps=1", f"logging.dir={tmp_path / 'run'}"])
    for d in SMALL:
        assert (
            f"eval/domain/{d}/accuracy" in out["eval_before"]
            and f"eval/domain/{d}/accuracy" in out["eval_after"]
        )
    rows = [json.loads(line) for line in Path(out["metrics_file"]).read_text().splitlines()]
    step = next(r for r in rows if "domain/code/reward" in r)
    # weights 1:1:2 of 4 prompts: 1 + 1 + 2 groups of 2 samples
    assert (
        step["domain/arithmetic/samples"],
        step["domain/code/samples"],
        step["domain/format/samples"],
    ) == (2, 2, 4)
    assert step["domain/code/reward_busy_s"] > 0  # the sandbox ran
    printed = capsys.readouterr().out
    assert "held-out accuracy per domain" in printed and "format" in printed


def test_evaluate_reports_pass_at_k_per_domain(tmp_path):
    path = tmp_path / "eval.json"
    m = evaluate.main([*TINY, "eval.n=3", "eval.k=[1, 3]", "--out", str(path)])
    assert json.loads(path.read_text()) == pytest.approx(m)
    for d in SMALL:
        assert 0.0 <= m[f"eval/domain/{d}/pass@1"] <= m[f"eval/domain/{d}/pass@3"] <= 1.0
        assert m[f"eval/domain/{d}/pass@1"] == pytest.approx(m[f"eval/domain/{d}/mean@1"])
    assert m["eval/prompts"] == 8


@pytest.mark.parametrize(
    "args, message",
    [
        (["rollout.engine=server"], r"^error: rollout\.engine='server': the evaluation runs hf or vllm"),
        (["eval.n=2", "eval.k=[3]"], r"^error: eval\.k: every k must be an int in \[1, eval\.n=2\]"),
        (
            ['data.domains={"a": {"task": "functions", "eval_size": 500}}'],
            r"^error: data\.domains\.a\.task_options: ",
        ),
    ],
)
def test_evaluate_errors_are_one_line(args, message):
    with pytest.raises(SystemExit, match=message):
        evaluate.main(["--model", "tiny", *args])

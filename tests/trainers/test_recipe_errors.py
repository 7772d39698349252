"""Bad command lines and data files: the recipes stop before any model loads, with one line that
names the field (or the file and line) and what was wrong; no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))

import rlvr_qwen  # noqa: E402


def _files(tmp: Path) -> dict[str, Path]:
    good = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    files = {
        "five": tmp / "five.jsonl",
        "empty": tmp / "empty.jsonl",
        "notjson": tmp / "notjson.jsonl",
        "int_prompt": tmp / "int_prompt.jsonl",
        "no_answer": tmp / "no_answer.jsonl",
        "list_line": tmp / "list_line.jsonl",
        "bad_parquet": tmp / "bad.parquet",
        "bad_yaml": tmp / "bad.yaml",
        "txt": tmp / "prompts.txt",
    }
    files["five"].write_text("\n".join(json.dumps(r) for r in good) + "\n")
    files["empty"].write_text("\n\n")
    files["notjson"].write_text(json.dumps(good[0]) + "\n{oops\n")
    files["int_prompt"].write_text(json.dumps({"prompt": 5, "answer": "5"}) + "\n")
    files["no_answer"].write_text(json.dumps({"prompt": "1+1="}) + "\n")
    files["list_line"].write_text(json.dumps(good[0]) + "\n[1, 2]\n")
    files["bad_parquet"].write_bytes(b"PAR1 this is not parquet")
    files["bad_yaml"].write_text("train: [unclosed\n")
    files["txt"].write_text("1+1=\n")
    return files


CASES = [
    (["rollout.prompts_per_step=-2"], r"rollout\.prompts_per_step must be an int >= 1"),
    (["train.micro_batch_size=-1"], r"train\.micro_batch_size must be an int >= 1"),
    (["data.eval_size=-3"], r"data\.eval_size must be an int >= 0"),
    (["train.steps=-1"], r"train\.steps must be an int >= 0"),
    (["train.lr=-1e-5"], r"train\.lr must be > 0"),
    (["train.lr=nan"], r"train\.lr must be a finite number"),
    (["rollout.max_tokens=0"], r"rollout\.max_tokens must be an int >= 1"),
    (["rollout.temperature=-1"], r"rollout\.temperature must be > 0"),
    (["rollout.top_p=1.5"], r"rollout\.top_p must be in \(0, 1\]"),
    (["rollout.n=1"], r"rollout\.n=1: algorithm\.advantage='grpo'"),
    (
        ["algorithm.advantage=discounted-returns"],
        r"algorithm\.advantage='discounted-returns' needs \['token_rewards'\]",
    ),
    (["algorithm.aggregation=mean"], r"algorithm\.aggregation: unknown aggregation mode 'mean'"),
    (["reward.timeout_s=0"], r"reward\.timeout_s must be > 0"),
    (["ray.startup_timeout_s=0"], r"ray\.startup_timeout_s must be > 0"),
    (["rollout.length_dist=normal:3"], r"rollout\.length_dist: expected"),
    (["--model", "/nonexistent/checkpoint"], r"model\.path: /nonexistent/checkpoint does not exist"),
    (["checkpoint.resume=auto"], r"checkpoint\.resume=auto: set checkpoint\.dir"),
    (["algorithm.correction.level=tokens"], r"algorithm\.correction\.level must be one of off, token"),
    (["algorithm.correction.truncate=-2"], r"algorithm\.correction\.truncate must be >= 0"),
    (
        ["algorithm.correction.mask_low=3", "algorithm.correction.mask_high=2"],
        r"mask_low \(3\) must be <= mask_high",
    ),
    (["algorithm.correction.level=token", "algorithm.policy_loss=tis"], r"already weights by the behaviour"),
    (["train.max_tokens_per_micro_batch=-5"], r"train\.max_tokens_per_micro_batch must be an int >= 0"),
    (["train.nope=1"], r"train\.nope: unknown field"),
    (["--data", "{missing}"], r"data\.train_file: no such file"),
    (["--data", "{empty}"], r"data\.train_file: .*empty\.jsonl holds no prompts"),
    (["--data", "{notjson}"], r"data\.train_file: .*notjson\.jsonl line 2 is not JSON"),
    (["--data", "{int_prompt}"], r"data\.train_file: .*int_prompt\.jsonl line 1: 'prompt' must be a string"),
    (["--data", "{no_answer}"], r"data\.train_file: .*no_answer\.jsonl line 1: no answer field"),
    (["--data", "{list_line}"], r"data\.train_file: .*list_line\.jsonl line 2: expected a JSON object"),
    (["--data", "{bad_parquet}"], r"data\.train_file: .*bad\.parquet is not a readable Parquet file"),
    (["--data", "{txt}"], r"data\.train_file: .*prompts\.txt must end in \.jsonl or \.parquet"),
    (["--data", "{five}"], r"data\.eval_size=100: .*five\.jsonl has 5 prompts"),
    (["--config", "{bad_yaml}"], r"config: .*bad\.yaml line 2: not valid YAML"),
]


@pytest.mark.parametrize(("args", "pattern"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_command_line_is_one_named_line(tmp_path, args, pattern):
    files = {k: str(v) for k, v in _files(tmp_path).items()} | {"missing": str(tmp_path / "none.jsonl")}
    argv = [a.format(**files) for a in args] + [f"logging.dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as e:
        rlvr_qwen.main(argv)
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    assert __import__("re").search(pattern, msg), msg


def test_a_hub_name_that_cannot_be_fetched_is_one_line(tmp_path, monkeypatch):
    """A hub name is accepted by the config; offline (as here, no model hub) loading it says so."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at its import: a module imported earlier in this
    # process without it would try the network (and wait on its retries) instead of failing at once
    hub = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit) as e:
        rlvr_qwen.main(["--model", "Qwen/Qwen2.5-0.5B-Instruct", f"logging.dir={tmp_path}"])
    msg = str(e.value.code)
    assert msg == (
        "error: model.path: could not fetch 'Qwen/Qwen2.5-0.5B-Instruct' from the Hugging Face hub: "
        "the hub is off (HF_HUB_OFFLINE=1)"
    ), msg


def test_a_bad_command_line_prints_no_traceback(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "rlvr_qwen.py"), "train.lr=-1e-5"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 1 and r.stderr.strip() == "error: train.lr must be > 0, got -1e-05", r.stderr


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["env.name=nope"], r"env\.name: unknown environment 'nope'"),
        (["env.kwargs={bogus: 1}"], r"env\.kwargs: frozenlake does not take"),
        (["train.lr=0"], r"train\.lr must be > 0"),
        (["rollout.mode=batch"], r"rollout\.mode"),
    ],
)
def test_agentic_recipe_bad_command_line(tmp_path, args, pattern):
    import agentic_frozenlake

    with pytest.raises(SystemExit) as e:
        agentic_frozenlake.main(["--model", "tiny", *args, f"logging.dir={tmp_path}"])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg and __import__("re").search(pattern, msg), msg

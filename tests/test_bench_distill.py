"""benchmarks/bench_distill.py must not rot: its tiny run (tiny Qwen2, 1-digit addition, one
step per run) trains its own teacher, runs RL and distillation, prints the markdown table and
writes the plot. Nothing about the accuracies is asserted (a random tiny model learns nothing
in one step)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _bench():
    spec = importlib.util.spec_from_file_location("_bench_distill", ROOT / "benchmarks" / "bench_distill.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.mark.slow
def test_tiny_run_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    """About 30 s of CPU (three tiny runs: the teacher's RL job, RL and distillation)."""
    bench = _bench()
    png = tmp_path / "plot.png"
    out = bench.main(
        ["--tiny", "--steps", "2", "--eval-every", "1", "--seeds", "0", "--teacher-steps", "1",
         "--out", str(tmp_path / "runs"), "--plot", str(png), "--",
         "data.eval_size=4", "rollout.prompts_per_step=2", "rollout.n=2", "logging.progress=false"]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert out["teacher"] == str(
        tmp_path / "runs" / "teacher" / "model"
    )  # trained here, not in runs/rlvr_qwen
    assert "| method | seed | step 0 | step 1 | step 2 | sampled tokens | s/step |" in text
    for method in ("RL", "distill"):
        row = re.search(rf"^\| {method} \| 0 \| (\S+) \| (\S+) \| (\S+) \| (\d+) \| (\S+) \|$", text, re.M)
        assert row, text
        accs, tokens = [float(x) for x in row.groups()[:3]], int(row.group(4))
        assert all(0.0 <= a <= 1.0 for a in accs) and 0 < tokens <= 2 * 2 * 2 * 4, row.group(0)
        assert re.search(rf"^\| \*\*{method}\*\* \| \*\*mean\*\* \|", text, re.M), text
        assert sorted(out["results"][method][0]["acc"]) == [0, 1, 2]
    assert re.search(r"^\| teacher \| - \|  \|  \| (\S+) \| \| \|$", text, re.M), text
    if importlib.util.find_spec("matplotlib") is not None:
        assert out["plot"] == str(png) and png.stat().st_size > 10_000


def test_bad_arguments_are_one_line(capsys):
    bench = _bench()
    for argv, msg in (
        (["--seeds", "a,b"], "--seeds: expected comma-separated integers, got 'a,b'"),
        (["--steps", "0"], "--steps and --eval-every must be >= 1, got 0 and 5"),
        (["--teacher", "/nonexistent"], "--teacher: /nonexistent is not a directory"),
    ):
        with pytest.raises(SystemExit):
            bench.parse(argv)
        assert msg in capsys.readouterr().err

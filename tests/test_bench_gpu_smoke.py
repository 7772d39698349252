"""``benchmarks/bench_gpu.py`` must not rot between GPU loans: its cases run on CPU at tiny
shapes (``--device cpu --smoke``), each in its own process, and agree where they must.

Nothing about speed is asserted (the figures are in docs/benchmarks.md, from an H100)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_gpu_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--device", "cpu", "--smoke",
           "--cases", "agree", "torch-lean", "megatron-lean", "offload", "--timeout", "240", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    assert [r for r in rows if "error" in r] == []
    (agree,) = [r for r in rows if r["case"] == "agree"]
    assert agree["backend"] == "gloo" and agree["fsdp2_vs_torch_max_abs"] < 1e-6 < agree["step_moved_max_abs"]
    assert agree["lean_vs_plain_logprob_max_abs"] < 1e-5 and agree["lean_vs_plain_grad_max_abs"] < 1e-4
    (step,) = [r for r in rows if r["case"] == "torch-lean"]
    assert step["finite"] and step["tokens"] == 4 * 24 and step["loss_last"] < step["loss_first"]
    assert "| torch-lean |" in out.read_text()
    (meg,) = [
        r for r in rows if r["case"] == "megatron-lean"
    ]  # the same model, batch and loss (fp32 vs bf16)
    assert meg["finite"] and meg["loss_first"] == pytest.approx(step["loss_first"], rel=2e-2)
    assert {r["engine"] for r in rows if r["case"] == "offload"} == {"torch-lean", "megatron-lean"}

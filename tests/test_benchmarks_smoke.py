"""The benchmark scripts must not rot: each runs at tiny sizes and prints a well-formed table.

Nothing about speed is asserted (the benchmarks print, they do not assert); what is checked is
that each script's ``main([...])`` runs in seconds with the shared size flags
(``--batch --length --repeats --threads``), prints its header with the ratio / speedup
column, one row per case, and only finite, non-negative numbers, with the baseline row at
exactly 1. A subprocess also runs the three files as scripts from outside the checkout.
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TINY = ["--batch", "8", "--length", "64", "--repeats", "1", "--threads", "1"]
NUMBER = re.compile(r"[-+]?(?:nan|inf|\d+(?:\.\d*)?(?:e[-+]?\d+)?)", re.I)


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"_smoke_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def table(out: str, header: str, n_numbers: int) -> dict[str, list[float]]:
    """Rows after the line containing ``header``: name -> its last ``n_numbers`` numbers."""
    lines = out.splitlines()
    starts = [i for i, ln in enumerate(lines) if header in ln]
    assert starts, f"no table header with {header!r} in:\n{out}"
    rows = {}
    for ln in lines[starts[0] + 1 :]:
        nums = NUMBER.findall(ln)
        if len(nums) < n_numbers or ln.startswith(("speedup", "max |")):
            break
        values = [float(x) for x in nums[-n_numbers:]]
        name = ln[: ln.find(nums[-n_numbers], len(ln.split("  ")[0]))].strip()
        assert all(math.isfinite(v) and v >= 0 for v in values), f"bad numbers in row {ln!r}"
        rows[name] = values
    return rows


def test_table_parser_can_fail():
    ok = "case  a  b\nfoo 5% holes   1.0 ms  2.0x\nbar   3.0 ms  1.5x\n"
    assert table(ok, "case", 2) == {"foo 5% holes": [1.0, 2.0], "bar": [3.0, 1.5]}
    with pytest.raises(AssertionError, match="bad numbers"):
        table("case\nfoo  nan ms  1.0x\n", "case", 2)
    with pytest.raises(AssertionError, match="no table header"):
        table("nothing here", "speedup", 2)


def test_gae_tiny(capsys):
    load("bench_gae").main([*TINY, "--sample-rows", "2"])
    out = capsys.readouterr().out
    rows = table(out, "time / rollkit", 3)  # ms, GB/s, ratio
    assert len(rows) == 5, rows
    assert rows["rollkit, multi-turn masks (5% holes)"][2] == 1.0  # the baseline of the ratio
    assert any(k.startswith("column loop") for k in rows)
    err = [float(x) for x in re.findall(r"float64\| = (\S+)", out)]
    assert len(err) == 2 and all(e < 1e-4 for e in err), out  # holes and right-padded
    m = re.search(r"speedup over the column loop: (\S+)x \(holes\), (\S+)x", out)
    assert m and all(math.isfinite(float(g)) and float(g) > 0 for g in m.groups()), out


def test_outcome_tiny(capsys):
    load("bench_outcome").main([*TINY, "--group", "4"])
    out = capsys.readouterr().out
    assert "T=64" in out and "B=8" in out, out
    rows = table(out, "speedup", 4)  # rollkit ms, loop ms, GB/s, speedup
    assert set(rows) == {"advantages [B]", "advantages + tokens [B,T]"}, rows
    assert all(r[0] > 0 and r[1] > 0 and r[3] > 0 for r in rows.values()), rows


def test_losses_tiny(capsys):
    mod = load("bench_losses")
    mod.main(TINY)
    out = capsys.readouterr().out
    assert "shape [8, 64]" in out, out
    rows = table(out, "vs minimal", 4)  # ms, time ratio, kernels, kernel ratio
    assert set(rows) == set(mod.CASES), rows
    assert rows["minimal-ppo"][1] == 1.0 and rows["minimal-ppo"][3] == 1.0
    assert all(r[2] == int(r[2]) and r[2] > 0 for r in rows.values()), rows


def test_scripts_run_as_scripts(tmp_path):
    """`python benchmarks/bench_*.py ...` from another directory: the __main__ entry points."""
    code = (
        "import runpy, sys\n"
        f"for name in ['bench_gae', 'bench_outcome', 'bench_losses']:\n"
        f"    sys.argv = [name, *{TINY!r}]\n"
        f"    runpy.run_path({str(BENCH)!r} + '/' + name + '.py', run_name='__main__')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for header in ("time / rollkit", "speedup", "vs minimal"):
        assert header in res.stdout


@pytest.mark.slow
def test_trl_side_by_side_tiny(capsys):
    """Both trainers on the tiny model for 2 steps (TRL only when the `bench` extra is installed)."""
    pytest.importorskip("transformers")
    results = load("bench_trl").main(["--model", "tiny", "--steps", "2", "--eval-size", "8"])
    out = capsys.readouterr().out
    rows = table(out, "time vs rollkit", 5)  # median, mean, before, after, ratio
    assert rows["rollkit"][4] == 1.0, rows
    want = {"rollkit", "TRL GRPOTrainer"} if importlib.util.find_spec("trl") else {"rollkit"}
    assert set(rows) == want and set(results) == want, rows
    assert all(0 <= r[2] <= 1 and 0 <= r[3] <= 1 for r in rows.values()), rows


def test_train_step_tiny(capsys):
    pytest.importorskip("transformers")
    med = load("bench_train_step").main(["--model", "tiny", "--repeats", "1", "--threads", "1"])
    out = capsys.readouterr().out
    rows = table(out, "speedup", 2)  # s/step, speedup
    assert set(rows) == set(med) and len(rows) == 4, rows
    assert rows["float32"][1] == 1.0 and all(r[0] > 0 for r in rows.values()), rows


def test_token_budget_quick(capsys):
    pytest.importorskip("transformers")
    info = load("bench_token_budget").main(["--quick", "--threads", "1"])
    assert len(info) == 3 and all(0 <= v["padding_frac"] < 1 and v["seconds"] > 0 for v in info.values())
    fixed, _, budget = info.values()
    assert budget["padding_frac"] <= fixed["padding_frac"]  # longest-first packing pads less
    assert "budget" in capsys.readouterr().out


def test_packing_quick(capsys):
    pytest.importorskip("transformers")
    info = load("bench_packing").main(["--quick", "--threads", "1"])
    assert len(info) == 5 and all(v["seconds"] > 0 and v["tokens_per_s"] > 0 for v in info.values())
    padded, _, packed, _, packed_budget = info.values()
    assert padded["padding_frac"] > 0 and packed["padding_frac"] == packed_budget["padding_frac"] == 0
    assert "packed" in capsys.readouterr().out


def test_vlm_rollout_tiny(tmp_path):
    """In a subprocess: an in-process vLLM engine leaves global state behind that changes later
    float results in this process by an ulp (seen in test_agentic_trainer's exact resume test)."""
    pytest.importorskip("transformers")
    pytest.importorskip("PIL.Image")
    args = ["--prompts", "2", "--n", "2", "--tokens", "4", "--repeats", "1", "--hidden", "64", "--layers", "1", "--heads", "2"]
    res = subprocess.run(
        [sys.executable, str(BENCH / "bench_vlm_rollout.py"), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if "RolloutEngine" in line]
    assert rows and rows[0].startswith("HFRolloutEngine") and all(float(r.split()[-2]) > 0 for r in rows[:1])


def test_tail_batching_tiny(capsys):
    """W1 on the tiny model with the HF engine: sync and tail batching, same trained samples."""
    pytest.importorskip("transformers")
    argv = ["--model", "tiny", "--engine", "hf", "--steps", "3", "--prompts", "2", "--n", "2"]
    results = load("bench_tail_batching").main([*argv, "--cap", "24", "--threads", "1"])
    out = capsys.readouterr().out
    # step median, step mean, rollout median, rollout share %, speedup (median), speedup (mean)
    rows = table(out, "speedup (median)", 6)
    assert set(rows) == set(results) == {"sync", "tail batching"}, rows
    assert rows["sync"][4] == rows["sync"][5] == 1.0, rows
    assert all(r[0] > 0 and r[2] > 0 and 0 < r[3] <= 100 for r in rows.values()), rows
    tail = results["tail batching"]
    assert tail["launched"] > 4 and results["sync"]["launched"] == 4  # short rounds over-provision
    assert "command: python benchmarks/bench_tail_batching.py --model tiny --engine hf" in out


def test_async_w1_tiny(capsys):
    """W1 on the tiny model with the HF engine: sync against async a=1, same trained samples."""
    pytest.importorskip("transformers")
    argv = ["--model", "tiny", "--engine", "hf", "--steps", "1", "--warmup", "0", "--passes", "1"]
    rows = load("bench_async").w1([*argv, "--prompts", "2", "--n", "2", "--cap", "16", "--threads", "1",
                                   "--modes", "sync,async a=1"])  # fmt: skip
    out = capsys.readouterr().out
    assert set(rows) == {"sync", "async a=1"} and "| async a=1 |" in out
    assert all(r["s_per_step"] > 0 and 0 <= r["gen_share"] <= 1 for r in rows.values()), rows
    assert rows["sync"]["staleness"] == 0 and 0 <= rows["async a=1"]["staleness"] <= 1


def test_async_recipe_tiny(capsys):
    """--recipe runs the recipe script per set-up (here the tiny model, two in-process set-ups)."""
    pytest.importorskip("transformers")
    extra = "--model tiny train.steps=2 data.digits=1 data.eval_size=4 rollout.prompts_per_step=2 rollout.n=2"
    rows = load("bench_async").w1(["--recipe", "--recipe-modes", "sync,async a=1", "--recipe-args", extra])
    out = capsys.readouterr().out
    assert set(rows) == {"sync", "async a=1"} and "| async a=1 |" in out
    for r in rows.values():
        assert r["s_per_step"] > 0 and r["wall_s"] > 0 and 0 <= r["before"] <= 1 and 0 <= r["after"] <= 1, r
    with pytest.raises(SystemExit, match="unknown set-up"):
        load("bench_async").w1(["--recipe", "--recipe-modes", "colocated"])

"""The one-epoch mode of benchmarks/bench_async.py and bench_tail_batching.py (``--epoch``): every
prompt of the fixed set is trained or dropped by the stated rule, in every mode (tiny model,
transformers engine, one process; about 20 s)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"_epoch_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_epoch_accounts_for_every_prompt(capsys):
    ba = load("bench_async")
    modes = ["sync", "async a=1", "async a=2", "tail batching"]
    spec = ba.EpochSpec(6, modes, "process", "tiny", "hf", 2, 2, "lognormal:8:1.0", 16, threads=1)
    rows = ba.run_epoch(spec)
    for mode, r in rows.items():
        assert r["trained"] + r["dropped"] == 6, (mode, r)
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["wall_s"] > 0
    assert rows["sync"]["steps"] == 3 and rows["sync"]["dropped"] == 0 and rows["sync"]["next_epoch"] == 0
    assert rows["sync"]["samples"] == 6 * 2
    assert rows["tail batching"]["dropped"] == 0  # no dynamic sampling: every prompt is trained
    out = capsys.readouterr().out
    assert "| mode | layout | epoch s |" in out and "| tail batching | process |" in out


def test_epoch_from_bench_tail_batching(capsys):
    argv = "--epoch 4 --model tiny --engine hf --prompts 2 --n 2 --cap 12 --threads 1".split()
    rows = load("bench_tail_batching").main(argv)
    assert set(rows) == {"sync", "tail batching"}
    assert all(r["trained"] + r["dropped"] == 4 for r in rows.values())


def test_epoch_errors_name_the_argument():
    ba = load("bench_async")
    with pytest.raises(ValueError, match="--epoch: 5 prompts is not a whole number of steps"):
        ba.EpochSpec(5, prompts=2)
    with pytest.raises(ValueError, match="--modes: unknown epoch mode 'queue'"):
        ba.EpochSpec(4, ["queue"], prompts=2)
    with pytest.raises(ValueError, match="--layout: expected 'ray' or 'process'"):
        ba.EpochSpec(4, layout="gpu", prompts=2)
    with pytest.raises(
        ValueError, match=r"--modes: 'tail batching \(ray\)' runs on Ray; it needs --layout ray"
    ):
        ba.EpochSpec(4, ["tail batching (ray)"], layout="process", prompts=2)

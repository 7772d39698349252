"""The asynchronous trainer's reproducible schedule and its checkpoints (tiny Qwen2, one engine).

With ``asynchronous.deterministic=true`` the producer's work is a function of the state, not of
timing, so two runs are bit-identical. A checkpoint holds the buffer, the groups in flight, the
requests stopped mid-way and the sampler state, so a run resumed from it equals the
uninterrupted run bit for bit: stopped cleanly after step 2 and resumed in fresh objects (one
process), and SIGKILLed in step 3 of its own process and resumed with
``checkpoint.resume=auto`` in a fresh one (weights, optimizer, buffer, every metric but the
wall-clock ones, the saved model file).

Run as a script (``python tests/trainers/test_async_resume.py RUN_DIR [--kill-in-step=N]
[overrides]``), this module is the driver of the killed, resumed and uninterrupted runs:
:func:`make` with its log in ``RUN_DIR/log`` and a checkpoint after every step in ``RUN_DIR/ck``;
``--kill-in-step=N`` SIGKILLs the process in step N right after its PPO update."""

import copy
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

from trainers.config import load_config
from trainers.engines import HFRolloutEngine, TorchTrainEngine
from trainers.loops import AsyncTrainer
from trainers.models import char_tokenizer, tiny_qwen2
from trainers.tracking import read_metrics

BASE = [
    "--model", "tiny", "data.digits=1", "data.eval_size=12", "eval.before=false", "eval.every=0",
    "eval.max_tokens=4", "rollout.prompts_per_step=3", "rollout.n=4", "rollout.max_tokens=40",
    "rollout.length_dist=lognormal:4:1.2", "rollout.chunk_tokens=4", "train.micro_batch_size=6",
    "train.lr=1e-3", "train.steps=4", "logging.progress=false", "logging.tensorboard=false",
    "logging.plot=false", "asynchronous.ratio=1", "asynchronous.deterministic=true",
    "asynchronous.overlap_steps=3", "algorithm.policy_loss=decoupled-ppo",
]  # fmt: skip


def reward(text: str, answer: str) -> float:
    return float((len(text) + int(answer)) % 3 == 0)  # varies within groups


def make(tmp_path, *overrides):
    cfg = load_config([*BASE, f"logging.dir={tmp_path / 'log'}", *overrides])
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    return AsyncTrainer(
        cfg,
        rollout=HFRolloutEngine(copy.deepcopy(model), tok),
        train=TorchTrainEngine(model, lr=cfg.train.lr),
        tokenizer=tok,
        reward_fn=reward,
    )


def rows(history):
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/"))}
        for r in history
        if "reward/mean" in r
    ]


def run(tmp_path, *overrides, steps=None):
    with make(tmp_path, *overrides) as tr:
        out = tr.fit(steps)
        return rows(out["history"]), [t.clone() for _, t in tr.train.export_weights()]


def test_deterministic_schedule_is_reproducible(tmp_path):
    h1, w1 = run(tmp_path / "a")
    h2, w2 = run(tmp_path / "b")
    assert h1 == h2 and all(torch.equal(a, b) for a, b in zip(w1, w2))
    assert max(r["staleness/max"] for r in h1) == 1  # it ran ahead
    assert sum(r["async/stopped_in_flight"] for r in h1) > 0  # requests were stopped and continued


def test_resume_equals_the_uninterrupted_run(tmp_path):
    full, w_full = run(tmp_path / "full")
    ck = tmp_path / "ck"
    first, _ = run(tmp_path / "part", f"checkpoint.dir={ck}", "checkpoint.every=2", steps=2)
    assert first == full[:2]
    state = torch.load(ck / "step_000002" / "trainer.pt", weights_only=False)
    assert state["scheduler"]["groups"] and state["buffer"]["running"]  # groups were in flight
    resumed, w_res = run(tmp_path / "part", f"checkpoint.dir={ck}", "checkpoint.resume=auto")
    assert resumed[2:] == full[2:]  # the steps after the checkpoint, counters included
    assert all(torch.equal(a, b) for a, b in zip(w_full, w_res))


# --------------------------------------------------------------------------- killed mid-step

ROOT = Path(__file__).resolve().parents[2]
KILL_IN = 3  # the killed run dies in step 3 of 4, after its update (step_000002 is its last checkpoint)


def _driver(run_dir: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """This module as a script in a fresh process, one thread (the same for every run); its
    output goes to a file beside the run (so a full pipe cannot stall it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / f"driver{len(list(run_dir.glob('driver*.out')))}.out"
    with out.open("w") as f:
        p = subprocess.Popen(
            [sys.executable, __file__, str(run_dir), *args],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    _RUNNING.append(p)
    return p, out


_RUNNING: list[subprocess.Popen] = []


def _wait(run: tuple[subprocess.Popen, Path], returncode: int = 0) -> str:
    """Wait for a driver (at most 240 s); asserts its exit status, returns its output."""
    p, out = run
    try:
        p.wait(timeout=240)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    assert p.returncode == returncode, out.read_text()[-3000:]
    return out.read_text()


def _same(a, b, where="state") -> None:
    """``a`` equals ``b`` exactly: tensors by ``torch.equal`` (and dtype), containers item by item."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _metric_rows(log: Path) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/"))}
        for r in read_metrics(log / "metrics.jsonl")
    ]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_killed_mid_step_and_resumed_equals_the_uninterrupted_run(tmp_path):
    """The same command twice, each in a process of its own: once run through, once SIGKILLed in
    step 3 (after its update changed the weights in memory, with requests in flight; step_000002
    is the last checkpoint) and resumed with ``checkpoint.resume=auto`` in a fresh process. A
    step_000003 cut off while it was written (``trainer.pt.tmp`` only) lies beside it. Every
    metrics row but time/ and throughput/, the final checkpoint (weights, optimizer, buffer,
    groups and requests in flight, RNGs) and the saved model file are bit-identical."""
    full, part = tmp_path / "full", tmp_path / "part"
    try:
        uninterrupted = _driver(full)  # meanwhile, on the other core
        out = _wait(_driver(part, f"--kill-in-step={KILL_IN}"), -signal.SIGKILL)
        assert f"SIGKILL in step {KILL_IN}" in out, out[-3000:]
        ck = part / "ck"
        assert sorted(p.parent.name for p in ck.glob("step_*/trainer.pt*")) == ["step_000001", "step_000002"]
        assert [r["step"] for r in read_metrics(part / "log" / "metrics.jsonl")] == [1, 2]
        state = torch.load(ck / "step_000002" / "trainer.pt", weights_only=False)
        assert state["scheduler"]["groups"] and state["buffer"]["running"]  # the kill lost work in flight
        # a checkpoint cut off while it was written: torch.save had not reached the rename
        (ck / "step_000003").mkdir()
        (ck / "step_000003" / "trainer.pt.tmp").write_bytes(
            (ck / "step_000002" / "trainer.pt").read_bytes()[:999]
        )
        out = _wait(_driver(part, "checkpoint.resume=auto"))
        assert "ran steps 3-4" in out, out[-3000:]  # from step_000002, not from the start
        assert "ran steps 1-4" in _wait(uninterrupted)
    finally:
        for p in _RUNNING:  # a failed assertion leaves no driver running
            if p.poll() is None:
                p.kill()
                p.wait()
        _RUNNING.clear()

    a, b = _metric_rows(full / "log"), _metric_rows(part / "log")
    train = [r for r in a if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and "eval/accuracy" in a[-1]
    assert a == b  # steps 1-2 from the killed process, 3-4 from the resumed one, the final evaluation
    assert (
        sum(r["async/stopped_in_flight"] for r in train) > 0 and max(r["staleness/max"] for r in train) == 1
    )
    last = "ck/step_000004/trainer.pt"
    _same(torch.load(full / last, weights_only=False), torch.load(part / last, weights_only=False))
    model = "log/model/model.safetensors"
    assert _sha(full / model) == _sha(part / model)


if __name__ == "__main__":  # the driver of the test above: RUN_DIR [--kill-in-step=N] [overrides]
    run_dir, *extra = sys.argv[1:]
    kill_in = [int(a.split("=")[1]) for a in extra if a.startswith("--kill-in-step=")]
    extra = [a for a in extra if not a.startswith("--")]
    with make(
        Path(run_dir), f"checkpoint.dir={Path(run_dir) / 'ck'}", "checkpoint.every=1", *extra
    ) as trainer:
        if kill_in:
            update = trainer.learner.update

            def update_then_die(*args, **kwargs):
                out = update(*args, **kwargs)
                if trainer.global_step + 1 == kill_in[0]:  # this step's optimizer step is taken
                    print(f"SIGKILL in step {kill_in[0]}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                return out

            trainer.learner.update = update_then_die
        summary = trainer.fit()
        print(f"ran steps {trainer.global_step - summary['steps'] + 1}-{trainer.global_step}", flush=True)

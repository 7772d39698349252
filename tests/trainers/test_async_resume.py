"""The asynchronous trainer's reproducible schedule and its checkpoints (tiny Qwen2, one engine).

With ``asynchronous.deterministic=true`` the producer's work is a function of the state, not of
timing, so two runs are bit-identical; a run checkpointed after step 2 (the buffer, the groups in
flight, the requests stopped mid-way and the sampler state saved) and resumed in fresh objects
equals the uninterrupted run bit for bit."""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

from trainers.config import load_config
from trainers.engines import HFRolloutEngine, TorchTrainEngine
from trainers.loops import AsyncTrainer
from trainers.models import char_tokenizer, tiny_qwen2

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
        {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
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

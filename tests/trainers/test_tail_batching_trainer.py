"""Tail batching (RollPacker) in the synchronous trainer, on the tiny Qwen2 (real engines, CPU).

The trainer drives :class:`rollkit.scheduling.TailBatchingPolicy` with the request-level HF
engine on a W1-like workload (per-request ``max_tokens`` from a log-normal, EOS ignored): a
short round launches 3 prompts x 3 responses for P0 = R0 = 2, keeps the first 2 responses of a
prompt and the first 2 prompts that complete, aborts the rest and queues the third prompt; once
two prompts wait, a long round trains them with exactly 2 responses each.
"""

import copy
import os
from collections import Counter

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from trainers.config import load_config
from trainers.data import build_prompts
from trainers.engines import HFRolloutEngine, TorchTrainEngine
from trainers.loops import SyncTrainer
from trainers.models import char_tokenizer, tiny_qwen2

BASE = ["--model", "tiny", "data.digits=1", "data.eval_size=30", "eval.before=false", "eval.every=0"]
TAIL = [
    "tail_batching.enabled=true",
    "rollout.prompts_per_step=2",
    "rollout.n=2",
    "rollout.max_tokens=32",
    "rollout.length_dist=lognormal:4:1.5",  # W1 scaled down: median 4 tokens, cap 32
    "rollout.chunk_tokens=2",  # the HF request engine advances 2 tokens per step
    "train.micro_batch_size=4",
    "train.lr=1e-3",
]
NUM_PROMPTS = 6  # a small train set: an epoch is 2 short rounds + 1 long round


def make(tmp_path, *overrides, name="run", num_prompts=NUM_PROMPTS, **kw):
    cfg = load_config([*BASE, f"logging.dir={tmp_path / name}", *overrides])
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    train_prompts, eval_prompts = build_prompts(cfg)
    return SyncTrainer(
        cfg,
        rollout=HFRolloutEngine(copy.deepcopy(model), tok),
        train=TorchTrainEngine(model, lr=cfg.train.lr, grad_clip=cfg.train.grad_clip),
        tokenizer=tok,
        train_prompts=train_prompts[:num_prompts] if num_prompts else train_prompts,
        eval_prompts=eval_prompts,
        **kw,
    )


def comparable(m: dict) -> dict:
    """A step's metrics without the wall-clock ones."""
    return {k: v for k, v in m.items() if not k.startswith(("time/", "throughput/", "memory/"))}


def test_every_prompt_trained_once_and_rounds_never_mix(tmp_path):
    tr = make(tmp_path, *TAIL)
    trained, rounds = [], []
    for _ in range(6):  # two epochs of 6 prompts
        queued_before = tr.tail.policy.queue
        m = tr.step()
        b = tr.last_tail_batch
        rounds.append(b.round)
        trained += b.prompt_ids
        # One round per batch: P0 prompts x R0 responses, all of the same round type.
        assert len(b.prompt_ids) == 2 and all(len(r) == 2 for r in b.responses)
        assert m["rollout/kept_groups"] == 2 and m["rollout/rounds"] == 1
        assert m["tail/round"] == float(b.round == "long") == m["tail/long_round"]
        if b.round == "long":  # exactly the queued prompts, R0 each, nothing aborted
            assert set(b.prompt_ids) == set(queued_before) and b.requests[0].num_responses == 2
            assert m["tail/launched_responses"] == 4 and m["tail/aborted_responses"] == 0
        else:  # 3 fresh prompts x 3 responses; 2 trained, 1 queued
            assert not set(b.prompt_ids) & set(queued_before) and b.requests[0].num_responses == 3
            assert m["tail/launched_responses"] == 9 and m["tail/deferred_prompts"] == 1
        # launched = aborted + discarded (finished, not kept) + the P0 x R0 kept
        assert m["tail/launched_responses"] == m["tail/aborted_responses"] + m["tail/discarded_responses"] + 4
        assert m["tail/queue_length"] == len(tr.tail.policy.queue)
        assert 1 <= m["response/length_mean"] <= 32 and "optim/grad_norm" in m and "reward/mean" in m
    assert rounds == ["short", "short", "long"] * 2
    # Every prompt of each epoch (ids epoch * 6 + index) trained exactly once, none lost.
    assert Counter(trained) == Counter(range(12))
    c = tr.tail.policy.counts
    assert c["drawn"] == c["trained"] == 12 and c["queued"] == c["dropped"] == 0
    assert c["aborted_responses"] > 0 and c["aborted_responses"] == m["tail/total_aborted_responses"]
    assert tr.rollout.policy_version == 6  # the weights were pushed after every step


def test_checkpoint_resume_continues_identically(tmp_path):
    straight = make(tmp_path, *TAIL, name="straight")
    want = [comparable(straight.step()) for _ in range(5)]

    first = make(tmp_path, *TAIL, name="first")
    for m in want[:2]:
        assert comparable(first.step()) == m
    assert len(first.tail.policy.queue) == 2  # the next step is a long round over the queue
    path = first.save_checkpoint(tmp_path / "ckpt")

    resumed = make(tmp_path, *TAIL, name="resumed")
    resumed.load_checkpoint(path)
    assert resumed.tail.policy.queue == first.tail.policy.queue and resumed.global_step == 2
    assert resumed.tail.state_dict() == first.tail.state_dict()
    got = [comparable(resumed.step()) for _ in range(3)]
    assert got == want[2:]
    assert [m["tail/round"] for m in got] == [1.0, 0.0, 0.0]


def test_switch_off_is_the_plain_trainer(tmp_path):
    """With tail_batching.enabled=false its other settings change nothing; no tail state."""
    common = ["rollout.prompts_per_step=2", "rollout.n=4", "train.micro_batch_size=8", "train.lr=1e-3"]
    runs = []
    for name, extra in (
        ("plain", []),
        ("off", ["tail_batching.eta_prompts=2.0", "tail_batching.eta_responses=3"]),
    ):
        tr = make(tmp_path, *common, *extra, name=name, num_prompts=0)
        runs.append([comparable(tr.step()) for _ in range(2)])
        assert tr.tail is None and tr.last_tail_batch is None and tr.state_dict()["tail"] is None
        assert not any(k.startswith("tail/") for m in runs[-1] for k in m)
    assert runs[0] == runs[1]


def test_eta_one_never_aborts(tmp_path):
    """eta = 1: a short round launches exactly P0 x R0 and keeps them all; nothing is queued."""
    tr = make(tmp_path, *TAIL, "tail_batching.eta_prompts=1", "tail_batching.eta_responses=1")
    for _ in range(2):
        m = tr.step()
        assert m["tail/launched_responses"] == 4 and m["tail/aborted_responses"] == 0
        assert m["tail/round"] == 0.0 and m["tail/queue_length"] == 0


def test_dynamic_sampling_drops_instead_of_queueing(tmp_path):
    """filter.zero_variance maps to the policy's dynamic_sampling: with a reward that never
    varies, a deferred prompt with two finished responses is dropped; none is lost."""
    tr = make(
        tmp_path,
        *TAIL,
        "rollout.n=3",
        "train.micro_batch_size=6",
        "filter.zero_variance=true",
        reward_fn=lambda text, answer: 1.0,
    )
    assert tr.tail.policy.dynamic_sampling
    for _ in range(4):
        tr.step()
    c = tr.tail.policy.counts
    assert c["drawn"] == c["trained"] + c["dropped"] + c["queued"] == 12
    assert c["trained"] == 8 and c["dropped"] >= 1  # (all 4 deferred prompts today)


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"tail_batching\.eta_prompts"):
        make(tmp_path, *TAIL, "tail_batching.eta_prompts=0.5", name="eta")
    # A rollout role without a request-level view (here a train engine in the rollout's place).
    cfg = load_config([*BASE, f"logging.dir={tmp_path / 'role'}", *TAIL])
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    wrong = TorchTrainEngine(copy.deepcopy(model))
    with pytest.raises(ValueError, match=r"tail_batching\.enabled.*TorchTrainEngine"):
        SyncTrainer(cfg, rollout=wrong, train=TorchTrainEngine(model), tokenizer=tok)

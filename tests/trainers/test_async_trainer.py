"""The asynchronous trainer (ROLL Flash) on the tiny Qwen2 + character tokenizer (real engines).

W1-like budgets (``rollout.length_dist``, log-normal per-request ``max_tokens`` with
``ignore_eos``) make requests of very different lengths, so that requests are still running at
weight updates and the in-flight protocol is exercised.
"""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

from trainers.config import load_config
from trainers.engines import HFRolloutEngine, TorchTrainEngine
from trainers.loops import AsyncTrainer, SyncTrainer
from trainers.models import char_tokenizer, tiny_qwen2

BASE = [
    "--model",
    "tiny",
    "data.digits=1",
    "data.eval_size=20",
    "eval.before=false",
    "eval.every=0",
    "rollout.prompts_per_step=3",
    "rollout.n=4",
    "rollout.max_tokens=40",
    "rollout.length_dist=lognormal:4:1.2",
    "train.micro_batch_size=6",
    "train.lr=1e-3",
    "logging.progress=false",
]


def make(cls, tmp_path, *overrides, **kw):
    cfg = load_config([*BASE, f"logging.dir={tmp_path / 'run'}", *overrides])
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    return cls(
        cfg,
        rollout=HFRolloutEngine(copy.deepcopy(model), tok),
        train=TorchTrainEngine(model, lr=cfg.train.lr),
        tokenizer=tok,
        **kw,
    )


def weights(tr):
    return [t.clone() for _, t in tr.train.export_weights()]


def test_ratio_zero_reproduces_the_sync_trainer(tmp_path):
    """async ratio 0 trains on exactly the synchronous trainer's samples: same rewards and
    lengths every step, bit-identical weights after 4 steps."""
    sync = make(SyncTrainer, tmp_path)
    with make(AsyncTrainer, tmp_path, "asynchronous.ratio=0") as tr:
        for _ in range(4):
            ms, ma = sync.step(), tr.step()
            assert (ms["reward/mean"], ms["response/length_mean"]) == (
                ma["reward/mean"],
                ma["response/length_mean"],
            )
            assert ma["staleness/max"] == 0 and ma["async/stale_token_frac"] == 0
        assert all(torch.equal(a, b) for a, b in zip(weights(sync), weights(tr)))
        assert tr.rollout.policy_version == 4
    sync.close()


def check_freshness(tr, steps, ratio):
    for _ in range(steps):
        m = tr.step()
        assert m["staleness/max"] <= ratio
        s = tr.buffer.stats()  # conservation, checked live
        assert s["produced"] == s["consumed"] + s["dropped_stale"] + s["held"]
        assert s["reserved"] == s["produced"] + s["aborted"] + s["running"]
    return m


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_async_ratio_bounds_staleness_and_in_flight_protocol(tmp_path, mode):
    """alpha = 2: every trained group started at most 2 versions ago; at each update the
    running requests are stopped and resubmitted (keep: continuing with their tokens, so some
    trained samples span two policy versions; abort: started again, never resumed).

    Generation is made slower than training (4 tokens per engine step, 20 ms added to each
    step of the real engine), so that requests are running at every update."""
    import time

    with make(
        AsyncTrainer,
        tmp_path,
        "asynchronous.ratio=2",
        "rollout.chunk_tokens=4",
        "rollout.length_dist=lognormal:12:1.0",
        f"asynchronous.in_flight={mode}",
    ) as tr:
        (eng,) = tr.engines
        step = eng.step

        def slow_step():
            time.sleep(0.02)
            return step()

        eng.step = slow_step
        resumed = stopped = 0
        for _ in range(6):
            m = check_freshness(tr, 1, 2)
            resumed += m["async/resumed_samples"]
            stopped += m["async/stopped_in_flight"]
        assert stopped > 0 and tr.rollout.policy_version == 6
        if mode == "keep":
            assert resumed > 0 and m["async/resubmitted"] > 0 and m["async/restarted"] == 0
        else:
            assert resumed == 0 and m["async/restarted"] > 0 and m["async/resubmitted"] == 0


def test_over_provisioning_aborts_the_tail(tmp_path):
    """alpha = 0 with extra prompts: the first groups to finish are trained, the rest are
    aborted when the batch is drawn (nothing stale is ever trained)."""
    with make(AsyncTrainer, tmp_path, "asynchronous.ratio=0", "asynchronous.extra_prompts=3") as tr:
        m = check_freshness(tr, 3, 0)
        assert m["buffer/aborted"] + m["buffer/dropped_stale"] > 0


def test_requests_are_spread_over_engines_and_filtering_refills(tmp_path):
    """Two engines share the requests (least loaded first); zero-variance groups are filtered
    and replaced by new prompts."""
    with make(
        AsyncTrainer,
        tmp_path,
        "asynchronous.num_engines=2",
        "asynchronous.ratio=1",
        "filter.zero_variance=true",
        "rollout.temperature=1.0",
        # even answers: always 0 (a zero-variance group, filtered); odd: varies with the length
        reward_fn=lambda text, answer: float(int(answer) % 2 == 1 and len(text) > 4),
    ) as tr:
        seen = [0, 0]
        for e in tr.engines:
            orig = e.add
            k = tr.engines.index(e)

            def add(reqs, orig=orig, k=k):
                seen[k] += len(reqs)
                orig(reqs)

            e.add = add
        m = check_freshness(tr, 3, 1)
        assert min(seen) > 0
        assert tr.engines[1].engine is not tr.engines[0].engine
        assert m["async/filtered"] > 0 and m["reward/mean"] > 0
        # the copies receive every update
        for (_, a), (_, b) in zip(
            tr.engines[0].engine.model.named_parameters(), tr.engines[1].engine.model.named_parameters()
        ):
            assert torch.equal(a, b)


def test_recomputed_proximal_logprobs_feed_the_off_policy_loss(tmp_path):
    """A batch with tokens of an older policy gets old_logprobs recomputed by the trainer and
    the rollout's as behavior_logprobs (decoupled PPO uses both); an on-policy batch keeps the
    rollout's, like the synchronous trainer."""
    with make(AsyncTrainer, tmp_path, "asynchronous.ratio=1", "algorithm.policy_loss=decoupled-ppo") as tr:
        seen = []
        orig = tr.update.recompute_proximal

        def spy(batch, timer):
            orig(batch, timer)
            seen.append(batch.get("behavior_logprobs") is not None)

        tr.update.recompute_proximal = spy
        stale = []
        for _ in range(4):
            m = check_freshness(tr, 1, 1)
            stale.append(m["async/stale_token_frac"] > 0)
            assert ("time/recompute" in m) == stale[-1]
            assert torch.isfinite(torch.tensor(m["optim/grad_norm"]))
        assert seen == [s for s in stale if s] and any(stale)


@pytest.mark.parametrize("backend", ["inline", pytest.param("process", marks=pytest.mark.slow)])
def test_evaluate_and_fit_while_generating(tmp_path, backend):
    """Evaluation suspends the producer; scores of its samples that arrive meanwhile are not
    taken by the evaluation's gather (with worker processes they arrive late)."""
    with make(
        AsyncTrainer,
        tmp_path,
        "asynchronous.ratio=1",
        "eval.every=1",
        "train.steps=3",
        f"reward.backend={backend}",
        "checkpoint.every=2",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    ) as tr:
        out = tr.fit()
        assert out["steps"] == 3 and 0 <= out["accuracy_after"] <= 1
        assert not tr.scheduler.running  # fit stops the producer


def test_bad_config(tmp_path):
    for bad, match in [
        ("asynchronous.in_flight=drop", "in_flight"),
        ("asynchronous.extra_prompts=-1", "extra_prompts"),
        ("asynchronous.num_engines=0", "num_engines"),
        ("asynchronous.ratio=-1", "ratio"),
        ("ray.enabled=true", "placement.mode"),  # colocated (the default) is refused
        ("ray.enabled=true placement.mode=disaggregated asynchronous.num_engines=3", "num_engines"),
    ]:
        with pytest.raises(ValueError, match=match):
            make(AsyncTrainer, tmp_path, *bad.split())


@pytest.mark.slow
def test_recipe_switch(tmp_path):
    """`python recipes/rlvr_qwen.py asynchronous.enabled=true` trains with the async trainer."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        str(root / "recipes" / "rlvr_qwen.py"),
        *BASE[:2],
        "data.digits=1",
        "data.eval_size=10",
        "train.steps=2",
        "rollout.prompts_per_step=2",
        "rollout.n=2",
        "asynchronous.enabled=true",
        "asynchronous.ratio=1",
        f"logging.dir={tmp_path}",
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "async ratio 1" in out.stdout and "[step    2/2]" in out.stdout


def test_warns_when_the_loss_ignores_staleness(tmp_path):
    with pytest.warns(UserWarning, match="ignores behavior_logprobs.*decoupled-ppo"):
        make(AsyncTrainer, tmp_path, "asynchronous.ratio=1").close()

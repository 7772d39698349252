"""The synchronous RLVR trainer on the tiny Qwen2 + character tokenizer (real models, CPU).

Task: 1-digit addition ("3+4=" -> "7"), 70 train / 30 held-out pairs. The tiny model (about
80 thousand parameters) does not learn 2-digit addition in a test's time budget on 2 cores
(about 0.2 held-out after 600 SFT steps, 70 s), so the learning test uses 1-digit addition:
a short supervised warm-up gives it a starting accuracy, then RL must raise it.
"""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch
from _tiny_rl import RL_OVERRIDES, fit_and_check_learning

from trainers.config import load_config
from trainers.engines import HFRolloutEngine, TorchTrainEngine
from trainers.engines.build import fast_bf16
from trainers.engines.step import StepBatch
from trainers.learner import supervised_warmup
from trainers.loops import SyncTrainer
from trainers.loops.lengths import LengthSampler
from trainers.models import char_tokenizer, tiny_qwen2
from trainers.tracking import read_metrics

BASE = ["--model", "tiny", "data.digits=1", "data.eval_size=30", "eval.before=false", "eval.every=0"]


def make(tmp_path, *overrides, model=None, name="run", **kw):
    cfg = load_config([*BASE, f"logging.dir={tmp_path / name}", *overrides])
    tok = char_tokenizer()
    model = model if model is not None else tiny_qwen2(tok, seed=0)
    rollout = HFRolloutEngine(copy.deepcopy(model), tok)
    train = TorchTrainEngine(model, lr=cfg.train.lr, grad_clip=cfg.train.grad_clip)
    return SyncTrainer(cfg, rollout=rollout, train=train, tokenizer=tok, **kw)


@pytest.fixture(scope="module")
def warm_model():
    """The tiny model after 100 supervised steps on the train split (held-out 0.23 today)."""
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    cfg = load_config([*BASE, "logging.progress=false"])
    tr = SyncTrainer(
        cfg,
        rollout=HFRolloutEngine(copy.deepcopy(model), tok),
        train=TorchTrainEngine(model, lr=3e-3),
        tokenizer=tok,
    )
    supervised_warmup(tr.train, tok, tr.train_prompts, steps=100, batch_size=64, seed=0)
    return model


def test_step_metrics_and_weight_sync(tmp_path):
    tr = make(
        tmp_path, "train.lr=1e-3", "rollout.prompts_per_step=2", "rollout.n=4", "train.micro_batch_size=3"
    )
    m = tr.step()
    for k in (
        "reward/mean",
        "response/length_mean",
        "loss/clip_frac",
        "entropy",
        "optim/grad_norm",
        "time/rollout",
        "time/train",
        "throughput/rollout_tokens_per_s",
        "accuracy/addition_1d",
    ):
        assert k in m, k
    assert tr.rollout.policy_version == 1
    for (n1, a), (n2, b) in zip(tr.train.export_weights(), tr.rollout.model.named_parameters()):
        assert n1 == n2 and torch.equal(a, b)


def test_dynamic_sampling_refills_until_full(tmp_path):
    # Random tiny model: almost every group is all-wrong, so groups are dropped and refilled
    # until the cap; the reward function below makes half the prompts' groups vary.
    calls = []

    def reward(text, answer):
        calls.append(answer)
        # Variance only for prompts whose answer is odd, and only within the group.
        return float(int(answer) % 2 == 1 and len(calls) % 2 == 0)

    tr = make(
        tmp_path,
        "filter.zero_variance=true",
        "filter.max_rounds=4",
        "rollout.prompts_per_step=4",
        "rollout.n=4",
        reward_fn=reward,
    )
    m = tr.step()
    assert m["rollout/rounds"] > 1  # refilled
    assert m["rollout/kept_groups"] == 4  # the batch was filled with groups that vary
    assert len(calls) > 16  # more than one round of 4 prompts x 4 samples was scored
    # With a reward that never varies, the cap stops the loop and no update happens.
    tr2 = make(
        tmp_path,
        "filter.zero_variance=true",
        "filter.max_rounds=3",
        name="r2",
        reward_fn=lambda text, answer: 0.0,
    )
    m2 = tr2.step()
    assert m2["rollout/rounds"] == 3 and m2["rollout/kept_groups"] == 0 and "optim/grad_norm" not in m2
    assert tr2.rollout.policy_version == 0


def test_deterministic_run_is_reproducible(tmp_path):
    runs = []
    for name in ("a", "b"):
        tr = make(
            tmp_path,
            "train.lr=1e-3",
            "train.steps=2",
            "algorithm.kl.coef=0.05",
            "rollout.prompts_per_step=2",
            "rollout.n=4",
            name=name,
        )
        runs.append(tr.fit()["history"])
    _close(runs[0], runs[1])


def _close(h1, h2):
    assert len(h1) == len(h2)
    for r1, r2 in zip(h1, h2):
        for k in r1:
            if k.startswith(("time/", "throughput/", "memory/")):
                continue
            assert r1[k] == pytest.approx(r2[k], rel=1e-5, abs=1e-6), k
    return True


@pytest.mark.slow
def test_resume_continues_the_same_run(tmp_path):
    common = [
        "train.lr=1e-3",
        "train.steps=4",
        "algorithm.kl.coef=0.05",
        "algorithm.reward_normalizer=true",
        "rollout.prompts_per_step=2",
        "rollout.n=4",
        f"checkpoint.dir={tmp_path / 'ck'}",
        "checkpoint.every=2",
    ]
    full = make(tmp_path, *common, name="full").fit()["history"]
    # Interrupted run: stops after 2 steps (checkpoint at step 2), then a fresh process resumes.
    make(
        tmp_path,
        *common,
        name="part",
    ).fit(steps=2)
    resumed = make(
        tmp_path, *common, "checkpoint.resume=" + str(tmp_path / "ck" / "step_000002"), name="part"
    )
    assert resumed.global_step == 0
    hist = resumed.fit()["history"]
    assert resumed.global_step == 4
    # The same training rows (the interrupted run's extra end-of-run evaluation aside).
    _close([r for r in full if "reward/mean" in r], [r for r in hist if "reward/mean" in r])
    assert read_metrics(tmp_path / "part" / "metrics.jsonl") == hist


@pytest.mark.slow
@pytest.mark.learning
def test_rl_raises_accuracy(tmp_path, warm_model):
    """RL after the warm-up raises greedy accuracy on the trained prompts by the margin of
    _tiny_rl.py and held-out accuracy does not fall (float32, or bfloat16 where it is fast)."""
    cfg = load_config([*BASE, f"logging.dir={tmp_path}", *RL_OVERRIDES])
    with SyncTrainer(cfg, model=copy.deepcopy(warm_model), tokenizer=char_tokenizer()) as tr:
        assert tr.rollout.dtype == (torch.bfloat16 if fast_bf16("cpu") else torch.float32)
        fit_and_check_learning(tr)


def test_bad_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"rollout\.n"):
        make(tmp_path, "rollout.n=0")
    with pytest.raises(ValueError, match=r"algorithm\.advantage"):
        make(tmp_path, "algorithm.advantage=nope")


def _old_update(train, batch, adv, ref_lp, cfg, seed):
    """The PPO update as SyncTrainer.step ran it before it was factored into ppo_update
    (verbatim but for the names), to pin that the refactor changed nothing."""
    from collections import defaultdict

    from rollkit.losses import aggregate, global_normalizers
    from rollkit.registry import POLICY_LOSSES, REGULARIZERS

    a, mask = cfg.algorithm, batch.response_mask
    B, mbs = mask.shape[0], cfg.train.micro_batch_size
    mini = cfg.train.mini_batch_size or B
    gen = torch.Generator().manual_seed(seed)
    sums, counts = defaultdict(float), defaultdict(int)
    for _ in range(cfg.train.ppo_epochs):
        order = torch.randperm(B, generator=gen) if cfg.train.ppo_epochs > 1 or mini < B else torch.arange(B)
        for m0 in range(0, B, mini):
            rows_m = order[m0 : m0 + mini]
            norms = global_normalizers(mask[rows_m])
            for u0 in range(0, len(rows_m), mbs):
                rows = rows_m[u0 : u0 + mbs]
                mb = batch[rows]
                lp, ent = train.logprobs(
                    mb.input_ids,
                    mb.attention_mask,
                    mb.response_mask,
                    temperature=cfg.rollout.temperature,
                    with_entropy=True,
                )
                avail = {
                    "logprobs": lp,
                    "old_logprobs": mb.old_logprobs,
                    "behavior_logprobs": mb.old_logprobs,
                    "advantages": adv[rows],
                    "response_mask": mb.response_mask,
                }
                out = POLICY_LOSSES.entry(a.policy_loss).call(avail, **a.policy_loss_kwargs)
                loss = aggregate(out.loss, mb.response_mask, a.aggregation, **norms)
                if a.entropy_coef:
                    e = REGULARIZERS.get("entropy")(ent, mb.response_mask, coef=a.entropy_coef)
                    loss = loss + aggregate(e.loss, mb.response_mask, a.aggregation, **norms)
                if ref_lp is not None and a.kl.mode == "loss":
                    kl = REGULARIZERS.get("kl")(
                        lp, ref_lp[rows], mb.response_mask, estimator=a.kl.estimator, coef=a.kl.coef
                    )
                    loss = loss + aggregate(kl.loss, mb.response_mask, a.aggregation, **norms)
                train.backward(loss)
                w = int(mb.response_mask.sum())
                for k, v in out.metrics.items():
                    sums[f"loss/{k}"] += float(v) * w
                    counts[f"loss/{k}"] += w
                sums["entropy"] += float(ent.detach()[mb.response_mask].sum())
                counts["entropy"] += w
            for k, v in train.step().items():
                sums[f"optim/{k}"] += v
                counts[f"optim/{k}"] += 1
    return {k: sums[k] / max(counts[k], 1) for k in sums}


def test_ppo_update_is_the_old_update_exactly(tmp_path):
    """ppo_update (1 rank) gives bit-identical weights and metrics to the pre-refactor loop:
    2 PPO epochs, shuffled mini-batches of 5 (a ragged last one), micro-batches of 2,
    entropy bonus and a KL loss term."""
    from trainers.engines import SamplingParams, pack_generations
    from trainers.learner import UpdateSpec, ppo_update

    cfg = load_config(
        [
            *BASE,
            "train.ppo_epochs=2",
            "train.mini_batch_size=5",
            "train.micro_batch_size=2",
            "algorithm.entropy_coef=0.01",
            "algorithm.kl.coef=0.1",
            "algorithm.policy_loss_kwargs={clip_high: 0.28}",
            "rollout.temperature=0.9",
        ]
    )
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    prompts = [tok(f"{a}+{a + 1}=").input_ids for a in range(4)]
    gens = HFRolloutEngine(copy.deepcopy(model), tok).generate(
        prompts, SamplingParams(n=3, temperature=0.9, max_tokens=5, seed=1)
    )
    batch = pack_generations(gens, tok.pad_token_id)
    adv = torch.linspace(-1, 1, len(gens))[:, None] * batch.response_mask
    ref_lp = batch.old_logprobs - 0.05 * batch.response_mask
    engines = [TorchTrainEngine(copy.deepcopy(model), lr=1e-2) for _ in range(2)]
    old = _old_update(engines[0], batch, adv, ref_lp, cfg, seed=11)
    new = ppo_update(
        engines[1], StepBatch.from_packed(batch, advantages=adv, ref_logprobs=ref_lp), UpdateSpec.from_config(cfg), seed=11
    ).metrics()
    added = set(new) - set(old)  # the mismatch diagnostics and padding share came later
    assert all(k.startswith("mismatch/") or k == "train/padding_frac" for k in added), added
    assert old == {k: new[k] for k in old}
    for (n1, a), (n2, b) in zip(engines[0].export_weights(), engines[1].export_weights()):
        assert n1 == n2 and torch.equal(a, b), n1
    assert any(
        not torch.equal(a, b) for (_, a), (_, b) in zip(engines[0].export_weights(), model.named_parameters())
    )


def test_rewards_go_through_the_pool_and_bad_roles_are_rejected(tmp_path):
    """Every sample is scored by the RewardPool (reward.verifier, inline here), streamed as it
    finishes; unknown engines / backends / placement modes raise naming the field."""
    tr = make(tmp_path, "rollout.prompts_per_step=2", "rollout.n=4", "reward.verifier=exact_match")
    m = tr.step()
    assert tr.rewards.metrics()["scored"] == 8 and "time/reward" in m
    tr.evaluate()
    assert tr.rewards.metrics()["scored"] == 8 + 30
    tr.close()
    for arg, match in (
        ("rollout.engine=sglang", r"rollout\.engine"),
        ("train.engine=fsdp", r"train\.engine"),
        ("reward.backend=threads", r"reward\.backend"),
        ("placement.mode=mixed", r"placement\.mode"),
        ("reward.verifier=nope", "verifier: unknown name"),
    ):
        with pytest.raises(ValueError, match=match):
            make(tmp_path, arg)


def test_length_distribution_runs_request_by_request(tmp_path):
    """W1: every sample gets its own max_tokens (log-normal, capped) and runs to it (ignore_eos),
    through the request-level engine; the step trains on all of them."""
    tr = make(
        tmp_path,
        "rollout.prompts_per_step=3",
        "rollout.n=4",
        "rollout.max_tokens=40",
        "rollout.length_dist=lognormal:4:1.0",
        "train.micro_batch_size=6",
    )
    sampler = LengthSampler("lognormal:4:1.0", cap=40, seed=0)
    expected = [sampler.draw() for _ in range(12)]
    m = tr.step()
    assert m["response/length_mean"] == sum(expected) / 12
    assert "optim/grad_norm" in m and tr.rollout.policy_version == 1
    assert max(expected) > 2 * sorted(expected)[6]  # a tail
    with pytest.raises(ValueError, match="length_dist"):
        make(tmp_path, "rollout.length_dist=normal:3", name="bad")


def test_sort_by_length_gives_the_same_update():
    """train.sort_by_length regroups rows into micro-batches by response length: the same
    rows and global normalisers, so the same gradient sum (to float rounding)."""
    import dataclasses

    from trainers.engines import SamplingParams, pack_generations
    from trainers.learner import UpdateSpec, ppo_update

    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    prompts = [tok(f"{a}+{a + 2}=").input_ids for a in range(5)]
    gens = HFRolloutEngine(copy.deepcopy(model), tok).generate(
        prompts,
        SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=3, stop_token_ids=tuple(range(3, 30))),
    )
    batch = pack_generations(gens, tok.pad_token_id)
    assert len(set(batch.response_mask.sum(-1).tolist())) > 3  # lengths vary
    adv = torch.linspace(-1, 1, len(gens))[:, None] * batch.response_mask
    spec = UpdateSpec(micro_batch_size=3, aggregation="seq-mean-token-mean")
    copies = [copy.deepcopy(model) for _ in range(2)]  # SGD: the weight change is the gradient
    engines = [TorchTrainEngine(m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0)) for m in copies]
    m0 = ppo_update(engines[0], StepBatch.from_packed(batch, advantages=adv), spec, seed=1).metrics()
    m1 = ppo_update(engines[1], StepBatch.from_packed(batch, advantages=adv), dataclasses.replace(spec, sort_by_length=True), seed=1).metrics()
    assert m0.keys() == m1.keys()
    for (_, a), (_, b) in zip(engines[0].export_weights(), engines[1].export_weights()):
        assert torch.allclose(a, b, atol=1e-6)
    assert any(
        not torch.equal(a, b) for (_, a), (_, b) in zip(engines[0].export_weights(), model.named_parameters())
    )

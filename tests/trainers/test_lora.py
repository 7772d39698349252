"""LoRA policies (trainers.engines.lora) with real peft on a tiny Qwen2.

The key properties: the training engines move only the adapters; the merged weights equal
peft's own merge and, loaded into a plain rollout engine, give the trainer's log-probs; both
saved forms load with transformers.
"""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import peft
import torch
import transformers
from safetensors.torch import load_file

from rollkit.losses import aggregate, global_normalizers, ppo_clip
from trainers.engines import HFRolloutEngine, SamplingParams, TorchTrainEngine, pack_generations
from trainers.engines.lora import (
    BASE_SUBDIR,
    LORA_TARGETS,
    adapter_weights,
    apply_lora,
    merged_weights,
    save_lora,
)
from trainers.models import char_tokenizer, tiny_qwen2

TEXTS = ["What is 12+34? Answer: ", "7+5=", "Compute 3*9. "]
N = 4  # samples per prompt


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    prompts = [tok(t).input_ids for t in TEXTS]
    gens = HFRolloutEngine(tiny_qwen2(tok, seed=0), tok).generate(
        prompts, SamplingParams(n=N, max_tokens=10, seed=1)
    )
    b = pack_generations(gens, tok.pad_token_id)
    r = torch.linspace(0, 1, len(gens)).view(-1, N) ** 2  # distinct rewards: non-zero advantages
    b.extras["adv"] = (r - r.mean(-1, keepdim=True)).view(-1)
    return b


def policy(tok, rank=4, **kw):
    return apply_lora(tiny_qwen2(tok, seed=0), rank=rank, **kw)


def train_steps(engine, b, steps):
    norms = global_normalizers(b.response_mask)
    for _ in range(steps):
        lp = engine.logprobs(b.input_ids, b.attention_mask, b.response_mask)
        out = ppo_clip(lp, b.old_logprobs, b.extras["adv"], b.response_mask)
        engine.backward(aggregate(out.loss, b.response_mask, "token-mean", **norms))
        assert engine.step()["skipped"] == 0


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(before, model):
    after = model.state_dict()
    assert before.keys() == after.keys()
    return {k for k in before if not torch.equal(before[k], after[k])}


def trained(tok, batch, steps=3):
    engine = TorchTrainEngine(policy(tok), lr=1e-2)
    train_steps(engine, batch, steps)
    return engine


# --------------------------------------------------------------------------- apply_lora


def test_apply_lora_wraps_only_adapters_trainable(tok):
    base = tiny_qwen2(tok, seed=0)
    x = torch.tensor([tok(TEXTS[0]).input_ids])
    want = base(input_ids=x).logits
    rng = torch.get_rng_state()
    p = apply_lora(base, rank=4, alpha=8)
    assert torch.equal(torch.get_rng_state(), rng)  # initialisation from its own seed
    assert isinstance(p, peft.PeftModelForCausalLM)
    trainable = [n for n, q in p.named_parameters() if q.requires_grad]
    # 2 layers x 7 linear layers x (A, B)
    assert len(trainable) == 2 * len(LORA_TARGETS) * 2
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    torch.testing.assert_close(p(input_ids=x).logits, want, rtol=0, atol=0)  # B = 0 at init
    layer = p.get_base_model().model.layers[0].self_attn.q_proj
    assert layer.r["default"] == 4 and layer.scaling["default"] == 2.0
    assert (
        apply_lora(tiny_qwen2(tok), rank=8).get_base_model().model.layers[0].mlp.up_proj.scaling["default"]
        == 1.0
    )  # alpha=None: alpha = rank
    a = [q for n, q in apply_lora(tiny_qwen2(tok), rank=4, seed=3).named_parameters() if "lora_A" in n]
    b = [q for n, q in apply_lora(tiny_qwen2(tok), rank=4, seed=3).named_parameters() if "lora_A" in n]
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rank": 0}, "rank"),
        ({"rank": 2.0}, "rank"),
        ({"rank": True}, "rank"),
        ({"rank": 4, "alpha": 0}, "alpha"),
        ({"rank": 4, "alpha": "8"}, "alpha"),
        ({"rank": 4, "dropout": 1.0}, "dropout"),
        ({"rank": 4, "dropout": -0.1}, "dropout"),
        ({"rank": 4, "target_modules": ()}, "target_modules"),
        ({"rank": 4, "target_modules": "q_proj"}, "target_modules"),
        ({"rank": 4, "target_modules": ("q_proj", "qkv_proj")}, r"target_modules: \['qkv_proj'\]"),
    ],
)
def test_apply_lora_bad_arguments(tok, kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_lora(tiny_qwen2(tok), **kwargs)


def test_apply_lora_refuses_wrapped_or_foreign_models(tok):
    with pytest.raises(ValueError, match="already has peft adapters"):
        apply_lora(policy(tok), rank=4)
    with pytest.raises(ValueError, match=r"model must be a torch\.nn\.Module"):
        apply_lora("Qwen/Qwen2-0.5B", rank=4)


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_torch_engine_trains_only_the_adapters(tok, batch, opt):
    p = policy(tok)
    before = snapshot(p)
    kw = {"optimizer_factory": lambda ps: torch.optim.SGD(ps, lr=0.5)} if opt == "sgd" else {"lr": 1e-2}
    engine = TorchTrainEngine(p, **kw)
    n_opt = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    assert n_opt == 2 * len(LORA_TARGETS) * 2  # the optimizer holds only the adapters
    train_steps(engine, batch, 3)
    moved = changed(before, p)
    lora = {k for k in before if ".lora_" in k}
    assert moved == lora  # every A and B moved (B at step 1, A from step 2), nothing else


def lora_grads(tok, b, **engine_kw):
    p = policy(tok)
    with torch.no_grad():  # non-zero B, so that A gets a gradient too
        for n, q in p.named_parameters():
            if ".lora_B." in n:
                q.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    engine = TorchTrainEngine(p, **engine_kw)
    engine.logprobs(b.input_ids, b.attention_mask, b.response_mask).sum().backward()
    return {n: q.grad.clone() for n, q in p.named_parameters() if q.grad is not None}


def test_engine_paths_give_the_same_adapter_gradients(tok, batch):
    """Prompt sharing (the KV cache through peft's forward), one plain forward, gradient
    checkpointing and the memory-lean chunked log-probs: same adapter gradients."""
    want = lora_grads(tok, batch)
    assert len(want) == 2 * len(LORA_TARGETS) * 2
    for kw in [{"share_prompts": False}, {"gradient_checkpointing": True}, {"logprob_chunk_tokens": 4}]:
        got = lora_grads(tok, batch, **kw)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], rtol=0, atol=1e-5, msg=lambda m, k=k, kw=kw: f"{kw} {k}: {m}"
            )


def test_engine_save_model_of_a_peft_model_writes_the_merged_model(tok, tmp_path):
    """TorchTrainEngine.save_model on a peft model writes the merged model: a plain
    transformers checkpoint (config + weights), no adapter files."""
    TorchTrainEngine(policy(tok)).save_model(tmp_path, tok)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
    assert not (tmp_path / "adapter_model.safetensors").exists()


def test_export_weights_of_a_peft_model_are_the_merged_weights(tok):
    """TorchTrainEngine.export_weights of a peft model yields merged_weights: the base model's
    names, which a plain rollout engine takes."""
    engine = TorchTrainEngine(policy(tok))
    names = [n for n, _ in engine.export_weights()]
    assert names == [n for n, _ in merged_weights(engine.model)]
    assert not any(n.startswith("base_model.") or ".lora_" in n for n in names)
    rollout = HFRolloutEngine(tiny_qwen2(tok, seed=0), tok)
    rollout.update_weights(engine.export_weights(), version=1)


def test_deepspeed_zero2_trains_the_adapters(tok, batch):
    pytest.importorskip("trainers.engines.deepspeed_train")  # sets DS_ACCELERATOR=cpu first
    pytest.importorskip("deepspeed")
    from trainers.engines.deepspeed_train import DeepSpeedTrainEngine

    ref = trained(tok, batch, steps=2)
    p = policy(tok)
    before = snapshot(p)
    engine = DeepSpeedTrainEngine(p, zero_stage=2, lr=1e-2)
    train_steps(engine, batch, 2)
    assert changed(before, engine.model) == {k for k in before if ".lora_" in k}
    want = dict(merged_weights(ref.model))
    got = dict(merged_weights(engine.model))
    assert got.keys() == want.keys()
    for k in want:  # same update as the torch engine (AdamW, fp32)
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


# --------------------------------------------------------------------------- merged weights


def test_merged_weights_equal_peft_merge(tok, batch):
    engine = trained(tok, batch)
    before = snapshot(engine.model)
    got = {k: v.clone() for k, v in merged_weights(engine.model)}
    assert changed(before, engine.model) == set()  # the training model is not modified
    ref = copy.deepcopy(engine.model).merge_and_unload()
    want = dict(ref.named_parameters())  # state_dict names, the tied embedding once
    assert list(got) == list(want)
    assert "lm_head.weight" not in got and not any("lora" in k or "base_layer" in k for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    base = dict(tiny_qwen2(tok, seed=0).named_parameters())
    assert not torch.allclose(
        got["model.layers.0.mlp.down_proj.weight"], base["model.layers.0.mlp.down_proj.weight"]
    )
    torch.testing.assert_close(
        got["model.embed_tokens.weight"], base["model.embed_tokens.weight"], rtol=0, atol=0
    )
    assert all(t.dtype == torch.bfloat16 for _, t in merged_weights(engine.model, torch.bfloat16))


def test_merged_weights_give_the_rollout_the_trainers_logprobs(tok, batch):
    engine = trained(tok, batch)
    rollout = HFRolloutEngine(tiny_qwen2(tok, seed=0), tok)  # a plain model: no LoRA support
    prompts = [tok(t).input_ids for t in TEXTS]
    params = SamplingParams(n=2, temperature=0.7, max_tokens=10, seed=5)

    def err():
        b = pack_generations(rollout.generate(prompts, params), tok.pad_token_id)
        with torch.no_grad():
            lp = engine.logprobs(b.input_ids, b.attention_mask, b.response_mask, temperature=0.7)
        return float((lp - b.old_logprobs).abs()[b.response_mask].max())

    assert err() > 1e-4  # the rollout still has the base weights
    rollout.update_weights(merged_weights(engine.model), version=1)
    assert rollout.policy_version == 1
    assert err() < 1e-5


def test_adapter_weights_are_the_saved_adapter(tok, batch, tmp_path):
    engine = trained(tok, batch, steps=2)
    got = dict(adapter_weights(engine.model))
    assert len(got) == 2 * len(LORA_TARGETS) * 2
    assert all(
        k.startswith("base_model.model.") and (".lora_A.weight" in k or ".lora_B.weight" in k) for k in got
    )
    save_lora(engine.model, tok, tmp_path, merged=False)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved.keys() == got.keys()
    for k in got:
        torch.testing.assert_close(saved[k], got[k], rtol=0, atol=0)


def test_refuses_what_it_cannot_merge(tok):
    with pytest.raises(ValueError, match=r"peft_model must be a peft\.PeftModel"):
        list(merged_weights(tiny_qwen2(tok)))
    cfg = peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)
    dora = peft.get_peft_model(tiny_qwen2(tok), cfg)
    with pytest.raises(ValueError, match="DoRA"):
        list(merged_weights(dora))
    with pytest.raises(ValueError, match="merged must be True or False"):
        save_lora(policy(tok), tok, "unused", merged="yes")


# --------------------------------------------------------------------------- saving


def test_save_lora_merged_loads_with_transformers(tok, batch, tmp_path):
    engine = trained(tok, batch)
    x = torch.tensor([tok(t).input_ids for t in ["7+5=12", "3*9=27"]])
    with torch.no_grad():
        want = engine.model(input_ids=x).logits
    before = snapshot(engine.model)
    out = save_lora(engine.model, tok, tmp_path / "merged", merged=True)
    assert changed(before, engine.model) == set()
    assert not (out / "adapter_config.json").exists()
    m = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert not hasattr(m, "peft_config") and type(m).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(m(input_ids=x).logits, want, rtol=0, atol=1e-5)
    assert transformers.AutoTokenizer.from_pretrained(out)("7+5=").input_ids == tok("7+5=").input_ids


def test_save_lora_adapter_beside_base_loads_both_ways(tok, batch, tmp_path):
    engine = trained(tok, batch)
    x = torch.tensor([tok(t).input_ids for t in ["7+5=12", "3*9=27"]])
    with torch.no_grad():
        want = engine.model(input_ids=x).logits
        base_logits = tiny_qwen2(tok, seed=0)(input_ids=x).logits
    out = save_lora(engine.model, tok, tmp_path / "adapter", merged=False)
    assert engine.model.peft_config["default"].base_model_name_or_path is None  # restored
    for f in ["adapter_config.json", "adapter_model.safetensors", "tokenizer.json"]:
        assert (out / f).exists(), f
    # no model weights beside the adapter (vLLM would load them), the base in its own directory
    assert sorted(q.name for q in out.glob("*.safetensors")) == ["adapter_model.safetensors"]
    base_dir = out / BASE_SUBDIR
    assert (base_dir / "config.json").exists() and (base_dir / "model.safetensors").exists()
    plain = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    auto_peft = peft.AutoPeftModelForCausalLM.from_pretrained(out)
    with_adapter = transformers.AutoModelForCausalLM.from_pretrained(out)  # transformers' peft integration
    with torch.no_grad():
        torch.testing.assert_close(auto_peft(input_ids=x).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(with_adapter(input_ids=x).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(plain(input_ids=x).logits, base_logits, rtol=0, atol=1e-5)  # unmerged
        with auto_peft.disable_adapter():
            torch.testing.assert_close(auto_peft(input_ids=x).logits, base_logits, rtol=0, atol=1e-5)
    assert float((want - base_logits).abs().max()) > 1e-3


def test_sync_trainer_with_lora_trains_adapters_and_serves_merged_weights(tmp_path):
    """train.lora_rank through the config: two RL steps train only the adapters; the rollout
    engine holds the merged weights (its log-probs equal the trainer's); the saved model is the
    merged one, a plain transformers checkpoint."""
    import transformers

    from trainers.config import load_config
    from trainers.loops import SyncTrainer

    cfg = load_config(
        ["--model", "tiny", "train.lora_rank=8", "train.lr=1e-2", "data.digits=1", "data.eval_size=8",
         "eval.before=false", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=3",
         "train.steps=2", "algorithm.entropy_coef=0.1", "logging.progress=false", f"logging.dir={tmp_path}"]
    )  # fmt: skip
    with SyncTrainer(cfg) as tr:
        base_before = {
            k: v.detach().clone() for k, v in tr.train.model.named_parameters() if "lora_" not in k
        }
        out = tr.fit()
        params = dict(tr.train.model.named_parameters())
        assert all(torch.equal(params[k], v) for k, v in base_before.items())  # the base is frozen
        merged = dict(tr.learner.export_weights())
        rollout = dict(tr.rollout.model.named_parameters())
        assert merged.keys() == rollout.keys()
        assert all(torch.equal(rollout[k], merged[k].to(rollout[k].dtype)) for k in merged)
        assert any(not torch.equal(merged[k], base_before["base_model.model." + k.replace(".weight", ".base_layer.weight")])
                   for k in merged if "q_proj.weight" in k)  # fmt: skip
    saved = transformers.AutoModelForCausalLM.from_pretrained(out["model_dir"])
    assert all(torch.equal(p, merged[k]) for k, p in saved.named_parameters())

"""The Megatron-Core training engine: rollkit's HF <-> Megatron mapping, the engine at TP=1 against
the torch engine, and TP=2 / PP=2 / DP=2 over gloo against the same reference (float32)."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")
dist = torch.distributed
mp = pytest.importorskip("torch.multiprocessing")

from trainers.config import load_config  # noqa: E402
from trainers.engines.megatron_weights import hf_names, layout_of, pairs, to_hf, to_megatron  # noqa: E402
from trainers.engines.torch_train import TorchTrainEngine  # noqa: E402
from trainers.models import char_tokenizer, tiny_qwen2  # noqa: E402


def _llama(vocab: int = 101, tied: bool = False):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_megatron_round_trip_is_exact(family, tied, tp, pp):
    """Every Hugging Face weight goes to its shards and back bit for bit, the padded vocabulary
    (101 rows at tp=2) included; each stage holds its own layers."""
    model = (
        tiny_qwen2(char_tokenizer(), seed=3, layers=2, tie_embeddings=tied)
        if family == "qwen2"
        else _llama(tied=tied)
    )
    hf = {n: p.detach() for n, p in model.named_parameters()}
    if not tied and "lm_head.weight" not in hf:
        hf["lm_head.weight"] = model.lm_head.weight.detach()
    lay = layout_of(model.config, tp, pp)
    assert set(hf_names(lay)) == set(hf)
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        shards = [to_megatron(hf, lay, stage=stage, rank=r) for r in range(tp)]
        assert list(shards[0]) == [meg for _, meg in pairs(lay, stage)]
        if tp > 1:  # the fused QKV rows of a rank are its key-value groups; fc1 is [gate_r; up_r]
            qkv = shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"]
            assert qkv.shape[0] == (lay.heads + 2 * lay.kv_heads) * lay.head_dim // tp
        back.update(to_hf({k: [s[k] for s in shards] for k in shards[0]}, lay, stage))
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_layout_refuses_what_it_cannot_split():
    cfg = tiny_qwen2(char_tokenizer(), kv_heads=2).config
    with pytest.raises(
        ValueError, match=r"train\.megatron_tp: 4 does not divide the model's 2 key-value heads"
    ):
        layout_of(cfg, tp=4)
    with pytest.raises(ValueError, match=r"train\.megatron_pp: 3 does not divide the model's 2 layers"):
        layout_of(cfg, pp=3)
    gpt2 = transformers.GPT2Config(n_layer=2)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not mapped"):
        layout_of(gpt2)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (4, 12), generator=g)
    am = torch.ones_like(ids)
    am[0, :3] = 0
    am[1, :1] = 0
    rm = torch.ones(4, 5, dtype=torch.bool)
    rm[2, 3:] = False
    rm[3, 1:] = False
    return ids, am, rm


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _train_step(engine, rows=slice(0, 4), total=None):
    """Log-probs before, two micro-batches of loss (log-prob + entropy terms), a step, log-probs
    after and the exported weights."""
    ids, am, rm = _batch()
    total = rm.sum() if total is None else total
    with torch.no_grad():
        before = engine.logprobs(ids, am, rm, with_entropy=True)
    ids, am, rm = ids[rows], am[rows], rm[rows]
    for mb in (slice(0, 2), slice(2, 4)):
        lp, ent = engine.logprobs(ids[mb], am[mb], rm[mb], with_entropy=True)
        engine.backward(-(lp * rm[mb]).sum() / total - 0.1 * (ent * rm[mb]).sum() / total)
    metrics = engine.step()
    ids, am, rm = _batch()
    with torch.no_grad():
        after = engine.logprobs(ids, am, rm)
    return {"before": before, "metrics": metrics, "after": after, "weights": dict(engine.export_weights())}


def _reference(tied=True):
    model = tiny_qwen2(char_tokenizer(), seed=1, tie_embeddings=tied)
    return model, _train_step(
        TorchTrainEngine(copy.deepcopy(model), optimizer_factory=_sgd, share_prompts=False)
    )


def _assert_same(out, ref, *, tol=1e-5):
    for a, b in zip(out["before"], ref["before"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)
    assert out["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
    torch.testing.assert_close(out["after"], ref["after"], rtol=0, atol=tol)
    assert list(out["weights"]) == list(ref["weights"])
    for k, v in ref["weights"].items():
        torch.testing.assert_close(out["weights"][k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.fixture
def megatron_world():
    """Megatron's parallel state in this process (a one-process gloo group), torn down after."""
    started = not dist.is_initialized()
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if started and dist.is_initialized():
        dist.destroy_process_group()


def test_tp1_equals_the_torch_engine(megatron_world, tmp_path):
    """Log-probs (plain, lean head, top-k / top-p replay), entropies, the step (SGD: the update
    compares the gradients), a checkpoint round trip and the saved Hugging Face model."""
    from trainers.engines.megatron_train import MegatronTrainEngine

    model, ref = _reference()
    eng = MegatronTrainEngine(copy.deepcopy(model), optimizer_factory=_sgd)
    _assert_same(_train_step(eng), ref)
    torch_eng = TorchTrainEngine(copy.deepcopy(model), share_prompts=False)
    torch_eng.model.load_state_dict(ref["weights"], strict=False)
    ids, am, rm = _batch()
    eng.logprob_chunk_tokens = 3
    with torch.no_grad():
        for kw in ({}, {"top_k": 5, "top_p": 0.9, "temperature": 0.7}):
            torch.testing.assert_close(eng.logprobs(ids, am, rm, **kw), torch_eng.logprobs(ids, am, rm, **kw),
                                       rtol=0, atol=1e-5)  # fmt: skip
    state = copy.deepcopy(eng.state_dict())
    again = MegatronTrainEngine(copy.deepcopy(model))
    again.load_state_dict(state)
    for (n1, a), (n2, b) in zip(eng.export_weights(), again.export_weights(), strict=True):
        assert n1 == n2 and torch.equal(a, b)
    saved = eng.save_model(tmp_path / "hf", char_tokenizer())
    hf = transformers.AutoModelForCausalLM.from_pretrained(saved)
    for k, v in ref["weights"].items():
        torch.testing.assert_close(hf.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_adamw_step_and_its_checkpoint(megatron_world):
    """The default AdamW: the same log-probs as the torch engine's after a step, and a checkpoint
    (HF-named moments) that resumes to the same second step."""
    from trainers.engines.megatron_train import MegatronTrainEngine

    model = tiny_qwen2(char_tokenizer(), seed=1)
    ref_eng = TorchTrainEngine(copy.deepcopy(model), lr=1e-3, share_prompts=False)
    eng = MegatronTrainEngine(copy.deepcopy(model), lr=1e-3)
    a, b = _train_step(ref_eng), _train_step(eng)
    torch.testing.assert_close(b["after"], a["after"], rtol=0, atol=1e-4)
    resumed = MegatronTrainEngine(copy.deepcopy(model), lr=1e-3)
    resumed.load_state_dict(copy.deepcopy(eng.state_dict()))
    c, d = _train_step(eng), _train_step(resumed)
    assert torch.equal(c["after"], d["after"])


WORLD = 2


def _worker(rank, port, out_dir, configs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from trainers.engines.megatron_train import MegatronTrainEngine

        for name, tp, pp, tied in configs:
            model = tiny_qwen2(char_tokenizer(), seed=1, tie_embeddings=tied)
            eng = MegatronTrainEngine(model, tp=tp, pp=pp, optimizer_factory=_sgd)
            dp = eng.world_size
            _, _, rm = _batch()
            rows = slice(2 * eng.dp_rank, 2 * eng.dp_rank + 2) if dp > 1 else slice(0, 4)
            if dp > 1:  # each data-parallel rank takes two rows, one micro-batch each
                out = _dp_step(eng, rows, rm.sum())
            else:
                out = _train_step(eng)
            out["state"] = eng.state_dict()
            if rank == 0:
                torch.save(out, os.path.join(out_dir, f"{name}.pt"))
    finally:
        dist.destroy_process_group()


def _dp_step(engine, rows, total):
    ids, am, rm = _batch()
    with torch.no_grad():
        before = engine.logprobs(ids, am, rm, with_entropy=True)
    for r in range(rows.start, rows.stop):
        mb = slice(r, r + 1)
        lp, ent = engine.logprobs(ids[mb], am[mb], rm[mb], with_entropy=True)
        # x dp_size: the engine averages the ranks' gradients (rollkit's global normalisers)
        engine.backward(
            (-(lp * rm[mb]).sum() / total - 0.1 * (ent * rm[mb]).sum() / total) * engine.world_size
        )
    metrics = engine.step()
    with torch.no_grad():
        after = engine.logprobs(ids, am, rm)
    return {"before": before, "metrics": metrics, "after": after, "weights": dict(engine.export_weights())}


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tp2_pp2_dp2_over_gloo_equal_one_rank(megatron_world, tmp_path):
    """Two gloo ranks as tensor parallel, as a two-stage pipeline (tied and untied LM head) and
    as two data-parallel ranks: the same log-probs, gradient norm and updated weights as the
    torch engine on one process; a TP=2 checkpoint resumes on one rank (TP=1)."""
    from trainers.engines.megatron_train import MegatronTrainEngine

    configs = [("tp2", 2, 1, True), ("pp2", 1, 2, True), ("pp2_untied", 1, 2, False), ("dp2", 1, 1, True)]
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), configs), nprocs=WORLD, join=True)
    refs = {True: _reference(True), False: _reference(False)}
    for name, _, _, tied in configs:
        out = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        _assert_same(out, refs[tied][1])
    tp2 = torch.load(tmp_path / "tp2.pt", weights_only=False)
    one = MegatronTrainEngine(copy.deepcopy(refs[True][0]), optimizer_factory=_sgd)
    one.load_state_dict(tp2["state"])
    ids, am, rm = _batch()
    with torch.no_grad():
        torch.testing.assert_close(one.logprobs(ids, am, rm), tp2["after"], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train.engine=megatron", "train.megatron_tp=0"], r"train\.megatron_tp must be an int >= 1, got 0"),
        (["train.engine=megatron", "train.megatron_pp=1.5"], r"train\.megatron_pp: expected int"),
        (["train.megatron_tp=2"], r"train\.megatron_tp / megatron_pp: apply to train\.engine=megatron"),
        (
            ["train.engine=megatron", "train.megatron_tp=2"],
            r"needs ray\.enabled=true and placement\.train_workers",
        ),
        (
            ["train.engine=megatron", "train.megatron_pp=2", "ray.enabled=true", "placement.train_workers=3"],
            r"a multiple of 2 \(got 3",
        ),
        (
            ["train.engine=megatron", "train.lora_rank=4"],
            r"train\.lora_rank: not supported by train\.engine=megatron",
        ),
        (
            ["train.engine=megatron", "train.packing=true"],
            r"train\.packing: not supported by train\.engine=megatron",
        ),
        (
            ["train.engine=megatron", "train.autocast=bfloat16"],
            r"train\.autocast=bfloat16: Megatron-Core's linear",
        ),
        (
            ["train.engine=megatron", "--model", "tiny_vl"],
            r"model\.path=tiny_vl: not supported by train\.engine=megatron \(.*Llama / Qwen2 text models only",
        ),
        (
            ["train.engine=megatron", "algorithm.advantage=gae"],
            r"critic\.engine: not supported by train\.engine=megatron \(the Megatron engine trains the policy",
        ),
    ],
)
def test_megatron_config_is_validated_by_field(args, message):
    from trainers.config import validate

    with pytest.raises(ValueError, match=message):
        validate(load_config(args))


def test_megatron_config_accepts_a_critic_on_another_engine():
    from trainers.config import validate

    validate(load_config(["train.engine=megatron", "algorithm.advantage=gae", "critic.engine=torch"]))
    validate(
        load_config(
            ["train.engine=megatron", "train.megatron_tp=2", "ray.enabled=true", "placement.train_workers=4"]
        )
    )


def test_offload_moves_the_megatron_state_and_restores_it_bit_identically(megatron_world):
    """placement.offload_train on the Megatron engine: every weight, gradient and AdamW tensor
    leaves the device (storage freed) and comes back bit for bit; training goes on as a twin's."""
    from trainers.engines.megatron_train import MegatronTrainEngine

    model = tiny_qwen2(char_tokenizer(), seed=1)
    eng, twin = (
        MegatronTrainEngine(copy.deepcopy(model), lr=1e-3),
        MegatronTrainEngine(copy.deepcopy(model), lr=1e-3),
    )
    ids, am, rm = _batch()
    for e in (eng, twin):
        for _ in range(2):
            e.backward(-(e.logprobs(ids, am, rm) * rm).sum() / rm.sum())
            if _ == 0:
                e.step()  # AdamW state exists; the second backward leaves gradients at the offload
    state = [p for p in eng.model.parameters()] + [p.grad for p in eng.model.parameters()]
    state += [t for st in eng.optimizer.state.values() for t in st.values()]
    assert len(state) == 5 * len(list(eng.model.parameters()))  # weight, grad, step, exp_avg, exp_avg_sq
    before = [t.detach().clone() for t in state]
    eng.offload()
    assert eng.offloaded and not [t for t in state if t.untyped_storage().nbytes()]
    eng.onload()
    assert all(torch.equal(t, b) for t, b in zip(state, before, strict=True))
    assert eng.step()["grad_norm"] == twin.step()["grad_norm"]
    eng.offload()  # an offloaded engine onloads itself when used
    for (n1, a), (n2, b) in zip(eng.export_weights(), twin.export_weights(), strict=True):
        assert n1 == n2 and torch.equal(a, b)


@pytest.mark.slow
def test_the_recipe_trains_checkpoints_and_resumes_on_megatron(tmp_path):
    """`python recipes/rlvr_qwen.py train.engine=megatron`: two steps with a checkpoint each, then
    a third step resumed from the latest checkpoint (its weights and AdamW moments)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    base = [sys.executable, str(root / "recipes" / "rlvr_qwen.py"), "--model", "tiny", "train.engine=megatron",
            "data.digits=1", "data.eval_size=10", "rollout.prompts_per_step=2", "rollout.n=2",
            "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
            f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([*base, "train.steps=2"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 steps," in out.stdout and "held-out accuracy after" in out.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000001", "step_000002"]
    again = subprocess.run([*base, "train.steps=3", "checkpoint.resume=auto"], capture_output=True, text=True,
                           timeout=300, env=env)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert "1 steps," in again.stdout  # steps 1-2 came from the checkpoint
    assert (tmp_path / "ckpt" / "step_000003").is_dir()

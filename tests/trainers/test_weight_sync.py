"""Weights from trainer to rollout in buckets and delta patches (trainers.engines.weight_sync).

The wire format and the patches on plain tensors; then real vLLM (the CPU build, in process) with
rollkit's gloo backend registered in vLLM's weight-transfer factory: a bucketed and a delta sync
from the torch engine after real update steps leave the engine serving exactly what a full reload
serves (vLLM's own checksums of every runtime tensor, greedy tokens and log-probs equal), with the
trainer's log-probs; a receiver that drops a tensor (a test double patched into the worker) and
one that lost its delta copy are caught. The HF engine takes the same stream.
"""

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from trainers.engines import weight_sync as ws
from trainers.engines.weight_sync import (
    Patch,
    WeightSyncError,
    apply_patch,
    encode,
    iter_buckets,
    pack_bucket,
    unpack_bucket,
)

ATOL = 1e-4  # vLLM's processed log-probs against the trainer's, float32 (test_vllm_engine.py)
MODEL_KW = {"hidden_size": 64, "heads": 2, "kv_heads": 1}
TEXTS = ["7+5=", "What is 12+34? ", "Compute 3*9. "]


# --------------------------------------------------------------------------- the wire format


def test_buckets_respect_the_size_and_pull_the_stream_lazily():
    pulled = []

    def stream():
        for i in range(6):
            pulled.append(i)
            yield f"t{i}", torch.full((4,), float(i))  # 16 bytes each

    it = iter_buckets(stream(), 40)
    first = next(it)
    assert [n for n, _ in first] == ["t0", "t1"] and pulled == [0, 1, 2]  # one tensor ahead, no more
    rest = list(it)
    assert [[n for n, _ in b] for b in rest] == [["t2", "t3"], ["t4", "t5"]]
    big = list(iter_buckets([("a", torch.ones(2)), ("big", torch.ones(100)), ("b", torch.ones(2))], 40))
    assert [[n for n, _ in b] for b in big] == [["a"], ["big"], ["b"]]  # a large tensor is a bucket alone
    cast = next(iter_buckets([("w", torch.ones(3, dtype=torch.float64)), ("i", torch.arange(3))], 1 << 20, torch.bfloat16))
    assert [t.dtype for _, t in cast] == [torch.bfloat16, torch.int64]  # integers are not cast
    with pytest.raises(ValueError, match=r"rollout.weight_bucket_mb"):
        next(iter_buckets([], 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_delta_patches_are_exact_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(50, 40, generator=g).to(dtype)
    new = old.clone()
    flat = new.view(-1)
    flat[torch.randperm(flat.numel(), generator=g)[:30]] += 1.0
    flat[3] = -0.0 if old.view(-1)[3] == 0 else -old.view(-1)[3]
    flat[7] = float("nan")
    p = encode("w", new, old)
    assert p.indices is not None and 30 <= p.indices.numel() <= 32 and p.indices.dtype == torch.int32
    meta, wire = pack_bucket([p, encode("d", new, None)])
    (q, d) = unpack_bucket(meta, wire)
    assert d.indices is None and torch.equal(d.values.view(torch.uint8), new.reshape(-1).view(torch.uint8))
    got = apply_patch(q, old.clone())
    assert torch.equal(got.view(torch.uint8), new.view(torch.uint8))  # the bits, NaN and -0.0 included
    assert ws.digest(got) == ws.digest(new)
    same = encode("s", new, new.clone())
    assert same.indices is not None and same.indices.numel() == 0 and same.nbytes == 0


def test_a_bucket_of_mixed_dtypes_and_odd_sizes_unpacks_aligned():
    g = torch.Generator().manual_seed(1)
    tensors = [("a", torch.randn(5, generator=g).bfloat16()), ("b", torch.randn(5, generator=g)),
               ("c", torch.randn(7, 3, generator=g).half()), ("d", torch.arange(3, dtype=torch.int64))]
    old = {n: t.clone() for n, t in tensors}
    for _, t in tensors[:3]:
        t.view(-1)[1] += 1  # one changed element each: odd-sized patches of 2- and 4-byte values
    patches = [encode(n, t, old[n]) for n, t in tensors[:3]] + [encode("d", tensors[3][1], None)]
    assert [p.indices is None for p in patches] == [False, False, False, True]
    meta, flat = pack_bucket(patches)
    for p, (n, t) in zip(unpack_bucket(meta, flat), tensors, strict=True):
        assert torch.equal(apply_patch(p, old[n]) if p.indices is not None else p.values.reshape(p.shape), t), n


def test_a_patch_larger_than_the_tensor_is_sent_dense_and_a_patch_needs_its_base():
    old = torch.zeros(10)
    assert encode("w", torch.ones(10), old).indices is None  # 10 changes x 8 bytes > 40 bytes
    assert encode("w", torch.ones(3), torch.zeros(4)).indices is None  # another shape: dense
    patch = Patch("w", (4,), torch.float32, torch.ones(1), torch.tensor([2], dtype=torch.int32))
    with pytest.raises(WeightSyncError, match=r"'w'.*holds no copy"):
        apply_patch(patch, None)
    with pytest.raises(WeightSyncError, match="holds 8 bytes"):
        unpack_bucket({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]], "nnz": [-1]}, torch.zeros(12, dtype=torch.uint8))


# --------------------------------------------------------------------------- the HF engine


@pytest.fixture(scope="module")
def tok():
    from trainers.models import char_tokenizer

    return char_tokenizer()


@pytest.fixture(scope="module")
def base_model(tok):
    from trainers.models import tiny_qwen2

    return tiny_qwen2(tok, seed=0, **MODEL_KW)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t).input_ids for t in TEXTS]


def trained(model, tok, prompts, steps=2, lr=1e-2):
    """A torch train engine over a copy of ``model`` after ``steps`` real policy-gradient steps
    (Adam: every weight moves); its ``export_weights()`` is what a trainer sends."""
    from rollkit.losses import aggregate, ppo_clip
    from trainers.engines import HFRolloutEngine, SamplingParams, TorchTrainEngine, pack_generations

    train = TorchTrainEngine(copy.deepcopy(model), lr=lr)
    gens = HFRolloutEngine(copy.deepcopy(model), tok).generate(prompts, SamplingParams(n=2, max_tokens=6, seed=1))
    b = pack_generations(gens, tok.pad_token_id)
    adv = torch.linspace(-1.0, 1.0, len(gens))
    for _ in range(steps):
        lp = train.logprobs(b.input_ids, b.attention_mask, b.response_mask)
        train.backward(aggregate(ppo_clip(lp, b.old_logprobs, adv, b.response_mask).loss, b.response_mask, "token-mean"))
        assert train.step()["skipped"] == 0
    train.model.eval()
    return train


def test_hf_engine_takes_the_stream_and_refuses_to_serve_a_half_update(base_model, tok, prompts):
    from trainers.engines import HFRolloutEngine, SamplingParams

    full = HFRolloutEngine(copy.deepcopy(base_model), tok)
    streamed = HFRolloutEngine(copy.deepcopy(base_model), tok, weight_sync="buckets")
    new = trained(base_model, tok, prompts).model
    full.update_weights(new.named_parameters(), version=1)
    streamed.update_weights(new.named_parameters(), version=1)
    for (n, a), (_, b) in zip(full.model.state_dict().items(), streamed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert streamed.metrics()["sync/delta_frac"] == 1.0 and streamed.policy_version == 1
    with pytest.raises(KeyError, match="missing parameters"):
        streamed.update_weights(list(new.named_parameters())[:-1], version=2)
    with pytest.raises(RuntimeError, match="half-loaded by a failed update"):
        streamed.generate(prompts, SamplingParams(max_tokens=2))
    streamed.update_weights(new.named_parameters(), version=2)
    assert len(streamed.generate(prompts, SamplingParams(max_tokens=2))) == 3
    with pytest.raises(ValueError, match=r"rollout.weight_sync"):
        HFRolloutEngine(copy.deepcopy(base_model), tok, weight_sync="nccl")


# --------------------------------------------------------------------------- vLLM in process


@pytest.fixture(scope="module")
def engines(base_model, tok, tmp_path_factory):
    pytest.importorskip("vllm")
    from trainers.engines.vllm_rollout import VLLMRolloutEngine
    from trainers.models import save_model

    path = save_model(base_model, tok, tmp_path_factory.mktemp("tiny_qwen2"))
    built = {}
    try:
        for mode in ("reload", "buckets", "delta"):
            # 20 KiB buckets: the tiny model's 27 tensors travel in several buckets
            built[mode] = VLLMRolloutEngine(path, dtype="float32", max_model_len=256, seed=0,
                                            weight_sync=mode, weight_bucket_mb=0.02)
        yield built
    finally:
        for e in built.values():
            e.shutdown()


def served(engine, prompts):
    from trainers.engines import SamplingParams

    gens = engine.generate(prompts, SamplingParams(n=1, max_tokens=8, temperature=0))
    return [(g.token_ids, g.logprobs) for g in gens], gens


def vllm_checksums(engine):
    """vLLM's own sha256 of every tensor the model keeps (its weight checker's)."""
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    return engine.llm.collective_rpc(lambda w: compute_tensor_digests(w.get_model()))[0]


def test_buckets_and_delta_leave_vllm_as_a_full_reload_does(engines, base_model, tok, prompts):
    from tests.trainers.test_vllm_engine import max_err
    from trainers.engines import SamplingParams

    stats = {}
    for version, steps in ((1, 1), (2, 2)):
        train = trained(base_model, tok, prompts, steps=steps)
        for mode, e in engines.items():
            e.update_weights(train.export_weights(), version=version)
            stats[mode, version] = e.metrics()
        ref = served(engines["reload"], prompts)[0]
        sums = vllm_checksums(engines["reload"])
        for mode in ("buckets", "delta"):
            assert served(engines[mode], prompts)[0] == ref, (mode, version)
            # vLLM's checksums of the tensors it keeps (on CPU the linear layers' weights live only in
            # oneDNN's packed copies, which no checksum reaches: the equal outputs cover them)
            assert vllm_checksums(engines[mode]) == sums, (mode, version)
            assert engines[mode].policy_version == version
            gens = engines[mode].generate(prompts, SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=2))
            assert max_err(train.model, gens, tok, 1.0) < ATOL, mode
    assert stats["buckets", 1]["sync/buckets"] > 3 and stats["buckets", 2]["sync/delta_frac"] == 1.0
    # the sender never held more than about one bucket (20 KiB; the 25.6 KB embedding is a bucket
    # of its own) twice over (its tensors and their packed copy), a fraction of the model
    biggest = max(p.numel() * 4 for p in base_model.parameters())
    peak, model_bytes = stats["buckets", 1]["sync/peak_bucket_bytes"], stats["buckets", 1]["sync/dense_bytes"]
    assert peak <= 2 * max(0.02 * 2**20, biggest) and peak < model_bytes / 4, (peak, model_bytes)
    assert stats["delta", 1]["sync/delta_frac"] == 1.0  # the first sync has nothing to patch
    # another model (2 steps from the base, not 1 more): patches where they are smaller, never more
    assert 0 < stats["delta", 2]["sync/bytes"] <= stats["delta", 2]["sync/dense_bytes"]
    # a sync of unchanged weights moves no tensor bytes at all
    engines["delta"].update_weights(train.export_weights(), version=3)
    assert engines["delta"].metrics()["sync/bytes"] == 0
    assert served(engines["delta"], prompts)[0] == served(engines["reload"], prompts)[0]


def test_delta_of_a_sparse_change_and_the_trainers_logprobs(engines, base_model, tok, prompts):
    from tests.trainers.test_vllm_engine import max_err
    from trainers.engines import SamplingParams

    model = trained(base_model, tok, prompts, steps=2).model
    e = engines["delta"]
    e.update_weights(model.named_parameters(), version=10)
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[:: max(1, p.numel() // 8)] += 0.05  # about 8 elements of each tensor
    e.update_weights(model.named_parameters(), version=11)
    m = e.metrics()
    assert m["sync/delta_frac"] < 0.1, m
    gens = e.generate(prompts, SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=3))
    assert max_err(model, gens, tok, 1.0) < ATOL and all(g.policy_version == 11 for g in gens)


def test_a_receiver_that_lost_its_copy_gets_everything_dense(engines, base_model, tok, prompts):
    model = trained(base_model, tok, prompts, steps=1).model
    e = engines["delta"]
    e.update_weights(model.named_parameters(), version=20)
    e.llm.collective_rpc("rollkit_weight_forget")  # e.g. a worker restarted
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1.0
    e.update_weights(model.named_parameters(), version=21)
    assert e.metrics()["sync/delta_frac"] == 1.0  # the version check sent it all
    engines["reload"].update_weights(model.named_parameters(), version=21)
    assert served(e, prompts)[0] == served(engines["reload"], prompts)[0]


def _drop_one_tensor(worker):
    """Test double (worker side): from now on the transfer engine loses ``model.norm.weight``: the
    model never loads it and the worker's digests do not list it (an update never delivered)."""
    eng = worker.weight_transfer_engine
    load = eng.model.load_weights
    eng.model.load_weights = lambda weights: load([(n, t) for n, t in weights if n != "model.norm.weight"])
    real = type(eng).receive_weights

    def receive(info):
        real(eng, info)
        eng.receiver.digests.pop("model.norm.weight", None)

    eng.receive_weights = receive
    return True


def _restore(worker):
    eng = worker.weight_transfer_engine
    eng.__dict__.pop("receive_weights", None)
    eng.model.__dict__.pop("load_weights", None)
    return True


def test_a_tensor_that_never_arrives_fails_the_sync_by_name(engines, base_model, tok, prompts):
    from trainers.engines import SamplingParams

    e = engines["buckets"]
    model = trained(base_model, tok, prompts, steps=1).model
    e.llm.collective_rpc(_drop_one_tensor)
    try:
        with pytest.raises(WeightSyncError, match=r"vllm engine .*version 30: tensor 'model.norm.weight' never arrived"):
            e.update_weights(model.named_parameters(), version=30)
        with pytest.raises(RuntimeError, match="half-loaded"):
            e.generate(prompts, SamplingParams(max_tokens=2))
    finally:
        e.llm.collective_rpc(_restore)
    e.update_weights(model.named_parameters(), version=31)
    assert e.policy_version == 31 and len(e.generate(prompts, SamplingParams(max_tokens=2))) == 3


def test_bad_updates_are_refused_by_name_and_the_engine_waits_for_a_good_one(engines, base_model, prompts):
    from trainers.engines import SamplingParams

    e = engines["delta"]
    with pytest.raises(KeyError, match="unknown parameter 'nope'"):
        e.update_weights([("nope", torch.zeros(2))], version=40)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape"):
        e.update_weights([("model.norm.weight", torch.zeros(3))], version=40)
    with pytest.raises(KeyError, match="missing parameters"):
        e.update_weights(list(base_model.named_parameters())[:3], version=40)
    with pytest.raises(RuntimeError, match="half-loaded"):
        e.generate(prompts, SamplingParams(max_tokens=2))
    e.update_weights(base_model.named_parameters(), version=41)
    assert e.metrics()["sync/delta_frac"] == 1.0  # after a failure everything is sent again
    assert served(e, prompts)[0] is not None
    from trainers.engines.vllm_rollout import VLLMRolloutEngine

    with pytest.raises(ValueError, match=r"rollout.weight_sync must be one of"):
        VLLMRolloutEngine(e.model_path, weight_sync="nccl")
    with pytest.raises(ValueError, match=r"rollout.weight_bucket_mb must be > 0"):
        VLLMRolloutEngine(e.model_path, weight_sync="buckets", weight_bucket_mb=0)


# --------------------------------------------------------------------------- the probe, in the loop


class StaleRollout:
    """Test double around a real HF rollout engine: ``update_weights`` takes the version and drops
    the weights (the silent failure of an adapter never loaded or a sleep that lost an update)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def update_weights(self, named_tensors, version):
        for _ in named_tensors:
            pass
        self.engine.policy_version = int(version)


def _sync_trainer(tmp_path, tok, model, rollout, *overrides):
    from trainers.config import load_config
    from trainers.engines import TorchTrainEngine
    from trainers.loops import SyncTrainer

    cfg = load_config(["--model", "tiny", "data.digits=1", "data.eval_size=8", "eval.before=false", "eval.every=0",
                       "rollout.prompts_per_step=2", "rollout.n=2", "train.lr=1e-2", "model.tiny_heads=2",
                       "model.tiny_kv_heads=1", f"logging.dir={tmp_path}", *overrides])
    train = TorchTrainEngine(model, lr=cfg.train.lr)
    return SyncTrainer(cfg, rollout=rollout, train=train, tokenizer=tok)


def test_the_probe_passes_a_true_sync_and_stops_a_stale_one_by_name(tmp_path, tok, base_model):
    from trainers.engines import HFRolloutEngine

    good = _sync_trainer(tmp_path / "good", tok, copy.deepcopy(base_model), HFRolloutEngine(copy.deepcopy(base_model), tok))
    m = good.step()
    assert 0 <= m["sync/probe_gap"] < 1e-4, m["sync/probe_gap"]  # float32 both ends: kernel noise
    stale = _sync_trainer(tmp_path / "stale", tok, copy.deepcopy(base_model),
                          StaleRollout(HFRolloutEngine(copy.deepcopy(base_model), tok)))
    with pytest.raises(WeightSyncError, match=r"rollout.engine=hf: after the sync of version 1 the rollout's "
                                              r"log-probs differ from the trainer's by .* it does not serve"):
        stale.step()
    off = _sync_trainer(tmp_path / "off", tok, copy.deepcopy(base_model),
                        StaleRollout(HFRolloutEngine(copy.deepcopy(base_model), tok)), "rollout.weight_check=false")
    assert "sync/probe_gap" not in off.step()

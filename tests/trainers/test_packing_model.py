"""rollkit.packing on a real model: transformers' tiny Qwen2 run packed (one row, the layout's
position ids, the block-diagonal causal mask) gives the padded batch's logits and log-probs."""

from __future__ import annotations

import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

from rollkit.packing import pack_bins, pack_tokens, packed_layout, response_positions, varlen_attention_mask
from trainers.engines.base import pack, position_ids_from_mask
from trainers.models import char_tokenizer, tiny_qwen2


def test_tiny_qwen2_packed_logits_equal_the_padded_ones():
    """transformers' Qwen2 (SDPA) with the packed row, layout position ids and a [1, 1, N, N]
    additive mask from varlen_attention_mask: the logits of every real token, and so the
    response log-probs, agree with the padded batch's (float32, 1e-5)."""
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    vocab = len(tok)

    def draw(lo, hi):
        return torch.randint(4, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    prompts = [draw(1, 9) for _ in range(7)]
    responses = [draw(0, 8) for _ in range(7)]
    batch = pack(prompts, responses, tok.pad_token_id)
    ids, am, rmask, P = batch.input_ids, batch.attention_mask, batch.response_mask, batch.prompt_len
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am)).logits
    want_lp = torch.log_softmax(padded[:, P - 1 : -1], -1).gather(-1, ids[:, P:, None])[..., 0]

    bins = pack_bins(am.sum(-1), 24)
    assert len(bins) > 1
    for rows in bins:
        lay = packed_layout(am[rows])
        allowed = varlen_attention_mask(lay.cu_seqlens, lay.indices.shape[0])
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf)[None, None]
        pids = pack_tokens(ids[rows], lay)
        with torch.no_grad():
            out = model(input_ids=pids, attention_mask=additive, position_ids=lay.position_ids).logits
        real = am[rows].bool()
        torch.testing.assert_close(out[0], padded[rows][real], atol=1e-5, rtol=1e-5)
        pos = response_positions(lay, P, rmask[rows])
        lp = torch.log_softmax(out[0, pos.clamp(min=0)], -1)
        lp = lp.gather(-1, pids[0, (pos + 1).clamp(max=pids.shape[1] - 1)][..., None])[..., 0]
        m = rmask[rows]
        torch.testing.assert_close(lp[m], want_lp[rows][m], atol=1e-5, rtol=1e-5)

"""A small ragged batch in the trainers' layout, shared by the packed and compiled engine tests."""

from __future__ import annotations

import torch


def ragged_batch(seed=0, B=7, P=6, T=9, vocab=30):
    """Left-padded prompts, right-padded responses of mixed lengths (one empty), a tool token
    (real, not trained) inside one response, two rows sharing a prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + T), generator=g)
    am = torch.ones(B, P + T, dtype=torch.long)
    plens, rlens = [6, 3, 1, 4, 6, 2, 2], [9, 2, 5, 0, 3, 7, 1]
    for b in range(B):
        am[b, : P - plens[b]] = 0
        am[b, P + rlens[b] :] = 0
    ids[6] = ids[5]
    ids = ids * am
    rm = am[:, P:].bool().clone()
    rm[2, 3] = False  # an environment token: attended to, not trained
    return ids, am, rm

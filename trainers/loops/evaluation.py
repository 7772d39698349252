"""Held-out evaluation of the RLVR loops: greedy accuracy, and pass@k / mean@k with n samples.

* :func:`greedy_accuracy`: one greedy response per held-out prompt, scored by the reward pool;
  ``eval/accuracy`` overall, per ``data_source`` when there are several, and
  ``eval/domain/<d>/accuracy`` per domain of a ``data.domains`` run.
* :func:`sampled_metrics`: ``eval.n`` responses per prompt at ``eval.temperature``; a response is
  correct when its reward is >= 1; ``eval/pass@k`` and ``eval/mean@k`` for each ``k`` of
  ``eval.k`` (default 1 and n), overall and per domain, with the unbiased estimator of Chen et
  al. 2021 (arXiv:2107.03374; :func:`rollkit.domains.pass_at_k`, :func:`rollkit.domains.mean_at_k`),
  averaged over prompts.
* :func:`held_out_metrics`: both, as the loops' ``evaluate()`` reports them; ``recipes/evaluate.py``
  runs it on a saved model without training.

``roles`` is anything with a ``rollout`` engine and a ``rewards`` pool (a
:class:`~trainers.roles.Roles`, or the evaluation command's pair).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from rollkit.domains import correct_counts, mean_at_k, pass_at_k
from trainers.config import Config
from trainers.data import Prompt
from trainers.domains import domain_masks
from trainers.engines.base import SamplingParams, iter_generations
from trainers.loops.common import Codec, progress_bar

__all__ = ["greedy_accuracy", "held_out_metrics", "sampled_metrics"]

EVAL_SEED = 0  # the sampled evaluation's seed: the same samples before and after training's changes


def _generate(roles: Any, ids: list[list[int]], params: SamplingParams, progress: bool) -> list[Any]:
    """The rollout role's generations of ``ids``, ordered by prompt."""
    if not progress:
        return roles.rollout.generate(ids, params)
    bar = progress_bar(len(ids) * params.n, 0, "eval", unit="sample")
    gens = []
    for g in iter_generations(roles.rollout, ids, params):
        gens.append(g)
        bar.update(1)
    bar.close()
    return sorted(gens, key=lambda g: g.prompt_index)  # stable


def _score(roles: Any, codec: Codec, prompts: list[Prompt], gens: list[Any]) -> list[float]:
    for k, g in enumerate(gens):
        roles.rewards.submit(k, codec.decode(g.token_ids), prompts[g.prompt_index])
    rewards = roles.rewards.gather()
    return [rewards[k] for k in range(len(gens))]


def greedy_accuracy(
    roles: Any, codec: Codec, prompts: list[Prompt], max_tokens: int, *, progress: bool = False
) -> dict[str, float]:
    """Greedy accuracy of the rollout role on ``prompts``, overall (``eval/accuracy``), per
    ``data_source`` when there are several (``eval/accuracy/<source>``) and per domain
    (``eval/domain/<d>/accuracy``), scored by the reward pool. ``progress``: a progress bar
    (samples as the engine finishes them, with a time estimate)."""
    if not prompts:
        return {}
    params = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, seed=0)
    gens = _generate(roles, [codec.encode(p) for p in prompts], params, progress)
    rewards = _score(roles, codec, prompts, gens)
    by: dict[str, list[float]] = defaultdict(list)
    by_domain: dict[str, list[float]] = defaultdict(list)
    for k, g in enumerate(gens):
        by[prompts[g.prompt_index].data_source].append(rewards[k])
        by_domain[prompts[g.prompt_index].domain].append(rewards[k])
    out = {"eval/accuracy": sum(rewards) / len(rewards)}
    if len(by) > 1:
        out.update({f"eval/accuracy/{k}": sum(v) / len(v) for k, v in by.items()})
    out.update({f"eval/domain/{d}/accuracy": sum(v) / len(v) for d, v in by_domain.items() if d})
    return out


def sampled_metrics(
    roles: Any, codec: Codec, prompts: list[Prompt], cfg: Config, *, progress: bool = False
) -> dict[str, float]:
    """pass@k and mean@k of ``cfg.eval.n`` samples per prompt at ``cfg.eval.temperature``
    (``cfg.eval.max_tokens`` each, the rollout's top-p / top-k), for each ``k`` of ``cfg.eval.k``
    (default ``[1, n]``): ``eval/pass@k``, ``eval/mean@k`` and per domain
    ``eval/domain/<d>/pass@k``, ``eval/domain/<d>/mean@k``. ``{}`` when ``eval.n == 1``."""
    e = cfg.eval
    if e.n <= 1 or not prompts:
        return {}
    params = SamplingParams(
        n=e.n, temperature=e.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        max_tokens=e.max_tokens, seed=EVAL_SEED,
    )  # fmt: skip
    gens = _generate(roles, [codec.encode(p) for p in prompts], params, progress)
    rewards = _score(roles, codec, prompts, gens)
    correct = torch.tensor([r >= 1 for r in rewards], dtype=torch.bool)
    pids = torch.tensor([g.prompt_index for g in gens], dtype=torch.int64)
    num, c = correct_counts(correct, pids)  # problems in sorted prompt index order
    order = sorted(set(pids.tolist()))
    domains = [prompts[i].domain for i in order]
    out: dict[str, float] = {}
    masks = domain_masks(domains)
    for k in sorted(set(e.k or [1, e.n])):
        pk, mk = pass_at_k(num, c, k=k), mean_at_k(num, c, k=k)
        out[f"eval/pass@{k}"], out[f"eval/mean@{k}"] = float(pk.mean()), float(mk.mean())
        for d, sel in masks.items():
            if d:
                out[f"eval/domain/{d}/pass@{k}"] = float(pk[sel].mean())
                out[f"eval/domain/{d}/mean@{k}"] = float(mk[sel].mean())
    return out


def held_out_metrics(
    roles: Any, codec: Codec, prompts: list[Prompt], cfg: Config, *, progress: bool = False
) -> dict[str, float]:
    """:func:`greedy_accuracy` (``eval.max_tokens``) and, with ``eval.n > 1``, :func:`sampled_metrics`."""
    out = greedy_accuracy(roles, codec, prompts, cfg.eval.max_tokens, progress=progress)
    out.update(sampled_metrics(roles, codec, prompts, cfg, progress=progress))
    return out

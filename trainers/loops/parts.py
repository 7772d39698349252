"""What the sync and async RLVR loops are both made of, built once for either."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainers.config import Config
from trainers.data import Prompt, PromptIterator
from trainers.domains import DomainIterator, make_iterator, run_prompts
from trainers.loops.collect import RequestMaker
from trainers.loops.common import Codec
from trainers.loops.update import GroupUpdate
from trainers.roles import Roles, build_roles

__all__ = ["RLVRParts", "build_parts"]


@dataclass
class RLVRParts:
    """The roles, the prompts (train / held out) and their encoding and order, the per-request
    length budgets, and the group update."""

    roles: Roles
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    codec: Codec
    iterator: PromptIterator | DomainIterator
    maker: RequestMaker
    update: GroupUpdate


def build_parts(
    cfg: Config,
    *,
    train_prompts: list[Prompt] | None = None,
    eval_prompts: list[Prompt] | None = None,
    **roles: Any,
) -> RLVRParts:
    """The parts of ``cfg``'s loop: :func:`trainers.roles.build_roles` with ``roles`` (rollout,
    train, tokenizer, model, reward_fn, reference), the prompts (default
    :func:`trainers.domains.run_prompts`), a prompt iterator seeded with ``cfg.seed``
    (:func:`trainers.domains.make_iterator`: per-domain quotas with ``data.domains``)."""
    r = build_roles(cfg, **roles)
    try:
        if train_prompts is None or eval_prompts is None:
            tp, ep = run_prompts(cfg)
            train_prompts = tp if train_prompts is None else train_prompts
            eval_prompts = ep if eval_prompts is None else eval_prompts
        codec = Codec(r.tokenizer, cfg.data.chat_template)
        return RLVRParts(
            roles=r,
            train_prompts=train_prompts,
            eval_prompts=eval_prompts,
            codec=codec,
            iterator=make_iterator(cfg, train_prompts),
            maker=RequestMaker(cfg),
            update=GroupUpdate(cfg, r, codec.pad_id),
        )
    except BaseException:
        r.close()
        raise


def attach(loop: Any, parts: RLVRParts) -> None:
    """Give ``loop`` the parts as attributes (and the roles' rollout, train, learner, tokenizer
    and reward pool as shortcuts)."""
    for name in ("roles", "train_prompts", "eval_prompts", "codec", "iterator", "maker", "update"):
        setattr(loop, name, getattr(parts, name))
    r = parts.roles
    loop.rollout, loop.train, loop.learner, loop.tok, loop.rewards = (
        r.rollout,
        r.train,
        r.learner,
        r.tokenizer,
        r.rewards,
    )

"""A learned reward model as a verifier: a sequence-classification model's scalar score of
prompt + response (ROLL's ``reward_model`` worker; the reward model of RLHF, Ouyang et al.
2022, arXiv:2203.02155).

The scorer's input is the conversation the policy had: through the tokenizer's chat template
when it has one (the prompt's chat messages, or its text as one user turn, then the completion
as the assistant turn), else the prompt text and the completion concatenated, with EOS
appended; longer than ``max_length`` tokens it is truncated on the left (the end of the
response is kept). The score is the model's one logit at the last token that is not padding
(Hugging Face's ``*ForSequenceClassification`` pooling); batches are padded on the right, so a
sample scores the same alone or in any batch. :func:`encode_reward_input` and
:func:`reward_scores` are shared with the trainer (``offline.loss=rm`` in
:mod:`trainers.loops.offline`), so the model is scored exactly as it was trained.
Guide: ``docs/rewards-workers.md`` (A learned reward model).

>>> RewardModelVerifier(model_path="")
Traceback (most recent call last):
...
ValueError: model_path must be a non-empty str (a sequence-classification checkpoint directory), got ''
"""

from __future__ import annotations

import copy
import json
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from trainers.data import Prompt, has_chat_template
from trainers.deps import require
from trainers.models import is_hub_id

__all__ = [
    "RewardModelVerifier",
    "encode_reward_input",
    "is_reward_checkpoint",
    "reward_model_from_lm",
    "reward_scores",
]

_LOAD_LOCK = threading.Lock()


# --------------------------------------------------------------------------- shared with training


def encode_reward_input(
    tokenizer: Any, prompt: Any, completion: str, max_length: int | None = None
) -> list[int]:
    """Token ids the reward model scores for ``completion`` after ``prompt`` (a string or chat
    messages): the chat template over the prompt's messages (a string: one user turn) plus
    ``{"role": "assistant", "content": completion}`` when the tokenizer has a template, else
    ``prompt + completion`` and EOS. Truncated on the left to ``max_length`` (None: no limit).

    >>> from trainers.models import char_tokenizer
    >>> tok = char_tokenizer()
    >>> ids = encode_reward_input(tok, "3+4=", "7")
    >>> tok.decode(ids), tok.decode(encode_reward_input(tok, "3+4=", "7", max_length=2))
    ('3+4=7<eos>', '7<eos>')
    """
    if has_chat_template(tokenizer):
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = tokenizer.apply_chat_template(
            [*turns, {"role": "assistant", "content": completion}], tokenize=False
        )
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    else:
        if not isinstance(prompt, str):
            prompt = "\n".join(str(m["content"]) for m in prompt)
        ids = list(tokenizer(prompt + completion, add_special_tokens=False).input_ids)
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    return ids if max_length is None else ids[-max_length:]


def reward_scores(
    model: Any,
    seqs: Sequence[Sequence[int]],
    pad_id: int,
    *,
    device: str | torch.device = "cpu",
    autocast: torch.dtype | None = None,
) -> torch.Tensor:  # [B] float32
    """The ``[B]`` float32 scores of a ``num_labels=1`` sequence-classification ``model`` on the
    token sequences ``seqs``, in one forward, padded on the right with ``pad_id`` (the model's
    ``config.pad_token_id``: its pooling reads the last token that is not ``pad_id``). Keeps
    the graph unless called under ``torch.no_grad()``."""
    if not seqs:
        return torch.zeros(0)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    device = torch.device(device)
    with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    if logits.shape[-1] != 1:
        raise ValueError(f"model: a reward model has num_labels=1, this one scores {logits.shape[-1]} labels")
    return logits[:, 0].float()


def reward_model_from_lm(lm: Any, pad_token_id: int, *, seed: int = 0) -> Any:
    """A ``num_labels=1`` sequence-classification model over the backbone of the causal LM
    ``lm`` (its weights copied; the new linear score head initialised from ``seed``, as
    ``from_pretrained`` initialises it from a causal checkpoint), with ``pad_token_id`` set."""
    transformers = require("transformers")
    config = copy.deepcopy(lm.config)
    config.num_labels, config.pad_token_id, config.architectures = 1, pad_token_id, None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        rm = transformers.AutoModelForSequenceClassification.from_config(config)
    rm.base_model.load_state_dict(lm.base_model.state_dict(), strict=True)
    rm.config._attn_implementation = lm.config._attn_implementation
    return rm.to(dtype=lm.dtype)


def is_reward_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory ``path`` holds a ``*ForSequenceClassification`` model."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    archs = json.loads(f.read_text()).get("architectures") or []
    return any(str(a).endswith("ForSequenceClassification") for a in archs)


def _check_checkpoint(model_path: str) -> None:
    """A one-line ``ValueError`` naming ``model_path`` unless it is a local ``num_labels=1``
    sequence-classification checkpoint (a hub name is checked when it is loaded)."""
    p = Path(model_path)
    if not p.is_dir():
        if is_hub_id(model_path):
            return
        raise ValueError(f"model_path: no such checkpoint directory: {model_path}")
    f = p / "config.json"
    if not f.is_file():
        raise ValueError(f"model_path: {model_path} has no config.json (not a Hugging Face checkpoint)")
    cfg = json.loads(f.read_text())
    if not is_reward_checkpoint(p):
        archs = ", ".join(cfg.get("architectures") or ["no architectures"])
        raise ValueError(
            f"model_path: {model_path} holds {archs}, not a sequence-classification model "
            "(train a reward model with recipes/reward_model.py)"
        )
    labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
    if labels != 1:
        raise ValueError(f"model_path: {model_path} scores {labels} labels; a reward model has num_labels=1")


def _check_int(name: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


# --------------------------------------------------------------------------- the verifier


@dataclass(frozen=True)
class RewardModelVerifier:
    """The reward of ``(completion, prompt)`` is a reward model's scalar score (module docstring).

    Args:
        model_path: a Hugging Face checkpoint of a ``*ForSequenceClassification`` model with
            ``num_labels=1`` and its tokenizer (``recipes/reward_model.py`` writes one); a
            missing directory or another kind of model raises ``ValueError`` here.
        max_length: the most tokens scored (prompt + response; longer: truncated on the left).
        batch_size: responses per forward pass in :meth:`score_batch`; a
            :class:`~trainers.rewards.RewardPool` hands the verifier this many samples at once.
        device: where the model runs (``"cpu"``, ``"cuda"``).

    The model and tokenizer load on first use, or in :meth:`setup` (a pool worker calls it
    once before its first sample); the verifier pickles without them, so each process /
    Ray worker loads its own. Scores are raw logits (unbounded; a Bradley-Terry model is
    defined up to a constant, so compare them within one reward model).
    """

    model_path: str
    max_length: int = 512
    batch_size: int = 8
    device: str = "cpu"
    _loaded: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.model_path, os.PathLike):
            object.__setattr__(self, "model_path", os.fspath(self.model_path))
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(
                "model_path must be a non-empty str (a sequence-classification checkpoint "
                f"directory), got {self.model_path!r}"
            )
        _check_int("max_length", self.max_length, 1)
        _check_int("batch_size", self.batch_size, 1)
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a non-empty str such as 'cpu' or 'cuda', got {self.device!r}")
        _check_checkpoint(self.model_path)

    def __getstate__(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["_loaded"] = {}  # loaded again where it is unpickled
        return state

    def setup(self) -> None:
        """Load the model and tokenizer (a :class:`~trainers.rewards.RewardPool` worker calls it
        once before its first sample)."""
        self._ensure_loaded()

    def _ensure_loaded(self) -> tuple[Any, Any]:
        with _LOAD_LOCK:
            if "model" not in self._loaded:
                transformers = require("transformers")
                try:
                    model = transformers.AutoModelForSequenceClassification.from_pretrained(
                        self.model_path, dtype=torch.float32
                    )
                    tok = transformers.AutoTokenizer.from_pretrained(self.model_path)
                except (OSError, ValueError) as e:
                    why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                    raise ValueError(f"model_path: cannot load {self.model_path!r}: {why}") from None
                if model.config.num_labels != 1:
                    raise ValueError(
                        f"model_path: {self.model_path} scores {model.config.num_labels} labels; "
                        "a reward model has num_labels=1"
                    )
                if model.config.pad_token_id is None:
                    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
                    model.config.pad_token_id = pad
                self._loaded.update(model=model.to(self.device).eval(), tokenizer=tok)
            return self._loaded["model"], self._loaded["tokenizer"]

    def encode(self, completion: str, prompt: Prompt) -> list[int]:
        """The token ids scored for one sample (:func:`encode_reward_input`)."""
        _, tok = self._ensure_loaded()
        return encode_reward_input(tok, prompt.text, completion, self.max_length)

    def score_batch(self, completions: Sequence[str], prompts: Sequence[Prompt]) -> list[float]:
        """Scores of ``completions[i]`` for ``prompts[i]``, ``batch_size`` per forward pass; each
        equals the sample's score alone (right padding, last-token pooling)."""
        if len(completions) != len(prompts):
            raise ValueError(f"prompts: {len(prompts)} prompts for {len(completions)} completions")
        for c in completions:
            if not isinstance(c, str):
                raise TypeError(f"completions must be str, got {type(c).__name__}")
        if not completions:
            return []
        model, _ = self._ensure_loaded()
        seqs = [self.encode(c, p) for c, p in zip(completions, prompts)]
        out: list[float] = []
        with torch.inference_mode():
            for i in range(0, len(seqs), self.batch_size):
                part = seqs[i : i + self.batch_size]
                out += reward_scores(model, part, model.config.pad_token_id, device=self.device).tolist()
        return out

    def __call__(self, completion: str, prompt: Prompt) -> float:
        """The score of one sample; a verifier for a RewardPool."""
        score = self.score_batch([completion], [prompt])[0]
        if not math.isfinite(score):
            raise ValueError(f"the reward model returned a non-finite score {score}")
        return score

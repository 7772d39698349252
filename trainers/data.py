"""Prompts and verifiers: verl-style JSONL / Parquet files and a procedural addition task.

A :class:`Prompt` is the text (or chat messages) of a question, its ground-truth answer and
its ``data_source`` (for accuracy per source). Files use verl's field names: ``prompt`` (a
string or a list of ``{"role", "content"}`` messages), the answer in ``answer``,
``ground_truth`` or ``reward_model.ground_truth``, and ``data_source``.

:func:`addition_task` generates ``a+b`` questions (seeded, train and held-out splits
disjoint). :class:`PromptIterator` walks a prompt list in seeded shuffled epochs and is
checkpointable (``state_dict``: epoch and position).

>>> train, held_out = addition_task(digits=1, eval_size=10, seed=0)
>>> len(train) + len(held_out), {(p.text) for p in train} & {p.text for p in held_out}
(100, set())
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Prompt",
    "PromptIterator",
    "addition_task",
    "build_prompts",
    "encode_prompt",
    "has_chat_template",
    "load_prompts",
]


@dataclass(frozen=True)
class Prompt:
    """One question: ``text`` (a string, or chat messages), ``answer``, ``data_source``."""

    text: Any
    answer: str
    data_source: str = "default"


def addition_task(
    *, digits: int = 2, eval_size: int = 100, seed: int = 0, source: str | None = None
) -> tuple[list[Prompt], list[Prompt]]:
    """``(train, held_out)``: every ``a+b`` with ``digits``-digit operands, shuffled with
    ``seed``; the first ``eval_size`` pairs are held out (so the splits are disjoint).

    ``text`` is ``"a+b="``; :func:`encode_prompt` turns it into a chat question when the
    tokenizer has a chat template.
    """
    if digits not in (1, 2, 3):
        raise ValueError(f"digits must be 1, 2 or 3, got {digits}")
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    hi = 10**digits
    pairs = [(a, b) for a in range(lo, hi) for b in range(lo, hi)]
    if not 0 <= eval_size < len(pairs):
        raise ValueError(f"eval_size must be in [0, {len(pairs)}), got {eval_size}")
    random.Random(seed).shuffle(pairs)
    src = source or f"addition_{digits}d"
    prompts = [Prompt(f"{a}+{b}=", str(a + b), src) for a, b in pairs]
    return prompts[eval_size:], prompts[:eval_size]


def _answer_of(rec: dict[str, Any]) -> str:
    for key in ("answer", "ground_truth", "solution"):
        if key in rec and rec[key] is not None:
            return str(rec[key])
    rm = rec.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") is not None:
        return str(rm["ground_truth"])
    raise ValueError("no answer field (answer, ground_truth or reward_model.ground_truth)")


def load_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a ``.jsonl`` file, or a ``.parquet`` file (needs ``pyarrow``)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: no such file: {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow (or use JSONL)") from None
        records = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        records = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"path: {path} line {i} is not JSON: {e}") from None
    else:
        raise ValueError(f"path: {path} must end in .jsonl or .parquet")
    out = []
    for i, rec in enumerate(records):
        if "prompt" not in rec:
            raise ValueError(f"path: {path} record {i} has no 'prompt' field")
        try:
            answer = _answer_of(rec)
        except ValueError as e:
            raise ValueError(f"path: {path} record {i}: {e}") from None
        text = rec["prompt"]
        if not isinstance(text, str):
            text = [dict(m) for m in text]
        out.append(Prompt(text, answer, str(rec.get("data_source") or "default")))
    if not out:
        raise ValueError(f"path: {path} holds no prompts")
    return out


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, prompt: Prompt, chat_template: str = "auto") -> list[int]:
    """Token ids of ``prompt``: through the chat template (``"auto"``: when the tokenizer has
    one; ``"on"``; ``"off"``), else the plain text (``"12+34="``)."""
    if chat_template not in ("auto", "on", "off"):
        raise ValueError(f"chat_template must be auto, on or off, got {chat_template!r}")
    use_chat = chat_template == "on" or (chat_template == "auto" and has_chat_template(tokenizer))
    text = prompt.text
    if use_chat:
        if isinstance(text, str):
            q = text[:-1] if text.endswith("=") else text
            text = [{"role": "user", "content": f"What is {q}? Answer with just the number."}]
        ids = tokenizer.apply_chat_template(text, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    if not isinstance(text, str):
        text = "\n".join(m["content"] for m in text)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


class PromptIterator:
    """Batches of prompts in shuffled epochs, deterministic from ``seed``, checkpointable.

    Epoch ``e`` visits the prompts in the order of ``random.Random(seed + e)``; the state is
    just ``(epoch, position)``, so a resumed iterator yields exactly what the original would.

    >>> it = PromptIterator(list(range(5)), seed=0)
    >>> a = it.next_batch(3); s = it.state_dict(); b = it.next_batch(4)
    >>> it2 = PromptIterator(list(range(5)), seed=0); it2.load_state_dict(s)
    >>> it2.next_batch(4) == b
    True
    """

    def __init__(self, items: Sequence[Any], *, seed: int = 0) -> None:
        if not items:
            raise ValueError("items: empty prompt list")
        self.items = list(items)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[Any]:
        out = []
        while len(out) < size:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._make_order()
            out.append(self.items[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._make_order()


def build_prompts(cfg: Any) -> tuple[list[Prompt], list[Prompt]]:
    """``(train, held_out)`` prompts of a :class:`~trainers.config.Config`: from
    ``data.train_file`` / ``data.eval_file``, or the procedural ``data.task`` (the first
    ``data.eval_size`` records are held out when there is no eval file)."""
    d = cfg.data
    if d.train_file:
        train = load_prompts(d.train_file)
        if d.eval_file:
            return train, load_prompts(d.eval_file)
        return train[d.eval_size :], train[: d.eval_size]
    if d.task != "addition":
        raise ValueError(f"data.task: unknown task {d.task!r} (known: addition); or set data.train_file")
    return addition_task(digits=d.digits, eval_size=d.eval_size, seed=cfg.seed)

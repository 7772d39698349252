"""Offline data for SFT and preference training: prompt/completion and prompt/chosen/rejected
records from JSONL or Parquet files, and a generated pairs set from the addition task.

Files use TRL's field names: ``prompt`` (a string or chat messages, as in
:func:`trainers.data.load_prompts`), ``completion`` for SFT (``chosen``, ``response`` or
``answer`` are read too, so a pairs file doubles as an SFT file of its chosen answers), and
``chosen`` / ``rejected`` for preference pairs. A bad file or record raises one ``ValueError``
line naming the field, the file and the line (or row). Guide: ``docs/offline.md``.

>>> train, _ = addition_task(digits=1, eval_size=10, seed=0)
>>> recs = addition_pairs(train[:2], seed=0)
>>> sorted(recs[0]), recs[0]["chosen"] != recs[0]["rejected"]
(['chosen', 'data_source', 'prompt', 'rejected'], True)
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.data import Prompt, addition_task, prompt_text, read_records

__all__ = [
    "Example",
    "Pair",
    "addition_pairs",
    "addition_pairs_file",
    "load_examples",
    "load_pairs",
    "write_jsonl",
]

#: the fields an SFT record's target may be in, in order
COMPLETION_FIELDS = ("completion", "chosen", "response", "answer")


@dataclass(frozen=True)
class Example:
    """One SFT example: ``prompt`` (text or chat messages) -> ``completion`` (text)."""

    prompt: Any
    completion: str


@dataclass(frozen=True)
class Pair:
    """One preference pair: ``prompt`` with a ``chosen`` and a ``rejected`` completion."""

    prompt: Any
    chosen: str
    rejected: str


def _text(where: str, field: str, rec: dict[str, Any], key: str) -> str:
    v = rec.get(key)
    if not isinstance(v, str):
        got = "missing" if key not in rec else f"{type(v).__name__} {v!r:.40}"
        raise ValueError(f"{field}: {where}: '{key}' must be a string, got {got}")
    return v


def _records(path: str | Path, field: str) -> list[tuple[str, dict[str, Any]]]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{field}: no such file: {path}")
    recs = read_records(path, field)
    if not recs:
        raise ValueError(f"{field}: {path} holds no records")
    for where, rec in recs:
        if "prompt" not in rec:
            raise ValueError(f"{field}: {where} has no 'prompt' field")
    return recs


def load_examples(path: str | Path, *, field: str = "path") -> list[Example]:
    """SFT examples from a ``.jsonl`` / ``.parquet`` file: ``prompt`` and the target in the first
    of ``completion``, ``chosen``, ``response``, ``answer`` that the record has."""
    out = []
    for where, rec in _records(path, field):
        key = next((k for k in COMPLETION_FIELDS if k in rec), None)
        if key is None:
            raise ValueError(f"{field}: {where} has no completion field ({', '.join(COMPLETION_FIELDS)})")
        text = rec[key] if key != "answer" or isinstance(rec[key], str) else str(rec[key])
        rec = {**rec, key: text}
        out.append(Example(prompt_text(where, field, rec["prompt"]), _text(where, field, rec, key)))
    return out


def load_pairs(path: str | Path, *, field: str = "path") -> list[Pair]:
    """Preference pairs from a ``.jsonl`` / ``.parquet`` file with ``prompt``, ``chosen`` and
    ``rejected`` (strings; ``prompt`` may be chat messages)."""
    out = []
    for where, rec in _records(path, field):
        chosen, rejected = _text(where, field, rec, "chosen"), _text(where, field, rec, "rejected")
        out.append(Pair(prompt_text(where, field, rec["prompt"]), chosen, rejected))
    return out


def _wrong_answer(answer: str, rng: random.Random) -> str:
    """A wrong answer near the right one (off by 1-9, never negative, never the answer)."""
    a = int(answer)
    choices = [a + d for d in range(-9, 10) if d != 0 and a + d >= 0]
    return str(rng.choice(choices))


def addition_pairs(prompts: Sequence[Prompt], *, seed: int = 0) -> list[dict[str, str]]:
    """Preference records of addition prompts: ``chosen`` the right sum, ``rejected`` a wrong
    one (off by 1 to 9, seeded)."""
    rng = random.Random(seed)
    return [
        {
            "prompt": p.text,
            "chosen": p.answer,
            "rejected": _wrong_answer(p.answer, rng),
            "data_source": p.data_source,
        }
        for p in prompts
    ]


def write_jsonl(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write ``records`` one JSON object per line (creating the parent directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def addition_pairs_file(directory: str | Path, *, digits: int = 1, seed: int = 0) -> tuple[Path, Path]:
    """``(train.jsonl, eval.jsonl)`` pairs files of the addition task (:func:`addition_pairs`
    over :func:`trainers.data.addition_task`'s train and held-out splits) written under
    ``directory``. 1 digit: 80 train / 20 held-out pairs; 2 digits: 8000 / 100."""
    eval_size = 20 if digits == 1 else 100
    train, held_out = addition_task(digits=digits, eval_size=eval_size, seed=seed)
    d = Path(directory)
    return (
        write_jsonl(addition_pairs(train, seed=seed), d / "train.jsonl"),
        write_jsonl(addition_pairs(held_out, seed=seed + 1), d / "eval.jsonl"),
    )

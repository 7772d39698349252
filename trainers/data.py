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

from trainers.deps import require
from trainers.models import is_hub_id
from trainers.vision import encode_images, load_image, processor_of

__all__ = [
    "Prompt",
    "PromptIterator",
    "addition_task",
    "build_prompts",
    "encode_prompt",
    "has_chat_template",
    "load_prompts",
    "prompt_text",
    "read_records",
]


@dataclass(frozen=True)
class Prompt:
    """One question: ``text`` (a string, or chat messages), ``answer``, ``data_source``,
    ``domain``: the name of the ``data.domains`` entry whose verifier scores it (``""`` in a
    run with one domain), and ``images``: the PIL images the question shows (``()``: text only;
    :mod:`trainers.vision`)."""

    text: Any
    answer: str
    data_source: str = "default"
    domain: str = ""
    images: tuple[Any, ...] = ()


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
    if "instruction_id_list" in rec:  # an IFEval record: its instructions are the ground truth
        return json.dumps(
            {"instruction_id_list": rec["instruction_id_list"], "kwargs": rec.get("kwargs") or []}
        )
    for key in ("answer", "ground_truth", "solution"):
        if key in rec and rec[key] is not None:
            return str(rec[key])
    rm = rec.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") is not None:
        return str(rm["ground_truth"])
    raise ValueError("no answer field (answer, ground_truth or reward_model.ground_truth)")


def read_records(path: Path, field: str) -> list[tuple[str, dict[str, Any]]]:
    """``(where, record)`` pairs of a JSONL or Parquet file; ``where`` names the file and line / row."""
    if path.suffix == ".parquet":
        pq = require("pyarrow.parquet")
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise ValueError(
                f"{field}: {path} is not a readable Parquet file: {str(e).splitlines()[0]}"
            ) from None
        return [(f"{path} row {i}", r) for i, r in enumerate(rows)]
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{field}: {path} must end in .jsonl or .parquet")
    out = []
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{field}: {path} is not UTF-8 text: {e}") from None
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{field}: {path} line {i} is not JSON: {e}") from None
            if not isinstance(rec, dict):
                raise ValueError(
                    f"{field}: {path} line {i}: expected a JSON object, got {type(rec).__name__}"
                )
            out.append((f"{path} line {i}", rec))
    return out


def prompt_text(where: str, field: str, text: Any) -> str | list[dict[str, str]]:
    if isinstance(text, str):
        if not text:
            raise ValueError(f"{field}: {where}: 'prompt' is empty")
        return text
    ok = (
        isinstance(text, list)
        and text
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in text
        )
    )
    if not ok:
        raise ValueError(
            f"{field}: {where}: 'prompt' must be a string or a list of chat messages "
            f"{{'role': ..., 'content': ...}}, got {text!r:.80}"
        )
    return [dict(m) for m in text]


def _dataset_records(path: str, field: str, split: str) -> list[tuple[str, dict[str, Any]]]:
    """``(where, record)`` pairs of a ``datasets`` directory (``save_to_disk``) or hub dataset
    name, ``split`` of it (a hub name, or a saved ``DatasetDict``)."""
    datasets = require("datasets")
    try:
        if Path(path).is_dir():
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"no split {split!r} (it has {', '.join(ds)})")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(path, split=split)
    except Exception as e:  # datasets raises many types (missing files, offline hub, bad split)
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(f"{field}: could not load the dataset {path!r} (split {split!r}): {msg}") from None
    return [(f"{path} [{split}] row {i}", dict(r)) for i, r in enumerate(ds)]


def load_prompts(path: str | Path, *, field: str = "path", split: str = "train") -> list[Prompt]:
    """Prompts from a ``.jsonl`` file, a ``.parquet`` file (needs ``pyarrow``), a ``datasets``
    directory (``save_to_disk``) or a hub dataset name (``split`` of it; fetched when online),
    with verl's fields (``prompt``, the answer in ``answer`` / ``ground_truth`` /
    ``reward_model.ground_truth``, ``data_source``; IFEval's ``instruction_id_list`` and
    ``kwargs`` become the answer as JSON; ``domain`` tags the record for a ``data.domains`` run).
    ``images`` (or ``image``) lists a record's images (:func:`trainers.vision.load_image`).
    A bad file or record raises ``ValueError``
    naming ``field``, the file and the line (or row)."""
    if Path(path).is_dir() or is_hub_id(path):
        records = _dataset_records(str(path), field, split)
    elif not Path(path).is_file():
        raise ValueError(f"{field}: no such file: {path}")
    else:
        records = read_records(Path(path), field)
    path = Path(path)
    out = []
    for where, rec in records:
        if "prompt" not in rec:
            raise ValueError(f"{field}: {where} has no 'prompt' field")
        try:
            answer = _answer_of(rec)
        except ValueError as e:
            raise ValueError(f"{field}: {where}: {e}") from None
        text = prompt_text(where, field, rec["prompt"])
        domain = rec.get("domain") or ""
        if not isinstance(domain, str):
            raise ValueError(f"{field}: {where}: 'domain' must be a string, got {domain!r}")
        images = _record_images(rec, where, field, path.parent if path.is_file() else None)
        out.append(Prompt(text, answer, str(rec.get("data_source") or "default"), domain, images))
    if not out:
        raise ValueError(f"{field}: {path} holds no prompts")
    return out


def _record_images(rec: dict[str, Any], where: str, field: str, base: Path | None) -> tuple[Any, ...]:
    """The images of a record (``images``: a list, or ``image``: one): file paths (relative to the
    data file's directory), bytes, PIL images or ``datasets`` image dicts, each loaded now so a
    missing or unreadable one is named with its record."""
    value = rec.get("images", rec.get("image"))
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(load_image(v, where=f"{field}: {where}: image {i}", base=base) for i, v in enumerate(items))


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, prompt: Prompt, chat_template: str = "auto") -> list[int]:
    """Token ids of ``prompt``: through the chat template (``"auto"``: when the tokenizer has
    one; ``"on"``; ``"off"``), else the plain text (``"12+34="``). A prompt with images goes
    through the processor attached to ``tokenizer`` (:func:`trainers.vision.encode_images`:
    its chat template, the placeholders expanded) and comes back as a
    :class:`trainers.vision.ImagePrompt` carrying the image inputs."""
    if chat_template not in ("auto", "on", "off"):
        raise ValueError(f"chat_template must be auto, on or off, got {chat_template!r}")
    if prompt.images:
        processor = processor_of(tokenizer)
        if processor is None:
            raise ValueError(
                "data: a prompt has images but the model has no image processor "
                "(model.path must name a vision-language model, e.g. Qwen2-VL)"
            )
        return encode_images(processor, prompt.text, prompt.images)
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

    def next_like(self, prompts: Sequence[Any]) -> list[Any]:
        """As many fresh items as ``prompts`` (dynamic-sampling refills; one domain here)."""
        return self.next_batch(len(prompts))

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
        train = load_prompts(d.train_file, field="data.train_file", split=d.train_split)
        if d.eval_file:
            return train, load_prompts(d.eval_file, field="data.eval_file", split=d.eval_split)
        if d.eval_size >= len(train):
            raise ValueError(
                f"data.eval_size={d.eval_size}: {d.train_file} has {len(train)} prompts and the held-out split "
                "would take all of them; set a smaller data.eval_size or a separate data.eval_file"
            )
        return train[d.eval_size :], train[: d.eval_size]
    if d.task != "addition":
        raise ValueError(f"data.task: unknown task {d.task!r} (known: addition); or set data.train_file")
    try:
        return addition_task(digits=d.digits, eval_size=d.eval_size, seed=cfg.seed)
    except ValueError as e:
        raise ValueError(f"data.{e}") from None

"""Domains of a multi-domain RLVR run: their prompts, built-in tasks and per-step quotas.

A run with ``data.domains`` (:func:`trainers.config.domain_specs`) tags every prompt with its
domain (:attr:`~trainers.data.Prompt.domain`); the data layer does the rest, so no loop branches
on a domain's name (docs/domains.md):

* :func:`build_domain_prompts`: each domain's train and held-out prompts, from its file, its
  built-in :data:`TASKS` generator, or the records of ``data.train_file`` tagged with its name.
  A record's own ``domain`` field routes it to that domain (its verifier, its quota).
* :class:`DomainIterator`: the prompt iterator of such a run. Each step's ``prompts_per_step``
  are split into exact integer quotas by :func:`rollkit.domains.domain_quotas` (one cursor per
  domain, :class:`rollkit.domains.DomainSampler`); :meth:`DomainIterator.next_like` draws
  dynamic-sampling refills from the domains of the groups they replace. Checkpointable.
* :data:`TASKS`: procedural domains that need no files: ``addition`` (``a+b``), ``functions``
  (a one-line Python function, checked in the sandbox by the ``code`` verifier), ``formats``
  (a short question with an IFEval constraint, the ``ifeval`` verifier) and ``choice`` (pick
  the largest or smallest of four numbers, the ``multiple_choice`` verifier).

>>> train, held = functions_task(eval_size=5, seed=0)
>>> len(held), train[0].text[0]["role"], json.loads(train[0].answer)["entry_point"]
(5, 'user', 'f')
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rollkit.domains import DomainSampler
from trainers.config import Config, DomainSpec, domain_specs
from trainers.data import Prompt, PromptIterator, addition_task, build_prompts, load_prompts
from trainers.vision import SHAPE_QUESTIONS, shape_image

__all__ = [
    "TASKS",
    "DomainIterator",
    "addition_domain",
    "build_domain_prompts",
    "choice_task",
    "domain_masks",
    "formats_task",
    "functions_task",
    "make_iterator",
    "run_prompts",
    "shapes_task",
    "write_image_records",
]

CODE_FORMAT = "rollkit.code/v1"  # trainers.rewards.code.FORMAT (that layer sits above this one)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _split(prompts: list[Prompt], eval_size: int, seed: int, what: str) -> tuple[list[Prompt], list[Prompt]]:
    if not 0 <= eval_size < len(prompts):
        raise ValueError(
            f"eval_size: {what} has {len(prompts)} prompts, eval_size must be in [0, {len(prompts)}), got {eval_size}"
        )
    random.Random(seed).shuffle(prompts)
    return prompts[eval_size:], prompts[:eval_size]


def addition_domain(
    *, eval_size: int = 100, seed: int = 0, digits: int = 2
) -> tuple[list[Prompt], list[Prompt]]:
    """:func:`trainers.data.addition_task` as a domain task (``task_options: {digits: 1}``)."""
    return addition_task(digits=digits, eval_size=eval_size, seed=seed)


def _function_specs() -> list[tuple[str, str]]:
    """``(description, Python expression in x)`` of the ``functions`` task."""
    out = [(f"x + {b}", f"x + {b}") for b in range(1, 10)] + [(f"x - {b}", f"x - {b}") for b in range(1, 10)]
    out += [(f"{a} * x", f"{a} * x") for a in range(2, 10)]
    out += [
        (f"{a} * x {op} {b}", f"{a} * x {op} {b}") for a in range(2, 10) for b in range(1, 10) for op in "+-"
    ]
    out += [(f"x squared plus {b}", f"x * x + {b}") for b in range(1, 10)]
    out += [(f"x squared minus {b}", f"x * x - {b}") for b in range(1, 10)]
    out += [(f"the larger of x and {b}", f"max(x, {b})") for b in range(1, 10)]
    out += [(f"the smaller of x and {b}", f"min(x, {b})") for b in range(1, 10)]
    out += [(f"the absolute value of x minus {b}", f"abs(x - {b})") for b in range(1, 10)]
    out += [(f"the remainder of x divided by {a}", f"x % {a}") for a in range(2, 10)]
    out += [
        (f"{a} if x is even, otherwise x + {b}", f"({a} if x % 2 == 0 else x + {b})")
        for a in range(2, 10)
        for b in range(1, 10)
    ]
    return out


def functions_task(*, eval_size: int = 30, seed: int = 0) -> tuple[list[Prompt], list[Prompt]]:
    """``(train, held_out)``: "Write a Python function f(x) that returns <description>." for 295
    functions of one integer (``a * x + b`` and its kin, ``x squared plus b``, the larger /
    smaller of ``x`` and ``b``, ``abs(x - b)``, ``x % a``, "``a`` if x is even, otherwise
    ``x + b``"; ``a`` in 2..9, ``b`` in 1..9); the answer is a ``code`` problem whose
    ``check(f)`` asserts ``f(x)`` for ``x`` in ``(-3, 0, 1, 2, 7)``."""
    prompts = []
    for words, e in _function_specs():
        tests = "def check(f):\n    for x in (-3, 0, 1, 2, 7):\n" + f"        assert f(x) == {e}, x\n"
        problem = {
            "format": CODE_FORMAT,
            "problem_id": f"f(x)={e}",
            "assert_tests": tests,
            "entry_point": "f",
        }
        text = _user(f"Write a Python function f(x) that returns {words}.")
        prompts.append(Prompt(text, json.dumps(problem), "functions"))
    return _split(prompts, eval_size, seed, "the functions task")


_QUESTIONS = (
    "Name a fruit.", "Name a color.", "Name an animal.", "What is the capital of France?",
    "Name a planet.", "What do bees make?", "Name a musical instrument.", "What color is the sky?",
    "Name a sport.", "What is frozen water called?", "Name a vegetable.", "What do cows drink?",
    "Name a day of the week.", "What is the opposite of hot?", "Name a flower.",
    "What is the largest ocean?", "Name a month of the year.", "What do you use to write?",
    "Name a bird.", "What is the sun?", "Name something you wear.", "Name a kitchen tool.",
    "What is a baby cat called?", "Name a shape.",
)  # fmt: skip
_KEYWORDS = ("sun", "happy", "blue", "river", "music", "green")
_END = "Any other questions?"


def _constraints() -> list[tuple[str, str, dict[str, Any]]]:
    """``(instruction text, IFEval instruction id, kwargs)`` of the ``formats`` task."""
    out = [
        ("Do not use any commas in your response.", "punctuation:no_comma", {}),
        ("Wrap your entire response with double quotation marks.", "startend:quotation", {}),
        (
            f'Finish your response with this exact phrase "{_END}". No other words should follow this phrase.',
            "startend:end_checker",
            {"end_phrase": _END},
        ),
    ]
    out += [
        (f'Include the keyword "{w}" in your response.', "keywords:existence", {"keywords": [w]})
        for w in _KEYWORDS
    ]
    out += [
        (
            f"Answer with less than {n} words.",
            "length_constraints:number_words",
            {"relation": "less than", "num_words": n},
        )
        for n in (4, 6, 8, 10)
    ]
    return out


def formats_task(*, eval_size: int = 30, seed: int = 0) -> tuple[list[Prompt], list[Prompt]]:
    """``(train, held_out)``: each of 24 short questions with each of 13 IFEval constraints
    (no commas, quoted response, a fixed end phrase, a keyword, fewer than N words; Zhou et al.
    2023, arXiv:2311.07911); the answer is IFEval's ``{"instruction_id_list", "kwargs"}`` JSON
    that the ``ifeval`` verifier checks."""
    prompts = [
        Prompt(
            _user(f"{q} {text}"),
            json.dumps({"instruction_id_list": [iid], "kwargs": [kw]}),
            iid.split(":")[0],
        )
        for q in _QUESTIONS
        for text, iid, kw in _constraints()
    ]
    return _split(prompts, eval_size, seed, "the formats task")


def choice_task(*, eval_size: int = 50, seed: int = 0) -> tuple[list[Prompt], list[Prompt]]:
    """``(train, held_out)``: "Which number is the largest (smallest)?" over four distinct numbers
    0..99 labelled A-D, 2,000 questions from ``seed``; the answer is the letter (the
    ``multiple_choice`` verifier)."""
    rng = random.Random(seed)
    prompts = []
    for k in range(2000):
        nums = rng.sample(range(100), 4)
        which = ("largest", max) if k % 2 == 0 else ("smallest", min)
        options = "\n".join(f"{'ABCD'[i]}) {v}" for i, v in enumerate(nums))
        text = _user(f"Which number is the {which[0]}?\n{options}\nAnswer with the letter.")
        prompts.append(Prompt(text, "ABCD"[nums.index(which[1](nums))], f"choice_{which[0]}"))
    return _split(prompts, eval_size, seed, "the choice task")


#: name -> ``(eval_size=, seed=, **task_options) -> (train, held_out)``: the built-in domain tasks
def shapes_task(
    *,
    kinds: Sequence[str] = ("colour", "position"),
    train_size: int = 400,
    eval_size: int = 64,
    image_size: int = 56,
    seed: int = 0,
) -> tuple[list[Any], list[Any]]:
    """``(train, held_out)`` prompts of a synthetic visual task: one image each (squares on grey,
    :func:`shape_image`) and a question of one of ``kinds`` (:data:`SHAPE_QUESTIONS`: the square's
    colour, its quadrant, or how many squares there are), answered with a number 1-4 (the
    ``exact_match`` verifier scores it). Held-out images are drawn after the train ones from the
    same seeded stream (fresh random shades, sizes and offsets). ``data_source``: ``shapes_<kind>``.

    >>> train, held = shapes_task(train_size=4, eval_size=2)
    >>> len(train), len(held), train[0].images[0].size, train[0].answer in "1234"
    (4, 2, (56, 56), True)
    """
    bad = [k for k in kinds if k not in SHAPE_QUESTIONS]
    if bad or not kinds:
        raise ValueError(f"kinds: expected some of {sorted(SHAPE_QUESTIONS)}, got {list(kinds)}")
    if train_size < 1 or eval_size < 0:
        raise ValueError(f"train_size must be >= 1 and eval_size >= 0, got {train_size}, {eval_size}")
    rng = random.Random(seed)
    out = []
    for i in range(train_size + eval_size):
        kind = kinds[i % len(kinds)]
        colour, quadrant, count = (
            rng.randrange(4),
            rng.randrange(4),
            rng.randrange(1, 5) if kind == "count" else 1,
        )
        img = shape_image(colour, quadrant, count=count, size=image_size, rng=rng)
        answer = {"colour": colour + 1, "position": quadrant + 1, "count": count}[kind]
        out.append(Prompt(SHAPE_QUESTIONS[kind], str(answer), f"shapes_{kind}", images=(img,)))
    return out[:train_size], out[train_size:]


def write_image_records(prompts: Sequence[Any], path: str | os.PathLike) -> Path:
    """Write ``prompts`` as a JSONL file at ``path`` (``prompt``, ``answer``, ``data_source``,
    ``images``: PNG files in ``<path stem>_images/``, named relative to the file), the layout
    :func:`trainers.data.load_prompts` reads. Returns the path."""
    path = Path(path)
    folder = path.parent / f"{path.stem}_images"
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, p in enumerate(prompts):
        names = []
        for j, img in enumerate(p.images):
            name = f"{folder.name}/{i:05d}_{j}.png"
            img.save(path.parent / name)
            names.append(name)
        rec = {"prompt": p.text, "answer": p.answer, "data_source": p.data_source, "images": names}
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


TASKS: dict[str, Callable[..., tuple[list[Prompt], list[Prompt]]]] = {
    "addition": addition_domain,
    "functions": functions_task,
    "formats": formats_task,
    "choice": choice_task,
    "shapes": shapes_task,
}


def domain_masks(domains: Sequence[str]) -> dict[str, torch.Tensor]:
    """``{domain: [N] bool mask}`` of the samples of each domain in ``domains`` (``[N]`` names, in
    order of first appearance; ``""`` included), for per-domain statistics.

    >>> {d: m.tolist() for d, m in domain_masks(["a", "b", "a"]).items()}
    {'a': [True, False, True], 'b': [False, True, False]}
    """
    index = {d: i for i, d in enumerate(dict.fromkeys(domains))}
    ids = torch.tensor([index[d] for d in domains], dtype=torch.int64)
    return {d: ids == i for d, i in index.items()}


def _tag(prompts: list[Prompt], name: str, known: Sequence[str], where: str) -> list[Prompt]:
    """``prompts`` with ``domain = name`` where a record has no tag of its own; a tag that names
    no domain raises ``ValueError`` naming ``where``."""
    bad = sorted({p.domain for p in prompts if p.domain and p.domain not in known})
    if bad:
        raise ValueError(
            f"{where}: records tagged with domains {bad} that data.domains does not name ({', '.join(known)})"
        )
    return [p if p.domain else dataclasses.replace(p, domain=name) for p in prompts]


def _spec_prompts(
    cfg: Config, s: DomainSpec, shared: list[Prompt] | None
) -> tuple[list[Prompt], list[Prompt]]:
    """One domain's ``(train, held_out)`` before tagging (:func:`build_domain_prompts`)."""
    where = f"data.domains.{s.name}"
    if s.task:
        try:
            size = {} if s.eval_size is None else {"eval_size": s.eval_size}
            return TASKS[s.task](seed=cfg.seed, **size, **s.task_options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}.task_options: task {s.task!r}: {e}") from None
    if s.train_file:
        train = load_prompts(s.train_file, field=f"{where}.train_file", split=s.train_split)
        if s.eval_file:
            return train, load_prompts(s.eval_file, field=f"{where}.eval_file", split=s.eval_split)
    else:
        train = [p for p in shared or [] if p.domain == s.name]
        if not train:
            raise ValueError(f"{where}: data.train_file has no record whose 'domain' is {s.name!r}")
    size = cfg.data.eval_size if s.eval_size is None else s.eval_size
    if size >= len(train):
        raise ValueError(
            f"{where}.eval_size={size}: the domain has {len(train)} prompts; set a smaller eval_size or an eval_file"
        )
    return train[size:], train[:size]


def build_domain_prompts(cfg: Config) -> tuple[list[Prompt], list[Prompt]]:
    """``(train, held_out)`` of every domain of ``cfg.data.domains``, each prompt tagged with its
    domain (a record's own ``domain`` field wins). Each domain must keep at least one train
    prompt; every bad entry raises ``ValueError`` naming ``data.domains.<name>.<key>``."""
    specs = domain_specs(cfg)
    names = [s.name for s in specs]
    shared = None
    if cfg.data.train_file:
        shared = load_prompts(cfg.data.train_file, field="data.train_file", split=cfg.data.train_split)
        _tag([p for p in shared if p.domain], "", names, "data.train_file")
    train: list[Prompt] = []
    held: list[Prompt] = []
    for s in specs:
        tr, ev = _spec_prompts(cfg, s, shared)
        where = f"data.domains.{s.name}"
        train += _tag(tr, s.name, names, f"{where}.train_file")
        held += _tag(ev, s.name, names, f"{where}.eval_file")
    empty = [n for n in names if not any(p.domain == n for p in train)]
    if empty:
        raise ValueError(
            f"data.domains: no train prompts left for {empty} (their records are all tagged elsewhere or held out)"
        )
    return train, held


class DomainIterator:
    """The prompts of a multi-domain run, a step's worth at a time (module docstring).

    ``next_batch(size)`` pops prompts from the current step's draw; when that is used up it draws
    the next step: :class:`rollkit.domains.DomainSampler` over the domains' prompt lists with
    ``weights`` and ``batch_size`` (``rollout.prompts_per_step``), i.e. exact integer quotas per
    step, each domain walked in its own seeded shuffled epochs. ``next_like(prompts)`` draws one
    prompt from each given prompt's domain (refills of filtered groups stay in their domain). The
    state is the sampler's plus the undrawn rest of the step.

    >>> ps = [Prompt("a", "1", domain="x"), Prompt("b", "2", domain="y"), Prompt("c", "3", domain="y")]
    >>> it = DomainIterator(ps, ["x", "y"], [1.0, 1.0], 2, seed=0)
    >>> sorted(p.domain for p in it.next_batch(2)), it.next_like([ps[0]])[0].text
    (['x', 'y'], 'a')
    """

    def __init__(
        self,
        prompts: Sequence[Prompt],
        names: Sequence[str],
        weights: Sequence[float],
        batch_size: int,
        *,
        seed: int = 0,
    ) -> None:
        self.names = list(names)
        self.pools: dict[str, list[Prompt]] = {n: [] for n in self.names}
        for p in prompts:
            if p.domain not in self.pools:
                raise ValueError(f"prompts: a prompt of domain {p.domain!r}, not one of {self.names}")
            self.pools[p.domain].append(p)
        empty = [n for n, ps in self.pools.items() if not ps]
        if empty:
            raise ValueError(f"prompts: no prompt of domains {empty}")
        self.sampler = DomainSampler([len(self.pools[n]) for n in self.names], weights, batch_size, seed=seed)
        self.pending: list[list[int]] = []  # [domain index, draw id] of the current step, not yet taken

    def _prompt(self, d: int, draw: int) -> Prompt:
        pool = self.pools[self.names[d]]
        return pool[draw % len(pool)]

    def next_batch(self, size: int) -> list[Prompt]:
        out = []
        while len(out) < size:
            if not self.pending:
                self.pending = [[d, i] for d, ids in enumerate(next(self.sampler)) for i in ids]
            d, i = self.pending.pop(0)
            out.append(self._prompt(d, i))
        return out

    def next_like(self, prompts: Sequence[Prompt]) -> list[Prompt]:
        """One fresh prompt from the domain of each of ``prompts`` (the domain's own cursor)."""
        out = []
        for p in prompts:
            d = self.names.index(p.domain)
            out.append(self._prompt(d, next(self.sampler.cursors[d])))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "sampler": self.sampler.state_dict(),
            "pending": [list(x) for x in self.pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("names") != self.names:
            raise ValueError(
                f"state: the checkpoint's domains are {state.get('names')}, this run's {self.names}"
            )
        self.sampler.load_state_dict(state["sampler"])
        self.pending = [list(x) for x in state["pending"]]


def make_iterator(cfg: Config, train_prompts: Sequence[Prompt]) -> PromptIterator | DomainIterator:
    """The prompt iterator of ``cfg``: a :class:`DomainIterator` with ``data.domains`` (weights
    from the entries, a step of ``rollout.prompts_per_step``), else a
    :class:`~trainers.data.PromptIterator`; both seeded with ``cfg.seed``."""
    specs = domain_specs(cfg)
    if not specs:
        return PromptIterator(train_prompts, seed=cfg.seed)
    return DomainIterator(
        train_prompts,
        [s.name for s in specs],
        [s.weight for s in specs],
        cfg.rollout.prompts_per_step,
        seed=cfg.seed,
    )


def run_prompts(cfg: Config) -> tuple[list[Prompt], list[Prompt]]:
    """``(train, held_out)`` of ``cfg``: :func:`build_domain_prompts` with ``data.domains``, the
    visual :func:`shapes_task` for ``data.task=shapes``, else :func:`trainers.data.build_prompts`."""
    if domain_specs(cfg):
        return build_domain_prompts(cfg)
    if not cfg.data.train_file and cfg.data.task == "shapes":
        return shapes_task(eval_size=cfg.data.eval_size, seed=cfg.seed)
    return build_prompts(cfg)

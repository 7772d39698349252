"""The command line, YAML files and ``--help`` of every run config.

:func:`load_config` builds a config (:class:`~trainers.config.Config` by default) from an
optional YAML file (``--config file.yaml``) and then applies overrides, in order, written as
verl / ROLL users expect::

    train.lr=1e-5  --algorithm.advantage grpo  --rollout.n=8  algorithm.policy_loss_kwargs='{clip_high: 0.28}'

Values are parsed as YAML scalars (``1e-5``, ``true``, ``null``, ``[1, 2]``, ``{a: 1}``) and
converted to the field's type (:func:`trainers.config.fields.convert`: a ``Literal`` field takes
one of its choices); a wrong key or value raises ``ValueError`` naming the field. Short aliases:
``--model PATH`` is ``model.path``, ``--data FILE`` is ``data.train_file``, ``--rollout NAME`` is
``rollout.engine``, ``--train NAME`` is ``train.engine``; ``--ray`` (no value) is
``ray.enabled=true`` and ``--ray-address ADDR`` is ``ray.enabled=true ray.address=ADDR`` (``""``: a
local ``ray.init()``; ``auto`` or ``host:port``: an existing cluster). ``--help`` lists every
field with its type and default (:func:`help_text`).

>>> cfg = load_config(["train.lr=3e-4", "--algorithm.advantage", "rloo", "--model", "tiny"])
>>> cfg.train.lr, cfg.algorithm.advantage, cfg.model.path
(0.0003, 'rloo', 'tiny')
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from trainers.config.algorithm import check_registry_kwargs
from trainers.config.fields import _yaml, check_value, convert, hints, type_name
from trainers.config.runs import Config, validate_run

__all__ = [
    "ALIASES",
    "FLAGS",
    "apply_dict",
    "apply_overrides",
    "config_to_dict",
    "help_text",
    "load_config",
    "parse_args",
    "save_config",
    "set_value",
]


ALIASES = {
    "model": "model.path",
    "data": "data.train_file",
    "rollout": "rollout.engine",
    "train": "train.engine",
    "ray_address": "ray.address",
}
#: Command-line flags that take no value.
FLAGS = {"--ray": ("ray.enabled", "true")}


def _field_names(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def set_value(cfg: Config, key: str, value: Any) -> None:
    """Set the dotted field ``key`` of ``cfg`` to ``value`` (converted, and checked against the
    field's type, choices, bounds and registry: a bad value raises here, naming ``key``)."""
    parts = key.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        if not dataclasses.is_dataclass(obj) or part not in _field_names(obj):
            known = _field_names(obj) if dataclasses.is_dataclass(obj) else []
            where = ".".join(parts[:i]) or "the config"
            raise ValueError(f"{path}: unknown field of {where}; known: {', '.join(known)}")
        tp = hints(type(obj))[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                if not isinstance(value, dict):
                    raise ValueError(f"{path}: is a section; set its fields ({path}.<field>=...)")
                for k, v in value.items():
                    set_value(cfg, f"{path}.{k}", v)
                return
            v = convert(path, value, tp)
            # bounds and registry names too, so a bad value stops where it was given
            check_value(path, v, tp, {f.name: f for f in dataclasses.fields(obj)}[part].metadata.get("rule"))
            setattr(obj, part, v)
        else:
            obj = getattr(obj, part)


def apply_dict(cfg: Config, data: dict[str, Any], prefix: str = "") -> None:
    """Apply a nested mapping (a parsed YAML file) onto ``cfg``."""
    if not isinstance(data, dict):
        raise ValueError(
            f"config: expected a mapping at {prefix or 'the top level'}, got {type(data).__name__}"
        )
    for k, v in data.items():
        set_value(cfg, f"{prefix}{k}", v)


def parse_args(argv: list[str]) -> tuple[str | None, list[tuple[str, str]], bool]:
    """``(config_file, [(key, value), ...], help_requested)`` from command-line tokens."""
    config_file: str | None = None
    pairs: list[tuple[str, str]] = []
    want_help = False
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in ("-h", "--help"):
            want_help = True
            i += 1
            continue
        if tok in FLAGS:
            pairs.append(FLAGS[tok])
            i += 1
            continue
        if tok.startswith("--"):
            body = tok[2:]
            if "=" in body:
                key, value = body.split("=", 1)
            else:
                if i + 1 >= len(argv):
                    raise ValueError(f"{body}: missing value after --{body}")
                key, value = body, argv[i + 1]
                i += 1
        elif "=" in tok:
            key, value = tok.split("=", 1)
        else:
            raise ValueError(f"argument {tok!r}: expected key=value or --key value")
        key = key.replace("-", "_") if key != "config" else key
        if key == "config":
            config_file = value
        elif key == "ray_address":  # --ray-address ADDR: use Ray, at ADDR
            pairs += [("ray.enabled", "true"), (key, value)]
        else:
            pairs.append((key, value))
        i += 1
    return config_file, pairs, want_help


def apply_overrides(cfg: Config, overrides: list[str] | list[tuple[str, str]]) -> Config:
    """Apply ``key=value`` strings (or ``(key, value)`` pairs) onto ``cfg``; returns it."""
    for o in overrides:
        if isinstance(o, str):
            if "=" not in o:
                raise ValueError(f"override {o!r}: expected key=value")
            k, v = o.split("=", 1)
        else:
            k, v = o
        k = k.strip()
        set_value(cfg, ALIASES.get(k, k), v)
    return cfg


def load_config(argv: list[str] | None = None, *, base: Config | None = None) -> Config:
    """A :class:`Config` from command-line tokens: ``--config FILE`` first, then overrides in order.

    ``--help`` raises ``SystemExit(0)`` after printing :func:`help_text`. The returned config is
    validated (:func:`~trainers.config.runs.validate_run`: the validator of ``base``'s pipeline),
    and the keyword arguments of the registry-named choices are checked against the registered
    function's signature (:func:`check_registry_kwargs`), so a bad value or a misspelt
    hyper-parameter stops here, before any model loads; the trainers' own calls of the validator
    then find the config checked and do nothing (a field changed since is checked again).
    """
    config_file, pairs, want_help = parse_args(list(argv or []))
    cfg = base if base is not None else Config()
    if want_help:
        print(help_text(cfg))
        raise SystemExit(0)
    if config_file:
        p = Path(config_file)
        if not p.is_file():
            raise ValueError(f"config: file not found: {config_file}")
        yaml = _yaml()
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{config_file} line {mark.line + 1}" if mark is not None else config_file
            raise ValueError(
                f"config: {where}: not valid YAML ({getattr(e, 'problem', None) or e})"
            ) from None
        apply_dict(cfg, data)
    apply_overrides(cfg, pairs)
    check_registry_kwargs(cfg)
    validate_run(cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts (YAML/JSON-serialisable)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config as YAML (``--config`` reads it back: the same run)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_yaml().safe_dump(config_to_dict(cfg), sort_keys=False))
    return path


#: One-line ``--help`` descriptions (with the ROLL / verl name) of the fields that have one.
FIELD_HELP = {
    "algorithm.reward_clip": "> 0: clamp rewards to [-c, c] (ROLL reward_clip); 0: off",
    "algorithm.whiten_advantages": "whiten advantages over the batch's tokens (ROLL whiten_advantages)",
    "algorithm.advantage_clip": "> 0: clamp advantages to [-c, c] (ROLL advantage_clip); 0: off",
    "algorithm.kl.target": "> 0: adaptive KL coef, needs kl.mode=reward (ROLL target_kl, verl kl_ctrl.target_kl)",
    "algorithm.kl.horizon": "adaptive KL horizon in samples (ROLL kl_horizon, verl kl_ctrl.horizon)",
    "filter.accuracy_band": "drop groups with mean reward outside (accuracy_low, accuracy_high) (ROLL difficulty_mask)",
    "filter.accuracy_low": "accuracy band's low edge, exclusive (ROLL difficulty_low_threshold)",
    "filter.accuracy_high": "accuracy band's high edge, exclusive (ROLL difficulty_high_threshold)",
    "filter.max_len_mask": "no loss on samples cut at rollout.max_tokens (ROLL max_len_mask, DAPO overlong filtering)",
    "reward.overlong_buffer": "> 0: DAPO soft overlong punishment window (verl overlong_buffer.len); 0: off",
    "reward.overlong_penalty": "its largest penalty (verl overlong_buffer.penalty_factor)",
}


def _help_rows(obj: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    rows = []
    for f in dataclasses.fields(obj):
        tp = hints(type(obj))[f.name]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(tp):
            rows.extend(_help_rows(value, f"{prefix}{f.name}."))
        else:
            name = f"{prefix}{f.name}"
            rule = f.metadata.get("rule")
            reg = getattr(rule, "registry", None)
            # a registry field shows the names it accepts (the engines; the registered primitives)
            kind = "{" + ",".join(reg.names()) + "}" if reg is not None and len(reg.names()) <= 8 else type_name(tp)
            rows.append((name, kind, repr(value), FIELD_HELP.get(name, "")))
    return rows


def help_text(cfg: Config | None = None) -> str:
    """Every field with its type and default, one per line."""
    cfg = cfg or Config()
    rows = _help_rows(cfg)
    w = max(len(r[0]) for r in rows)
    t = max(len(r[1]) for r in rows)
    alias = ", ".join(f"--{k.replace('_', '-')} = {v}" for k, v in ALIASES.items())
    alias += ", --ray = ray.enabled=true (--ray-address also sets it)"
    lines = [
        "usage: [--config FILE.yaml] [key=value | --key value] ...",
        "",
        "Dotted keys override the YAML file's values, in order; values are YAML scalars.",
        f"Aliases: {alias}.",
        "",
        f"{'field'.ljust(w)}  {'type'.ljust(t)}  default",
    ]
    d = max(len(r[2]) for r in rows if r[3]) if any(r[3] for r in rows) else 0
    for name, tp, default, desc in rows:
        line = f"{name.ljust(w)}  {tp.ljust(t)}  {default.ljust(d) if desc else default}"
        lines.append(f"{line}  {desc}" if desc else line)
    return os.linesep.join(lines)


# --------------------------------------------------------------------------- validation

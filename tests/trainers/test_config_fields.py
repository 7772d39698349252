"""The configuration's one rule mechanism (trainers.config.fields) and validation once per run."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

import trainers.config.runs as runs
from trainers.config import (
    AgenticConfig,
    Config,
    DistillConfig,
    OfflineConfig,
    check_fields,
    load_config,
    setting,
    validate,
    validate_agentic,
    validate_offline,
)
from trainers.config.fields import Rule, check_value, convert, hints, type_name

RUN_CONFIGS = (Config, AgenticConfig, OfflineConfig, DistillConfig)


def _leaves(obj, prefix=""):
    h = hints(type(obj))
    for f in dataclasses.fields(obj):
        if dataclasses.is_dataclass(h[f.name]):
            yield from _leaves(getattr(obj, f.name), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", h[f.name], f.metadata.get("rule"), getattr(obj, f.name)


@pytest.mark.parametrize("make", RUN_CONFIGS, ids=lambda c: c.__name__)
def test_every_default_satisfies_its_own_rule(make):
    rows = list(_leaves(make()))
    assert len(rows) > 40
    for key, tp, rule, value in rows:
        check_value(key, value, tp, rule)  # raises naming the field


@pytest.mark.parametrize("make", RUN_CONFIGS, ids=lambda c: c.__name__)
def test_every_field_refuses_a_wrong_type_by_name(make):
    """A value of the wrong type (an object no field takes) is refused naming the field, for
    every field of every run config."""
    for key, tp, rule, _ in _leaves(make()):
        with pytest.raises(ValueError, match="^" + re.escape(key) + " "):
            check_value(key, object(), tp, rule)


def test_literal_choices_are_refused_at_parse_time_with_the_choices():
    # engines are names of trainers.config.ROLLOUT_ENGINES / TRAIN_ENGINES (one line per engine)
    with pytest.raises(
        ValueError, match=r"^train\.engine: unknown train engine 'jax'; known: deepspeed, fsdp2, megatron, torch$"
    ):
        load_config(["train.engine=jax"])
    with pytest.raises(ValueError, match=r"^rollout\.engine: unknown rollout engine 'sglang'; known: hf, server, vllm$"):
        load_config(["--rollout", "sglang"])
    with pytest.raises(ValueError, match=r"^critic\.engine: unknown train engine 'jax'; known: '', deepspeed"):
        load_config(["critic.engine=jax"])
    assert load_config(["critic.engine="]).critic.engine == ""
    with pytest.raises(ValueError, match=r"^train\.zero_stage must be one of 0, 1, 2, 3, got '4'$"):
        load_config(["train.zero_stage=4"])
    assert load_config(["train.zero_stage=3"]).train.zero_stage == 3  # "3" converted to the int choice
    with pytest.raises(ValueError, match=r"^rollout\.dtype must be one of '', auto, float32"):
        load_config(["rollout.dtype=fp8"])
    assert load_config(["rollout.dtype="]).rollout.dtype == ""


@pytest.mark.parametrize(
    ("rule", "tp", "value", "message"),
    [
        (Rule(gt=0), float, 0.0, "must be > 0, got 0.0"),
        (Rule(ge=0), float, -1.0, "must be >= 0, got -1.0"),
        (Rule(ge=1), int, 0, "must be an int >= 1, got 0"),
        (Rule(ge=1), int, True, "must be an int >= 1, got True"),
        (Rule(ge=1), int, 1.0, "must be an int >= 1, got 1.0"),
        (Rule(gt=0, le=1), float, 1.5, r"must be in \(0, 1\], got 1.5"),
        (Rule(ge=0, lt=1), float, 1.0, r"must be in \[0, 1\), got 1.0"),
        (Rule(gt=0), float, float("nan"), "must be a finite number, got nan"),
        (None, bool, 1, "must be true or false, got 1"),
        (None, str, None, "must be a string, got None"),
        (None, dict, [], r"must be a mapping, got \[\]"),
        (None, list, {}, r"must be a list, got \{\}"),
        (None, typing.Literal["a", "b"], "c", "must be one of a, b, got 'c'"),
        (None, typing.Literal[1, 2], True, "must be one of 1, 2, got True"),
    ],
)
def test_rule_messages(rule, tp, value, message):
    with pytest.raises(ValueError, match=rf"^x\.y {message}$"):
        check_value("x.y", value, tp, rule)


def test_optional_fields_take_none_and_check_the_rest():
    check_value("r.max_model_len", None, int | None, Rule(ge=1))
    with pytest.raises(ValueError, match=r"^r\.max_model_len must be an int >= 1, got 0$"):
        check_value("r.max_model_len", 0, int | None, Rule(ge=1))


def test_registry_rule_names_the_known_names():
    cfg = Config()
    cfg.algorithm.policy_loss = "ppo2"
    with pytest.raises(
        ValueError, match=r"^algorithm\.policy_loss: unknown policy loss 'ppo2'; known: .*\bppo\b"
    ):
        check_fields(cfg)


def test_setting_on_a_new_section():
    @dataclasses.dataclass
    class Section:
        kind: typing.Literal["a", "b"] = "a"
        size: int = setting(2, ge=1)
        items: list = setting(factory=list)

    check_fields(Section())
    assert Section().items == [] and Section().items is not Section().items
    with pytest.raises(ValueError, match=r"^s\.size must be an int >= 1, got 0$"):
        check_fields(Section(size=0), "s.")
    assert convert("s.kind", "b", typing.Literal["a", "b"]) == "b"
    assert type_name(typing.Literal["", "x"]) == "{'',x}"


@pytest.mark.parametrize(
    ("make", "check"),
    [(Config, validate), (AgenticConfig, validate_agentic), (OfflineConfig, validate_offline)],
    ids=["rlvr", "agentic", "offline"],
)
def test_a_config_is_checked_once_until_it_changes(monkeypatch, make, check):
    """The recipe, the trainer and the loop all call the validator: the checks run once; a field
    changed afterwards is checked again."""
    calls = []
    real = runs.check_fields
    monkeypatch.setattr(runs, "check_fields", lambda cfg, prefix="": (calls.append(1), real(cfg, prefix)))
    cfg = make()
    check(cfg)
    check(cfg)
    check(cfg)
    assert len(calls) == 1
    cfg.train.lr = -1.0
    with pytest.raises(ValueError, match=r"^train\.lr must be > 0, got -1\.0$"):
        check(cfg)
    assert len(calls) == 2
    cfg.train.lr = 1e-4
    check(cfg)
    check(cfg)
    assert len(calls) == 3


def test_the_stamp_is_not_part_of_the_config():
    cfg = Config()
    validate(cfg)
    assert "_rollkit_validated" not in dataclasses.asdict(cfg)
    assert [f.name for f in dataclasses.fields(cfg)] == [f.name for f in dataclasses.fields(Config)]

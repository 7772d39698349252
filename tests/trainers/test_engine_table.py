"""The engine tables: every rollout and train engine is one line of trainers.config.capabilities
(name, builder, capabilities); the config's checks read capabilities, not engine names; adding an
engine is a file plus a line."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from trainers.config import (
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
    Config,
    EngineTable,
    RolloutEngineSpec,
    TrainEngineSpec,
    load_config,
    validate,
)
from trainers.engines import HFRolloutEngine, TorchTrainEngine
from trainers.engines.build import engine_builder, make_rollout_engine, make_train_engine, tiny_heads
from trainers.models import char_tokenizer, tiny_qwen2


@pytest.mark.parametrize("table", [ROLLOUT_ENGINES, TRAIN_ENGINES], ids=["rollout", "train"])
def test_every_declared_engine_has_a_builder(table):
    assert len(table) >= 3
    for name in table:
        assert callable(engine_builder(table, name)), name


def test_the_builtin_engines_and_their_capabilities():
    assert ROLLOUT_ENGINES.names() == ("hf", "vllm", "server")
    assert TRAIN_ENGINES.names() == ("torch", "deepspeed", "fsdp2", "megatron")
    zero = lambda stage: type("T", (), {"zero_stage": stage})()  # noqa: E731
    assert TRAIN_ENGINES.supports("deepspeed", "lora", train=zero(2))
    assert not TRAIN_ENGINES.supports("deepspeed", "lora", train=zero(3))
    assert not TRAIN_ENGINES.supports("fsdp2", "lora") and not TRAIN_ENGINES.supports("megatron", "packing")
    assert ROLLOUT_ENGINES["server"].remote and not ROLLOUT_ENGINES["hf"].tensor_parallel


def test_declaring_twice_is_a_no_op_and_a_taken_name_is_refused():
    table = EngineTable("rollout engine", "rollout.engine")
    spec = RolloutEngineSpec("a", "m:f")
    table.declare(spec)
    table.declare(RolloutEngineSpec("a", "m:f"))  # equal: a module imported again
    assert table.names() == ("a",)
    with pytest.raises(ValueError, match=r"^rollout engine 'a' is already declared \(builder m:f\)$"):
        table.declare(RolloutEngineSpec("a", "m:g"))
    with pytest.raises(ValueError, match=r"builder must be 'module:function'"):
        table.declare(RolloutEngineSpec("b", "m.f"))
    with pytest.raises(ValueError, match=r"^rollout\.engine: unknown rollout engine 'z'; known: a$"):
        table["z"]
    assert table.remove("a") is spec and "a" not in table


def test_unknown_engines_stop_on_the_command_line():
    for args, field in (
        (["train.engine=jax"], "train.engine"),
        (["rollout.engine=sglang"], "rollout.engine"),
        (["critic.engine=jax"], "critic.engine"),
    ):
        with pytest.raises(ValueError, match=rf"^{field}: unknown (rollout|train) engine") as e:
            load_config(["--model", "tiny", *args])
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["train.engine=fsdp2", "train.lora_rank=4"], r"^train\.lora_rank: not supported by train\.engine=fsdp2 \("),
        (["train.engine=deepspeed", "train.zero_stage=3", "train.lora_rank=4"],
         r"^train\.lora_rank: not supported by train\.engine=deepspeed \(.*zero_stage <= 2"),
        (["train.engine=deepspeed", "train.zero_stage=3", "train.logprob_chunk_tokens=8"],
         r"^train\.logprob_chunk_tokens: not supported by train\.engine=deepspeed"),
        (["train.engine=megatron", "train.packing=true"], r"^train\.packing: not supported by train\.engine=megatron$"),
        (["train.engine=megatron", "algorithm.advantage=gae"], r"^critic\.engine: not supported by train\.engine=megatron"),
        (["train.master_weights=true"], r"^train\.master_weights: needs train\.engine=torch and model\.dtype"),
        (["rollout.engine=hf", "rollout.servers=http://h:1"], r"^rollout\.servers is set .* set rollout\.engine=server$"),
        (["rollout.engine=hf", "rollout.tensor_parallel_size=2"], r"use rollout\.engine=vllm or server"),
        (["rollout.engine=server", "ray.enabled=true"], r"^rollout\.engine=server: the inference servers"),
    ],
)  # fmt: skip
def test_refusals_come_from_the_capabilities_and_name_the_field(args, match):
    with pytest.raises(ValueError, match=match) as e:
        load_config(["--model", "tiny", *args])
    assert "\n" not in str(e.value)


def test_a_new_engine_is_a_builder_plus_one_line(tmp_path):
    """A train engine declared in one line (here the torch engine's builder under another name,
    without LoRA) is accepted by the config, refused what it lacks by name, and built."""
    spec = TRAIN_ENGINES.declare(
        TrainEngineSpec("plain", "trainers.engines.torch_train:build_torch_train", "a test's engine")
    )
    try:
        cfg = load_config(["--model", "tiny", "train.engine=plain", f"logging.dir={tmp_path}"])
        with pytest.raises(ValueError, match=r"^train\.lora_rank: not supported by train\.engine=plain$"):
            load_config(["--model", "tiny", "train.engine=plain", "train.lora_rank=4"])
        tok = char_tokenizer()
        eng = make_train_engine(cfg, tiny_qwen2(tok, seed=0), device="cpu")
        assert type(eng) is TorchTrainEngine
        # a rollout engine the same way: hf's builder, declared without head size 16
        ROLLOUT_ENGINES.declare(RolloutEngineSpec("plain_hf", "trainers.engines.hf_rollout:build_hf_rollout",
                                                  head_size_16=False))  # fmt: skip
        cfg = load_config(["--model", "tiny", "rollout.engine=plain_hf", f"logging.dir={tmp_path}"])
        assert tiny_heads(cfg) == 2 and tiny_heads(Config()) == 4
        assert type(make_rollout_engine(cfg, tiny_qwen2(tok, seed=0), tok, device="cpu")) is HFRolloutEngine
    finally:
        TRAIN_ENGINES.remove(spec.name)
        if "plain_hf" in ROLLOUT_ENGINES:
            ROLLOUT_ENGINES.remove("plain_hf")
    with pytest.raises(ValueError, match=r"^train\.engine: unknown train engine 'plain'"):
        load_config(["train.engine=plain"])


def test_a_builder_that_cannot_load_is_named():
    spec = ROLLOUT_ENGINES.declare(RolloutEngineSpec("broken", "trainers.engines.no_such_module:build"))
    try:
        cfg = Config()
        cfg.rollout.engine = "broken"
        validate(cfg)
        with pytest.raises(ValueError, match=r"^rollout\.engine=broken: its builder trainers\.engines\.no_such_module:build cannot be loaded"):
            engine_builder(ROLLOUT_ENGINES, "broken")
    finally:
        ROLLOUT_ENGINES.remove(spec.name)
    assert dataclasses.is_dataclass(spec)

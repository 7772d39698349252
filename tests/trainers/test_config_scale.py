"""The scale settings from the config (issue 30): each new key rejects bad values naming its field,
and reaches the engine it configures (real engines on the tiny Qwen2, float32).

Keys: ``placement.offload_train``, ``train.gradient_checkpointing``, ``train.fsdp2_cpu_offload``,
``rollout.tensor_parallel_size``, ``checkpoint.keep``.
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("trainers.engines.deepspeed_train")  # sets DS_ACCELERATOR=cpu first

from torch.distributed.fsdp import CPUOffloadPolicy

from trainers.config import AgenticConfig, load_config, validate, validate_agentic, validate_async
from trainers.engines.base import pack
from trainers.engines.build import make_rollout_engine, make_train_engine
from trainers.engines.vllm_server import server_command
from trainers.loops.common import rotate_checkpoints, write_checkpoint
from trainers.models import char_tokenizer, tiny_qwen2


def cfg_of(*args):
    return load_config(["--model", "tiny", *args])


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["placement.offload_train=maybe"], "placement.offload_train"),
        (["train.gradient_checkpointing=2"], "train.gradient_checkpointing"),
        (["train.fsdp2_cpu_offload=yes please"], "train.fsdp2_cpu_offload"),
        (["rollout.tensor_parallel_size=two"], "rollout.tensor_parallel_size"),
        (["rollout.tensor_parallel_size=1.5"], "rollout.tensor_parallel_size"),
        (["checkpoint.keep=some"], "checkpoint.keep"),
    ],
)
def test_unparsable_values_name_the_field(args, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        cfg_of(*args)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["rollout.tensor_parallel_size=0"], r"rollout\.tensor_parallel_size must be an int >= 1, got 0"),
        (["rollout.tensor_parallel_size=-2"], r"rollout\.tensor_parallel_size must be an int >= 1, got -2"),
        (["rollout.tensor_parallel_size=2"], r"rollout\.tensor_parallel_size=2: the transformers engine"),
        (
            ["rollout.engine=vllm", "rollout.tensor_parallel_size=2", "ray.enabled=true"],
            r"rollout\.tensor_parallel_size=2: each Ray rollout actor needs that many GPUs.*gpus_per_worker",
        ),
        (["checkpoint.keep=-1"], r"checkpoint\.keep must be an int >= 0, got -1"),
        (
            ["train.fsdp2_cpu_offload=true"],
            r"train\.fsdp2_cpu_offload: FSDP2's CPUOffloadPolicy needs train\.engine=fsdp2",
        ),
        (
            ["placement.offload_train=true", "ray.enabled=true", "placement.mode=disaggregated"],
            r"placement\.offload_train: applies to placement\.mode=colocated",
        ),
    ],
)
def test_bad_values_are_rejected_by_field(args, match):
    with pytest.raises(ValueError, match=match):
        validate(cfg_of(*args))


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("placement", "offload_train", 1),
        ("train", "gradient_checkpointing", "yes"),
        ("train", "fsdp2_cpu_offload", None),
        ("rollout", "tensor_parallel_size", True),
        ("checkpoint", "keep", 1.0),
    ],
)
def test_bad_types_set_in_code_are_rejected_by_field(section, key, value):
    cfg = cfg_of("train.engine=fsdp2")
    setattr(getattr(cfg, section), key, value)
    with pytest.raises(ValueError, match=rf"{section}\.{key}"):
        validate(cfg)


def test_offload_train_is_refused_by_the_async_trainer_and_keep_checked_by_the_agentic_one():
    with pytest.raises(ValueError, match=r"placement\.offload_train: the asynchronous trainer"):
        validate_async(cfg_of("placement.offload_train=true"))
    with pytest.raises(ValueError, match=r"checkpoint\.keep"):  # on the command line
        load_config(["checkpoint.keep=-3"], base=AgenticConfig())
    a = AgenticConfig()
    a.checkpoint.keep = -3  # a config built in code
    with pytest.raises(ValueError, match=r"checkpoint\.keep"):
        validate_agentic(a)


def test_good_values_pass():
    validate(cfg_of("placement.offload_train=true", "train.gradient_checkpointing=true", "checkpoint.keep=2"))
    validate(cfg_of("train.engine=fsdp2", "train.fsdp2_cpu_offload=true"))
    validate(cfg_of("rollout.engine=vllm", "rollout.tensor_parallel_size=2"))
    validate(
        cfg_of(
            "rollout.engine=vllm",
            "rollout.tensor_parallel_size=2",
            "ray.enabled=true",
            "placement.gpus_per_worker=2",
        )
    )


# --------------------------------------------------------------------------- the keys reach the engines


def _step(engine, tok):
    b = pack([tok("12+34=").input_ids, tok("7+5=").input_ids], [tok("46").input_ids, tok("12!").input_ids], 0)
    lp = engine.logprobs(b.input_ids, b.attention_mask, b.response_mask)
    engine.backward(-(lp * b.response_mask).sum())
    engine.step()
    return {n: t.detach().clone() for n, t in engine.export_weights()}


@pytest.mark.parametrize("engine", ["torch", "deepspeed", "fsdp2"])
def test_gradient_checkpointing_reaches_every_engine(engine):
    tok = char_tokenizer()
    weights = []
    for ckpt in (False, True):
        cfg = cfg_of(
            f"train.engine={engine}",
            "train.zero_stage=0",
            f"train.gradient_checkpointing={ckpt}",
            "train.lr=1e-3",
        )
        eng = make_train_engine(cfg, tiny_qwen2(tok, seed=0), device="cpu")
        hf = getattr(eng.model, "module", eng.model)
        assert hf.is_gradient_checkpointing is ckpt
        weights.append(_step(eng, tok))
    # the same step up to float rounding (prompt sharing is off under checkpointing)
    assert max((weights[0][n] - weights[1][n]).abs().max().item() for n in weights[0]) < 1e-5


def test_fsdp2_cpu_offload_policy_trains():
    tok = char_tokenizer()
    weights = []
    for off in (False, True):
        cfg = cfg_of("train.engine=fsdp2", f"train.fsdp2_cpu_offload={off}", "train.lr=1e-3")
        eng = make_train_engine(cfg, tiny_qwen2(tok, seed=0), device="cpu")
        policy = eng.model._get_fsdp_state()._fsdp_param_group.offload_policy
        assert isinstance(policy, CPUOffloadPolicy) is off
        weights.append(_step(eng, tok))
    assert max((weights[0][n] - weights[1][n]).abs().max().item() for n in weights[0]) < 1e-6


def test_tensor_parallel_size_reaches_the_vllm_server_command_and_refuses_hf():
    cmd = server_command("/m", 8000, tensor_parallel_size=4)
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4"
    assert "--tensor-parallel-size" not in server_command("/m", 8000)
    with pytest.raises(ValueError, match=r"rollout\.tensor_parallel_size"):
        server_command("/m", 8000, tensor_parallel_size=0)
    cfg = cfg_of()
    cfg.rollout.tensor_parallel_size = 2  # set in code: load_config refuses it already
    tok = char_tokenizer()
    with pytest.raises(ValueError, match=r"rollout\.tensor_parallel_size=2: the hf engine"):
        make_rollout_engine(cfg, tiny_qwen2(tok, seed=0), tok, device="cpu")


# --------------------------------------------------------------------------- checkpoint.keep


def test_checkpoint_rotation_keeps_the_newest_the_current_and_the_resumed(tmp_path):
    for step in (1, 2, 3):
        write_checkpoint({"step": step}, tmp_path, step)
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    resumed = tmp_path / "step_000001"
    path = write_checkpoint({"step": 4}, tmp_path, 4, keep=2, resume=str(resumed))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes",
        "step_000001",
        "step_000003",
        "step_000004",
    ]
    assert path.name == "step_000004"
    # protected checkpoints are spared without counting against keep; the rest go oldest first
    assert rotate_checkpoints(tmp_path, 1, protect=[tmp_path / "step_000003", resumed / "trainer.pt"]) == []
    assert rotate_checkpoints(tmp_path, 1, protect=[resumed / "trainer.pt"]) == [tmp_path / "step_000003"]
    write_checkpoint({"step": 5}, tmp_path, 5, keep=0)  # 0: keep every one
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000001", "step_000004", "step_000005"]
    with pytest.raises(ValueError, match=r"checkpoint\.keep"):
        rotate_checkpoints(tmp_path, -1)

"""Config: dataclass defaults, YAML files, key=value / --key value overrides, clear errors."""

import pytest

from trainers.config import Config, config_to_dict, help_text, load_config


def test_defaults_and_overrides(tmp_path):
    data = tmp_path / "x.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = load_config([])
    assert cfg == Config()
    cfg = load_config(
        [
            "train.lr=1e-5",
            "--algorithm.advantage",
            "rloo",
            "--rollout.n=4",
            "filter.zero_variance=true",
            "algorithm.policy_loss_kwargs={clip_high: 0.28}",
            "rollout.max_batch_size=null",
            "--model",
            "tiny",
            "--data",
            str(data),
            "algorithm.kl.coef=0.1",
        ]
    )
    assert cfg.train.lr == 1e-5 and isinstance(cfg.train.lr, float)
    assert cfg.algorithm.advantage == "rloo" and cfg.rollout.n == 4 and cfg.filter.zero_variance is True
    assert cfg.algorithm.policy_loss_kwargs == {"clip_high": 0.28}
    assert (
        cfg.rollout.max_batch_size is None and cfg.model.path == "tiny" and cfg.data.train_file == str(data)
    )
    assert cfg.algorithm.kl.coef == 0.1
    assert load_config(["rollout.max_batch_size=16"]).rollout.max_batch_size == 16
    assert load_config(["train.lr=1"]).train.lr == 1.0  # int accepted for a float field


def test_yaml_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 2.0e-5\n  steps: 7\nalgorithm:\n  kl: {coef: 0.05, mode: reward}\nseed: 3\n")
    cfg = load_config(["--config", str(f), "train.steps=9"])
    assert (cfg.train.lr, cfg.train.steps, cfg.seed) == (2e-5, 9, 3)
    assert cfg.algorithm.kl.coef == 0.05 and cfg.algorithm.kl.mode == "reward"
    assert config_to_dict(cfg)["train"]["steps"] == 9
    with pytest.raises(ValueError, match="config: file not found"):
        load_config(["--config", str(tmp_path / "missing.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lrr: 1\n")
    with pytest.raises(ValueError, match=r"train\.lrr: unknown field"):
        load_config(["--config", str(bad)])


@pytest.mark.parametrize(
    "arg, match",
    [
        ("train.lr=fast", "train.lr: expected float"),
        ("rollout.n=2.5", "rollout.n: expected int"),
        ("filter.zero_variance=maybe", "filter.zero_variance: expected bool"),
        ("nope.x=1", "nope: unknown field of the config"),
        ("train.nope=1", "train.nope: unknown field of train"),
        ("algorithm.policy_loss_kwargs=3", "algorithm.policy_loss_kwargs: expected a mapping"),
        ("train=torch", None),  # alias of train.engine: fine
        ("algorithm.kl=1", "algorithm.kl: is a section"),
        ("justaword", "expected key=value"),
    ],
)
def test_errors_name_the_field(arg, match):
    if match is None:
        assert load_config([arg]).train.engine == "torch"
        return
    with pytest.raises(ValueError, match=match):
        load_config([arg])


def test_missing_value_after_flag():
    with pytest.raises(ValueError, match="missing value"):
        load_config(["--train.lr"])


def test_help_lists_every_field(capsys):
    text = help_text()
    for line in (
        "train.lr",
        "float",
        "1e-05",
        "algorithm.kl.estimator",
        "rollout.max_batch_size",
        "int | None",
    ):
        assert line in text
    lines = {ln.split()[0]: ln.split()[1] for ln in text.splitlines() if ln.strip()}
    assert lines["rollout.engine"] == "{hf,vllm,server}"  # the engine table's names
    assert lines["train.engine"] == "{torch,deepspeed,fsdp2,megatron}"
    assert lines["critic.engine"] == "{'',torch,deepspeed,fsdp2,megatron}"
    with pytest.raises(SystemExit):
        load_config(["--help"])
    assert "algorithm.advantage" in capsys.readouterr().out


def test_ray_placement_and_reward_fields():
    cfg = load_config([])
    assert cfg.ray.enabled is False and cfg.ray.address == "" and cfg.placement.mode == "colocated"
    assert cfg.reward.verifier == "exact_match" and cfg.reward.backend == "inline"
    assert cfg.train.engine == "torch" and cfg.train.zero_stage == 2
    cfg = load_config(["--ray"])
    assert cfg.ray.enabled is True and cfg.ray.address == ""
    cfg = load_config(["--ray-address", "auto"])  # implies ray.enabled
    assert cfg.ray.enabled is True and cfg.ray.address == "auto"
    cfg = load_config(["--ray-address=10.0.0.1:6379", "--rollout", "vllm", "--train", "deepspeed"])
    assert cfg.ray.address == "10.0.0.1:6379" and (cfg.rollout.engine, cfg.train.engine) == (
        "vllm",
        "deepspeed",
    )
    cfg = load_config(
        [
            "ray.enabled=true",
            "placement.mode=disaggregated",
            "placement.train_workers=2",
            "placement.cpus_per_worker=0.5",
            "placement.gpus_per_worker=1",
            "placement.rollout_resources={rollout_node: 0.1}",
            "reward.verifier=math_verify",
            "reward.backend=ray",
            "reward.num_workers=4",
            "reward.timeout_s=5",
            "train.zero_stage=3",
        ]
    )
    assert cfg.placement.train_workers == 2 and cfg.placement.cpus_per_worker == 0.5
    assert cfg.placement.gpus_per_worker == 1.0 and cfg.placement.rollout_resources == {"rollout_node": 0.1}
    assert (cfg.reward.verifier, cfg.reward.backend, cfg.reward.num_workers, cfg.reward.timeout_s) == (
        "math_verify",
        "ray",
        4,
        5.0,
    )
    with pytest.raises(ValueError, match=r"placement\.train_workers: expected int"):
        load_config(["placement.train_workers=two"])
    with pytest.raises(ValueError, match=r"ray\.enabled: expected bool"):
        load_config(["ray.enabled=maybe"])
    with pytest.raises(ValueError, match="missing value"):
        load_config(["--ray-address"])


def test_help_lists_ray_fields(capsys):
    with pytest.raises(SystemExit):
        load_config(["--help"])
    out = capsys.readouterr().out
    for line in (
        "--ray-address = ray.address",
        "--ray = ray.enabled=true",
        "placement.mode",
        "reward.backend",
    ):
        assert line in out


def test_rollout_dtype_and_autocast_resolution():
    import torch

    from trainers.engines.build import fast_bf16, rollout_dtype, train_autocast

    cfg = load_config([])
    assert rollout_dtype(cfg, "cpu") == torch.float32 and train_autocast(cfg, "cpu") is None
    fast = fast_bf16("cpu")
    cfg = load_config(["rollout.dtype=auto", "train.autocast=auto"])
    assert rollout_dtype(cfg, "cpu") == (torch.bfloat16 if fast else torch.float32)
    assert train_autocast(cfg, "cpu") == (torch.bfloat16 if fast else None)
    cfg = load_config(["rollout.dtype=bfloat16", "train.autocast=bfloat16"])
    assert rollout_dtype(cfg, "cpu") == torch.bfloat16 and train_autocast(cfg, "cpu") == torch.bfloat16
    # auto never turns autocast on for DeepSpeed; an explicit request is refused with the fix named
    assert train_autocast(load_config(["train.autocast=auto", "--train", "deepspeed"]), "cpu") is None
    with pytest.raises(ValueError, match=r"model\.dtype=bfloat16"):
        train_autocast(load_config(["train.autocast=bfloat16", "--train", "deepspeed"]), "cpu")
    with pytest.raises(ValueError, match=r"rollout\.dtype"):
        rollout_dtype(load_config(["rollout.dtype=int8"]), "cpu")
    with pytest.raises(ValueError, match=r"train\.autocast"):
        train_autocast(load_config(["train.autocast=yes"]), "cpu")


def test_fast_bf16_switch_forces_either_path(monkeypatch):
    """ROLLKIT_FAST_BF16=0 / 1 decides dtype=auto on any CPU (CI exercises both numeric paths)."""
    import torch

    from trainers.engines.build import fast_bf16, rollout_dtype

    cfg = load_config(["rollout.dtype=auto"])
    for value, want in (("0", torch.float32), ("1", torch.bfloat16)):
        monkeypatch.setenv("ROLLKIT_FAST_BF16", value)
        assert fast_bf16("cpu") is (value == "1") and rollout_dtype(cfg, "cpu") == want
    monkeypatch.setenv("ROLLKIT_FAST_BF16", "")  # unset: the hardware decides
    assert fast_bf16("cpu") == bool(torch.cpu._is_amx_tile_supported())


@pytest.mark.parametrize(
    "args, match",
    [
        (["rollout.lora_weights=x"], "rollout.lora_weights must be one of merged, adapter"),
        (["rollout.lora_weights=adapter"], r"needs a LoRA policy \(train.lora_rank > 0\)"),
        (["train.lora_rank=4", "rollout.lora_weights=adapter"], "not rollout.engine='hf'"),
        (
            [
                "train.lora_rank=4",
                "rollout.lora_weights=adapter",
                "rollout.engine=vllm",
                "placement.sleep_level=2",
            ],
            "placement.sleep_level=2 discards",
        ),
        (["rollout.engine_temperature=-1"], "rollout.engine_temperature must be >= 0"),
        (["train.lora_rank=4", "rollout.lora_weights=adapter", "rollout.engine=vllm"], None),
        (["rollout.engine_temperature=1.3"], None),
    ],
)
def test_rollout_lora_weights_and_engine_temperature_are_checked(args, match):
    from trainers.config import AgenticConfig, validate, validate_agentic

    validate_agentic(AgenticConfig())  # the agentic rollout section has neither field
    if match is None:
        validate(load_config(args))
        return
    with pytest.raises(ValueError, match=match):
        validate(load_config(args))


def test_per_request_lengths_and_tail_batching_validate_on_ray():
    """Every trainer takes rollout.length_dist and tail batching on Ray: the synchronous one
    drives the Ray rollout actors through their request engines (test_ray_trainer.py)."""
    from trainers.config import validate, validate_async

    for extra in ([], ["tail_batching.enabled=true"]):
        cfg = load_config(
            ["rollout.length_dist=lognormal:8:1", "ray.enabled=true", "placement.mode=disaggregated", *extra]
        )
        validate(cfg)
        if not extra:
            validate_async(cfg)

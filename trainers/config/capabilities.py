"""The rollout and train engines a config may name, each with what it supports.

``rollout.engine`` and ``train.engine`` (and ``critic.engine``) name an entry of
:data:`ROLLOUT_ENGINES` / :data:`TRAIN_ENGINES`. An entry is one line: the engine's name, where its
builder lives (``"module:function"``, imported by :mod:`trainers.engines.build` when the engine is
built, so the configuration never imports an engine) and its capabilities, which the sections'
validators read instead of comparing engine names. Adding an engine is a file (the engine and its
builder) plus one line here; a project of your own declares one the same way before it loads a
config::

    from trainers.config import TRAIN_ENGINES, TrainEngineSpec
    TRAIN_ENGINES.declare(TrainEngineSpec("mine", "mypkg.engine:build", "my trainer", lora=True))

A capability is a bool, or a function of the ``train`` section for the train engines whose support
depends on their own settings (DeepSpeed under ZeRO-3). ``notes`` says why a capability is
missing; a refusal quotes it.

>>> ROLLOUT_ENGINES["vllm"].tensor_parallel
True
>>> TRAIN_ENGINES.supports("deepspeed", "lora", train=type("T", (), {"zero_stage": 3})())
False
>>> "fsdp2" in TRAIN_ENGINES, "jax" in TRAIN_ENGINES
(True, False)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "ROLLOUT_ENGINES",
    "TRAIN_ENGINES",
    "EngineTable",
    "OrEmpty",
    "RolloutEngineSpec",
    "TrainEngineSpec",
]

#: a capability: fixed, or decided by the ``train`` section
Capability = bool | Callable[[Any], bool]


@dataclass(frozen=True)
class RolloutEngineSpec:
    """A rollout engine: ``builder(cfg, model, tokenizer, *, device)`` returns it."""

    name: str
    builder: str
    summary: str = ""
    # shards the model over rollout.tensor_parallel_size devices
    tensor_parallel: bool = False
    # serves LoRA adapters without merging them (rollout.lora_weights=adapter)
    lora_adapter: bool = False
    # drives inference servers (rollout.servers / num_servers): the servers are the workers, so
    # the engine runs in the trainer's process (no Ray) and one engine routes over all of them
    remote: bool = False
    # attention with head size 16 (the tiny test model's default; vLLM's CPU attention has none)
    head_size_16: bool = True
    # takes image inputs (vision-language policies)
    images: bool = True
    # a Qwen2-VL-family model needs torchvision installed (vLLM's processor)
    qwen2_vl_needs_torchvision: bool = False
    notes: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainEngineSpec:
    """A train engine: ``builder(cfg, model, *, device, **common)`` returns it, where ``common`` are
    the settings every engine takes (optimizer, schedule, dtype, lean head...)."""

    name: str
    builder: str
    summary: str = ""
    # LoRA adapters (peft): trained, merged for the rollout and saved
    lora: Capability = False
    # the memory-lean log-prob head (train.logprob_chunk_tokens; it reads the whole LM head)
    lean_head: Capability = True
    # ... and with image inputs (a vision-language policy)
    lean_head_images: bool = True
    # an explicit train.autocast: on any device, on CUDA only, or never (the engine has its own mode)
    autocast: Literal["any", "cuda", "none"] = "none"
    # float32 master weights over low-precision parameters (train.master_weights)
    master_weights: bool = False
    packing: bool = True  # train.packing
    compile: bool = True  # train.compile
    cpu_offload: bool = False  # train.fsdp2_cpu_offload
    critic: bool = True  # trains a critic (critic.engine)
    critic_lora: Capability = False  # ... with LoRA
    vision: bool = True  # vision-language policies
    model_parallel: bool = False  # train.megatron_tp / megatron_pp
    reward_model: bool = False  # offline.loss=rm
    notes: Mapping[str, str] = field(default_factory=dict)


class EngineTable:
    """The engines of one kind (``rollout engine`` or ``train engine``) by name. ``in``, iteration
    and ``names()`` see the names; ``table[name]`` is the spec (an unknown name raises naming
    ``field``). Declaring the same spec again is a no-op (module re-imports); another spec under a
    taken name is refused."""

    def __init__(self, kind: str, field_: str, specs: tuple[Any, ...] = ()) -> None:
        self.kind, self.field = kind, field_
        self._specs: dict[str, Any] = {}
        for s in specs:
            self.declare(s)

    def declare(self, spec: Any) -> Any:
        """Add ``spec`` (a :class:`RolloutEngineSpec` / :class:`TrainEngineSpec`); returns it."""
        if not isinstance(spec.name, str) or not spec.name:
            raise ValueError(f"{self.kind}: a name must be a non-empty string, got {spec.name!r}")
        if ":" not in spec.builder:
            raise ValueError(
                f"{self.kind} {spec.name!r}: builder must be 'module:function', got {spec.builder!r}"
            )
        held = self._specs.get(spec.name)
        if held is not None:
            if held != spec:
                raise ValueError(f"{self.kind} {spec.name!r} is already declared (builder {held.builder})")
            return held
        self._specs[spec.name] = spec
        return spec

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def __getitem__(self, name: str) -> Any:
        try:
            return self._specs[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"{self.field}: unknown {self.kind} {name!r}; known: {', '.join(self._specs)}"
            ) from None

    def supports(self, name: str, capability: str, *, train: Any = None) -> bool:
        """Whether engine ``name`` has ``capability`` (a callable one is asked with ``train``)."""
        value = getattr(self[name], capability)
        return bool(value(train) if callable(value) else value)

    def having(self, keep: Callable[[Any], bool]) -> str:
        """The names of the engines whose spec ``keep`` accepts, as ``"a or b"`` (for messages)."""
        return " or ".join(n for n, s in self._specs.items() if keep(s)) or "none"

    def remove(self, name: str) -> Any:
        """Take engine ``name`` out (a test's or a notebook's own engine); returns its spec."""
        spec = self[name]
        del self._specs[name]
        return spec

    def __repr__(self) -> str:
        return f"EngineTable({self.kind}: {', '.join(self._specs)})"


class OrEmpty:
    """A table's names plus ``""`` (a field where empty means "the other field's engine")."""

    def __init__(self, table: EngineTable) -> None:
        self.table, self.kind = table, table.kind

    def __contains__(self, name: object) -> bool:
        return name == "" or name in self.table

    def names(self) -> tuple[str, ...]:
        return ("''", *self.table.names())


def _below_zero3(train: Any) -> bool:
    return train.zero_stage <= 2


_WHOLE = "which ZeRO-3 keeps partitioned; with train.engine=deepspeed use train.zero_stage <= 2"

#: ``rollout.engine``'s engines
ROLLOUT_ENGINES = EngineTable(
    "rollout engine",
    "rollout.engine",
    (
        RolloutEngineSpec("hf", "trainers.engines.hf_rollout:build_hf_rollout", "transformers' sampling loop",
                          notes={"tensor_parallel": "the transformers engine (rollout.engine=hf) runs on one device"}),
        RolloutEngineSpec("vllm", "trainers.engines.vllm_rollout:build_vllm_rollout", "vLLM in process",
                          tensor_parallel=True, lora_adapter=True, head_size_16=False,
                          qwen2_vl_needs_torchvision=True),
        RolloutEngineSpec("server", "trainers.engines.server_rollout:build_server_rollout", "vllm serve over HTTP",
                          tensor_parallel=True, remote=True, head_size_16=False, images=False,
                          notes={"images": "vLLM's token-in completions API takes no images"}),
    ),
)  # fmt: skip

#: ``train.engine``'s (and ``critic.engine``'s) engines
TRAIN_ENGINES = EngineTable(
    "train engine",
    "train.engine",
    (
        TrainEngineSpec("torch", "trainers.engines.torch_train:build_torch_train", "plain PyTorch",
                        lora=True, critic_lora=True, autocast="any", master_weights=True, reward_model=True),
        TrainEngineSpec("deepspeed", "trainers.engines.deepspeed_train:build_deepspeed_train", "DeepSpeed ZeRO 0-3",
                        lora=_below_zero3, critic_lora=_below_zero3, lean_head=_below_zero3,
                        notes={"lora": f"the merged export and the peft save read whole base and adapter weights, {_WHOLE}",
                               "critic_lora": f"a LoRA critic reads whole weights, {_WHOLE}",
                               "lean_head": f"the memory-lean log-probs need the whole LM head weight, {_WHOLE}",
                               "autocast": "set model.dtype=bfloat16 (DeepSpeed's own bf16 mode)"}),
        TrainEngineSpec("fsdp2", "trainers.engines.fsdp2_train:build_fsdp2_train", "torch fully_shard",
                        cpu_offload=True, lean_head_images=False,
                        notes={"lora": "the merged export and the peft save read whole weights, which FSDP2 keeps "
                                       "as sharded DTensors; not wired (use train.engine=torch or deepspeed)",
                               "critic_lora": "a LoRA critic is wired for torch and deepspeed (ZeRO 0-2), not fsdp2",
                               "lean_head_images": "the FSDP2 engine's lean head runs the text decoder only",
                               "autocast": "set model.dtype=bfloat16 (FSDP2's mixed_precision)"}),
        TrainEngineSpec("megatron", "trainers.engines.megatron_train:build_megatron_train", "Megatron-Core TP / PP",
                        autocast="cuda", packing=False, compile=False, critic=False, vision=False,
                        model_parallel=True,
                        notes={"critic": "the Megatron engine trains the policy; set critic.engine=torch (or deepspeed)",
                               "vision": "train.engine=megatron maps Llama / Qwen2 text models only",
                               "autocast": "Megatron-Core's linear layers autocast on CUDA only"}),
    ),
)  # fmt: skip

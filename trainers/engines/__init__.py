"""Rollout and training engines behind one interface each (see :mod:`trainers.engines.base`).

Embedded defaults, which run anywhere: :class:`HFRolloutEngine` (transformers sampling loop)
and :class:`TorchTrainEngine` (plain PyTorch). vLLM and DeepSpeed engines implement the same
protocols; :class:`ServerRolloutEngine` drives ``vllm serve`` processes over HTTP. transformers, vLLM and DeepSpeed are imported only when an engine is built;
:mod:`trainers.engines.build` makes engines from a config.
"""

from trainers.engines.base import (
    Generation,
    PackedBatch,
    RolloutEngine,
    SamplingParams,
    TrainEngine,
    pack,
    pack_generations,
    pad_right,
    position_ids_from_mask,
)
from trainers.engines.deepspeed_train import DeepSpeedTrainEngine
from trainers.engines.fsdp2_train import FSDP2TrainEngine
from trainers.engines.hf_rollout import HFRolloutEngine, process_logits
from trainers.engines.requests import (
    HFRequestEngine,
    Request,
    RequestEngine,
    VLLMRequestEngine,
    as_request_engine,
)
from trainers.engines.server_rollout import ServerRolloutEngine
from trainers.engines.step import StepBatch
from trainers.engines.torch_train import TorchTrainEngine, token_logprobs

__all__ = [
    "DeepSpeedTrainEngine",
    "FSDP2TrainEngine",
    "Generation",
    "HFRequestEngine",
    "HFRolloutEngine",
    "PackedBatch",
    "Request",
    "RequestEngine",
    "RolloutEngine",
    "SamplingParams",
    "ServerRolloutEngine",
    "StepBatch",
    "TorchTrainEngine",
    "TrainEngine",
    "VLLMRequestEngine",
    "as_request_engine",
    "pack",
    "pack_generations",
    "pad_right",
    "position_ids_from_mask",
    "process_logits",
    "token_logprobs",
]

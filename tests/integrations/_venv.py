"""Run a checker script of this folder with the python of a venv built by setup_envs.sh."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
TEMPFAIL = 75  # EX_TEMPFAIL: a checker exits with it where a third-party import failed in a way seen to pass on a rerun
ENVS = Path(os.environ.get("ROLLKIT_INTEGRATION_ENVS", Path.home() / ".cache" / "rollkit-integration-envs"))


def run_checker(env: str, script: str, timeout: int = 300) -> str:
    """Run ``script`` in ``$ROLLKIT_INTEGRATION_ENVS/env``; skip when that venv is absent."""
    python = ENVS / env / "bin" / "python"
    if not (ENVS / env / ".rollkit-ready").exists():  # absent, or still being built
        pytest.skip(
            f"no finished {env} venv at {ENVS / env}: run tests/integrations/setup_envs.sh (ROLLKIT_INTEGRATION_ENVS)"
        )
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_DISABLE_IMPORT_WARNING": "1"}

    def run():
        return subprocess.run(
            [str(python), str(HERE / script)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=environ,
            cwd=ROOT,
        )

    proc = run()
    if proc.returncode == TEMPFAIL:  # a checker's third-party import failed (it printed why): once more
        warnings.warn(
            f"{script} could not import its framework, ran it again; it printed:\n{proc.stderr[-2000:]}",
            stacklevel=2,
        )
        proc = run()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    sys.stdout.write(out)
    return out

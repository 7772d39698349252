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


# ROLLKIT_INTEGRATION_REQUIRED=1 (.ci/run): a missing venv fails the test instead of skipping it.
REQUIRED = os.environ.get("ROLLKIT_INTEGRATION_REQUIRED") == "1"


def venv_key() -> str:
    """The key setup_envs.sh builds the venvs for (its own sha256 and this Python's version)."""
    out = subprocess.run(
        ["bash", str(HERE / "setup_envs.sh"), "--key"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable},
    )  # fmt: skip
    return out.stdout.strip()


def run_checker(env: str, script: str, timeout: int = 300) -> str:
    """Run ``script`` in ``$ROLLKIT_INTEGRATION_ENVS/env``; skip when that venv is absent or was
    built for another version of setup_envs.sh (fail instead under ROLLKIT_INTEGRATION_REQUIRED=1)."""
    python = ENVS / env / "bin" / "python"
    stamp = ENVS / env / ".rollkit-ready"  # written last, with the key, by setup_envs.sh
    built = stamp.read_text().strip() if stamp.exists() else None
    if built != venv_key():  # absent, still being built, or stale
        why = "no finished" if built is None else f"a stale (key {built})"
        msg = f"{why} {env} venv at {ENVS / env}: run tests/integrations/setup_envs.sh (ROLLKIT_INTEGRATION_ENVS)"
        if REQUIRED:
            pytest.fail(msg)
        pytest.skip(msg)
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

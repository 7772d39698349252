"""Failures of ``rollout.engine=server`` as a user meets them, on real ``vllm serve`` processes (CPU).

* A server that dies is reported with its cause: the exit code and the error lines of its log,
  in the error the run ends with and in ``server/drop_cause``.
* Nothing rollkit started outlives the run: the recipe killed with SIGKILL mid-run, and a run that
  fails (its only server killed, so the engine starts a replacement in the background just as the
  run ends: the case that once left a server running, re-parented to PID 1, holding 1.7 GB).
  Every process of the run carries a tag in its environment (servers inherit the trainer's), so
  ``/proc`` tells whether any is left, whatever its parent or process group.
* The tiny model's default on a vLLM rollout has a head size vLLM's CPU attention supports; a
  checkpoint whose head size it lacks is refused by name before any server starts.
* A run's server answers only its owner: another process without the server's key (which is in
  the server's environment, on no command line) cannot pause it.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("vllm")

from trainers.config import load_config
from trainers.engines import SamplingParams
from trainers.engines.build import build_model
from trainers.engines.server_rollout import ServerRolloutEngine
from trainers.engines.vllm_server import ServerClient, ServerError, launch_servers
from trainers.models import char_tokenizer, save_model, tiny_qwen2

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="/proc: Linux")]

ROOT = Path(__file__).resolve().parents[2]
TAG = "ROLLKIT_TEST_RUN_TAG"


def tagged(tag: str) -> list[int]:
    """The live processes whose environment carries ``TAG=tag`` (zombies excluded)."""
    needle = f"{TAG}={tag}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                if (d / "stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
                    out.append(int(d.name))
        except OSError:
            continue
    return out


def wait_none_left(tag: str, timeout: float = 60.0) -> list[int]:
    end = time.monotonic() + timeout
    while (left := tagged(tag)) and time.monotonic() < end:
        time.sleep(0.5)
    return left


def recipe(tmp_path: Path, tag: str, steps: int, engine: str = "server") -> subprocess.Popen:
    args = [
        sys.executable, str(ROOT / "recipes" / "rlvr_qwen.py"), "--model", "tiny",
        f"rollout.engine={engine}", f"rollout.server_dir={tmp_path / 'servers'}", "rollout.max_model_len=128",
        "data.digits=1", "data.eval_size=4", "eval.before=false", "eval.every=0", "eval.max_tokens=4",
        "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=8", f"train.steps={steps}",
        f"logging.dir={tmp_path / 'log'}", "logging.progress=false", "logging.tensorboard=false",
        "logging.plot=false", "rollout.server_startup_timeout_s=900", "reward.backend=process",
    ]  # fmt: skip
    env = dict(os.environ, **{TAG: tag}, PYTHONPATH=str(ROOT))
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def check_the_server_answers_its_owner_only(pids: list[int]) -> None:
    """The run's ``vllm serve`` (the guard's child): its key is in its environment and on no
    command line of the run; this process, a stranger to it, is refused a pause (401) without
    the key and is answered with it."""
    guard = next(p for p in pids if b"guard.py" in Path(f"/proc/{p}/cmdline").read_bytes())
    server = int(Path(f"/proc/{guard}/task/{guard}/children").read_text().split()[0])
    argv = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
    env = dict(
        x.split(b"=", 1) for x in Path(f"/proc/{server}/environ").read_bytes().split(b"\0") if b"=" in x
    )
    key = env[b"VLLM_API_KEY"].decode()
    assert len(key) >= 40 and not any(key.encode() in Path(f"/proc/{p}/cmdline").read_bytes() for p in pids)
    url = f"http://127.0.0.1:{int(argv[argv.index(b'--port') + 1])}"
    with pytest.raises(ServerError, match="POST /pause answered 401"):
        ServerClient(url, timeout_s=30).post("/pause")
    assert ServerClient(url, timeout_s=30, api_key=key).get("/is_paused") == {"is_paused": False}


def wait_for_step(tmp_path: Path, proc: subprocess.Popen, timeout: float = 900.0) -> None:
    """Until the run has trained a step (its servers are up and serving)."""
    metrics, end = tmp_path / "log" / "metrics.jsonl", time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if metrics.exists() and any("reward/mean" in json.loads(x) for x in metrics.read_text().splitlines()):
            return
        time.sleep(1)
    raise AssertionError(f"no step trained (exit {proc.poll()}): {proc.stdout.read() if proc.poll() else ''}")


@pytest.mark.parametrize("engine", ["server", "vllm"])
def test_a_killed_trainer_leaves_no_process(tmp_path, engine):
    """``server``: the guard stops the server's group; ``vllm`` (in process, its engine core a
    multiprocessing child): the watcher started beside ``vllm.LLM`` stops the engine core; the
    process reward workers (forkserver) end with their pipes."""
    tag = uuid.uuid4().hex
    proc = recipe(tmp_path, tag, steps=500, engine=engine)
    try:
        wait_for_step(tmp_path, proc)
        running = tagged(tag)
        assert len(running) >= 3  # the trainer, a guard or watcher, vLLM's engine process
        if engine == "server":
            check_the_server_answers_its_owner_only(running)
        proc.kill()  # no atexit, no finally: only the guard / the watcher can stop them now
        proc.wait()
        assert wait_none_left(tag) == []
    finally:
        proc.kill()
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)


def test_a_failed_run_names_the_cause_and_leaves_no_process(tmp_path):
    """The run's only server is killed: the engine drops it, starts a replacement in the
    background and the run fails at once (no live server); the error names the dead server's
    exit code and log, and the replacement that was starting does not outlive the run."""
    tag = uuid.uuid4().hex
    proc = recipe(tmp_path, tag, steps=500)
    try:
        wait_for_step(tmp_path, proc)
        guards = [p for p in tagged(tag) if "guard.py" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(guards) == 1
        server = [int(x) for x in Path(f"/proc/{guards[0]}/task/{guards[0]}/children").read_text().split()]
        os.kill(server[0], signal.SIGKILL)  # the vllm serve process (its guard reports the exit)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode != 0
        assert "no live servers left" in out or "no live server took the weights" in out, out[-3000:]
        assert "server-0.log" in out, out[-3000:]  # the cause names the dead server's log
        assert wait_none_left(tag) == [], [Path(f"/proc/{p}/cmdline").read_text() for p in tagged(tag)]
    finally:
        proc.kill()
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)


def test_a_dead_servers_log_error_is_the_cause(tmp_path):
    """A server whose engine dies at its first request (the tiny model at head size 16, which
    vLLM's CPU attention lacks, started here past rollkit's own check): the run's error and
    ``server/drop_cause`` carry the error line from the server's log, not just 'no live servers'."""
    tok = char_tokenizer()
    path = save_model(tiny_qwen2(tok, seed=0), tok, tmp_path / "model")  # heads=4: head size 16
    servers = launch_servers(path, 1, tmp_path / "run", max_model_len=128)
    with ServerRolloutEngine([s.url for s in servers], tokenizer=tok, local_servers=servers) as eng:
        with pytest.raises(ServerError, match="no live servers left") as e:
            eng.generate([tok("7+5=").input_ids], SamplingParams(max_tokens=4))
        assert "Unsupported CPU attention configuration" in str(e.value)
        assert "server-0.log" in str(e.value)
        assert "Unsupported CPU attention configuration" in eng.metrics()["server/drop_cause"]
    assert not any(s.alive() for s in servers)


def test_tiny_on_vllm_gets_a_supported_head_size_and_a_bad_one_is_refused_by_name(tmp_path):
    for engine, heads in (("hf", 4), ("vllm", 2), ("server", 2)):
        model, _ = build_model(load_config(["--model", "tiny", f"rollout.engine={engine}"]))
        assert model.config.num_attention_heads == heads, engine
    tok = char_tokenizer()
    path = save_model(tiny_qwen2(tok, seed=0, heads=4), tok, tmp_path / "model")
    with pytest.raises(ValueError, match="head_dim 16 is not supported by vLLM's CPU attention"):
        ServerRolloutEngine.launch(path, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything started

"""Hostile programs against trainers.rewards.sandbox: each must be *contained*, with and without bubblewrap.

Every program is submitted as a completion to a tiny stdin/stdout problem ("print 2n") through
:class:`trainers.rewards.code.CodeVerifier`, inside a separate *trainer* process (a driver
script), and every test checks every containment property, whatever the program attacks:

* the trainer process is alive and exits normally, and the score is 0;
* no file appeared outside the work directory (``/tmp``, ``/dev/shm``, the project checkout,
  a world-writable directory of the test);
* a world-readable secret file outside, the project's own sources, ``/etc/passwd`` and an
  environment secret of the trainer do not appear in the program's output;
* no process of the run is left (its run id or the program's marker in a command line);
* a TCP listener of the test on 127.0.0.1 received no connection;
* limits could not be raised.

The bubblewrap runs must contain all of them (skipped with the reason when bwrap cannot run
here). The rlimit fallback is expected to fail exactly the threats that
:func:`trainers.rewards.sandbox.fallback_gaps` lists: those cases are ``xfail(strict=True)`` with the
gap as the reason, so the suite fails if the fallback starts (or stops) containing them.

The fork bomb is bounded whatever happens: ``max_procs=8`` (each run gets a fresh unprivileged
uid when the trainer is root, because root ignores ``RLIMIT_NPROC``), a 1 s timeout, and the
process group, PID namespace and uid are swept afterwards.

Only the programs that never end by themselves (:data:`ENDLESS`) run with that 1 s timeout; the
others run with a deadline they never reach (:data:`SELF_ENDING_TIMEOUT_S`), so that a loaded
machine cannot cut one short before it tried its attack (a timed-out attack would pass by luck,
and the fallback's expected failures would turn into unexpected passes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from trainers.rewards.sandbox import bwrap_status, fallback_gaps

ROOT = Path(__file__).resolve().parents[2]
SANDBOX_PY = ROOT / "trainers" / "rewards" / "sandbox.py"
TIMEOUT_S = 1.0  # the programs that only a limit ends (ENDLESS)
SELF_ENDING_TIMEOUT_S = 120.0  # the others end by themselves, within a second on an idle machine
LIMITS = dict(memory_mb=256, max_procs=8, max_file_mb=1, max_open_files=32, max_output_bytes=65536, work_mb=8)

# Prints the start-up environment of the program and of each of its ancestors, up to init.
ENV_WALK = """\
import os
def environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"denied ({e.strerror})"
print("environ self", environ("self"))
pid = os.getpid()
while pid > 1:
    with open(f"/proc/{pid}/stat") as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
    print("environ", pid, environ(pid))
"""

# the programs that run until a limit stops them: the 1 s timeout (or RLIMIT_CPU)
ENDLESS = {"infinite_loop", "sleep_past_timeout", "fork_bomb"}

# Substituted per test: __MARKER__ __SECRET_PATH__ __PROJECT_FILE__ __OUTSIDE__ __PORT__ __PROJECT__
# and, by the driver, __TRAINER_PID__.
HOSTILE = {
    "infinite_loop": "while True:\n    pass\n",
    "sleep_past_timeout": "import time\ntime.sleep(600)\nprint(42)\n",
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"),
    "memory_bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))\n",
    "huge_output": "import sys\nwhile True:\n    sys.stdout.write('A' * 65536)\n",
    "disk_bomb": "with open('big.bin', 'wb') as f:\n    for _ in range(64):\n        f.write(b'0' * (1 << 20))\n",
    "fd_bomb": (
        "fds = []\n"
        "try:\n"
        "    while True:\n"
        "        fds.append(open('/dev/null'))\n"
        "except OSError:\n"
        "    print('opened', len(fds))\n"
    ),
    "read_outside": (
        "import os\n"
        "for path in ['__SECRET_PATH__', '__PROJECT_FILE__', '/etc/passwd',\n"
        "             '/proc/__TRAINER_PID__/environ', '/proc/1/environ']:\n"
        "    try:\n"
        "        print(open(path, errors='replace').read())\n"
        "    except OSError as e:\n"
        "        print('denied', path, e)\n"
    ),
    "write_outside": (
        "for d in ['/tmp', '/dev/shm', '__OUTSIDE__', '__PROJECT__']:\n"
        "    try:\n"
        "        open(d + '/__MARKER__-written', 'w').write('pwned')\n"
        "        print('wrote', d)\n"
        "    except OSError as e:\n"
        "        print('denied', d, e)\n"
    ),
    "network": (
        "import socket\n"
        "try:\n"
        "    s = socket.create_connection(('127.0.0.1', __PORT__), timeout=0.5)\n"
        "    s.sendall(b'__MARKER__')\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('no network', e)\n"
    ),
    "kill_parent": (
        "import os, signal\n"
        "for pid in (os.getppid(), __TRAINER_PID__):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "        print('killed', pid)\n"
        "    except OSError as e:\n"
        "        print('could not kill', pid, e)\n"
        "try:\n"
        "    os.killpg(os.getpgid(__TRAINER_PID__), signal.SIGKILL)\n"
        "except OSError as e:\n"
        "    print('could not kill group', e)\n"
    ),
    "raise_limits": (
        "import json, os, resource as R\n"
        "out = {}\n"
        "for name in ['RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_NPROC', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE']:\n"
        "    r = getattr(R, name)\n"
        "    try:\n"
        "        R.setrlimit(r, (R.RLIM_INFINITY, R.RLIM_INFINITY))\n"
        "        raised = True\n"
        "    except (ValueError, OSError):\n"
        "        raised = False\n"
        "    out[name] = [raised, *R.getrlimit(r)]\n"
        "try:\n"
        "    os.setuid(0)\n"
        "    out['setuid0'] = True\n"
        "except OSError:\n"
        "    out['setuid0'] = False\n"
        "print('LIMITS' + json.dumps(out))\n"
    ),
    "daemon": (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)',\n"
        "                                   '__MARKER__'], {})\n"
        "    os._exit(0)\n"
        "print('daemon started')\n"
    ),
    # its own environment, then /proc/<pid>/environ of itself and of every ancestor
    "env_leak": "import os\nprint(dict(os.environ))\n" + ENV_WALK,
}

DRIVER = """\
import dataclasses, json, os, sys
sys.path.insert(0, sys.argv[1])
from trainers.rewards.code import CodeProblem, CodeVerifier, StdioCase
spec = json.loads(sys.argv[2])
code = spec["code"].replace("__TRAINER_PID__", str(os.getpid()))
problem = CodeProblem("double", stdio=(StdioCase("21\\n", "42"),))
verify = CodeVerifier(timeout_s=spec["timeout_s"], isolation=spec["isolation"], **spec["limits"])
score = verify(code, problem)
results = [dataclasses.asdict(r) for r in verify.last_report.results]
print("RESULT" + json.dumps({"score": score, "results": results}))
"""


def _procs_with(token: bytes) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``token``."""
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{p}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token in cmd and state not in ("Z", "X"):
            found.append(int(p))
    return found


def _gone_within(token: bytes, seconds: float) -> list[int]:
    """The processes still carrying ``token`` once none is left or ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    while True:
        left = _procs_with(token)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.fixture
def world(tmp_path):
    """Secrets and targets outside the sandbox, a TCP listener, and cleanup of anything leaked."""
    marker = "rollkit-hostile-" + uuid.uuid4().hex[:12]
    outside = Path(tempfile.mkdtemp(prefix="rollkit-outside-"))
    outside.chmod(0o777 | stat.S_ISVTX)  # world-writable like /tmp
    secret_dir = Path(tempfile.mkdtemp(prefix="rollkit-secret-"))
    secret_dir.chmod(0o755)
    secret = "SECRET-" + uuid.uuid4().hex
    secret_path = secret_dir / "secret.txt"
    secret_path.write_text(secret)
    secret_path.chmod(0o644)  # world-readable, like the project's own files
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    targets = [Path(d) / f"{marker}-written" for d in ("/tmp", "/dev/shm", outside, ROOT)]
    w = {
        "marker": marker,
        "outside": outside,
        "secret": secret,
        "secret_path": secret_path,
        "env_secret": "ENVSECRET-" + uuid.uuid4().hex,
        "listener": listener,
        "targets": targets,
    }
    yield w
    listener.close()
    for pid in _procs_with(marker.encode()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for t in targets:
        t.unlink(missing_ok=True)
    for d in (outside, secret_dir):
        subprocess.run(["rm", "-rf", str(d)], check=False)


def _substitute(code: str, w: dict) -> str:
    subs = {
        "__MARKER__": w["marker"],
        "__SECRET_PATH__": str(w["secret_path"]),
        "__PROJECT_FILE__": str(SANDBOX_PY),
        "__OUTSIDE__": str(w["outside"]),
        "__PROJECT__": str(ROOT),
        "__PORT__": str(w["listener"].getsockname()[1]),
    }
    for k, v in subs.items():
        code = code.replace(k, v)
    return code


def _contained(name: str, isolation: str, w: dict) -> None:
    code = _substitute(HOSTILE[name], w)
    # the non-root fallback refuses to run beside the environment secret (test_fallback_env_*
    # below); here every other threat is measured, so that refusal is waived
    limits = {**LIMITS, "allow_env_secrets": isolation == "rlimit"}
    timeout_s = TIMEOUT_S if name in ENDLESS else SELF_ENDING_TIMEOUT_S
    spec = {"code": code, "timeout_s": timeout_s, "isolation": isolation, "limits": limits}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ROLLKIT_TEST_SECRET": w["env_secret"]}
    drv = subprocess.run(
        [sys.executable, "-c", DRIVER, str(ROOT), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=600,  # a hang's bound: the driver imports torch, slowly on a loaded machine
        env=env,
        start_new_session=True,  # the driver is the trainer: its own group, so nothing else is at risk
    )
    # 1. the trainer survived and reported a score of 0
    assert drv.returncode == 0, f"trainer died (rc {drv.returncode}): {drv.stderr[-2000:]}"
    line = [ln for ln in drv.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, drv.stdout[-2000:] + drv.stderr[-2000:]
    res = json.loads(line[-1][len("RESULT") :])
    assert res["score"] == 0.0
    runs = res["results"]
    assert runs and all(r["isolation_used"] == isolation for r in runs)
    output = "".join(r["stdout"] + r["stderr"] for r in runs)
    # 2. output capped, wall time bounded: each run ended at its deadline (ENDLESS) or by itself,
    #    never held by what it left behind (the daemon sleeps 600 s holding the output pipes); the
    #    bound leaves a loaded machine time to start and sweep the run
    assert all(len(r["stdout"]) + len(r["stderr"]) <= LIMITS["max_output_bytes"] for r in runs)
    assert all(r["wall_s"] < TIMEOUT_S + 60 for r in runs), [r["wall_s"] for r in runs]
    # 3. nothing read from outside
    project_line = SANDBOX_PY.read_text().splitlines()[0]
    for leak in (w["secret"], w["env_secret"], project_line, "root:x:0:0"):
        assert leak not in output, f"leaked {leak[:30]!r} to the program"
    # 4. nothing written outside
    written = [str(t) for t in w["targets"] if t.exists()]
    assert not written, f"wrote outside the work dir: {written}"
    # 5. no process left over (the run's id is in its processes' command lines; the daemon
    #    re-executes itself with the marker)
    for token in [r["run_id"] for r in runs] + [w["marker"]]:
        left = _gone_within(token.encode(), 120.0)
        assert not left, f"processes left over with {token}: {left}"
    # 6. no network
    try:
        conn, _ = w["listener"].accept()
        conn.close()
        raise AssertionError("the program connected to a TCP listener outside the sandbox")
    except BlockingIOError:
        pass
    # 7. limits not raised
    for ln in output.splitlines():
        if ln.startswith("LIMITS"):
            lim = json.loads(ln[len("LIMITS") :])
            assert not lim.pop("setuid0")
            for rname, (raised, soft, hard) in lim.items():
                assert not raised and hard != -1 and soft <= hard, (rname, raised, soft, hard)
            assert lim["RLIMIT_AS"][2] == LIMITS["memory_mb"] << 20
            assert lim["RLIMIT_FSIZE"][2] == LIMITS["max_file_mb"] << 20
            assert lim["RLIMIT_NOFILE"][2] == LIMITS["max_open_files"]
    if name == "raise_limits":
        assert "LIMITS" in output, output[-1000:]
    if name == "huge_output":
        assert runs[0]["status"] == "output_limit"
    if name in ("infinite_loop", "sleep_past_timeout"):
        assert runs[0]["status"] in ("timeout", "killed")
    if name not in ENDLESS:  # it ran to its own end (so it did try its attack)
        assert all(r["status"] != "timeout" for r in runs), [r["status"] for r in runs]


def _bwrap_or_skip() -> None:
    ok, why = bwrap_status()
    if not ok:
        pytest.skip(f"bubblewrap cannot run here: {why}")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_contained_by_bwrap(name, world):
    _bwrap_or_skip()
    _contained(name, "bwrap", world)


GAPS = fallback_gaps()
FALLBACK_CASES = [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=f"rlimit fallback: {GAPS[n]}"))
    if n in GAPS
    else n
    for n in sorted(HOSTILE)
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", FALLBACK_CASES)
def test_contained_by_rlimit_fallback(name, world):
    _contained(name, "rlimit", world)


def test_gaps_name_real_threats():
    """Every gap the fallback declares is a program of this suite (so it is xfailed, not ignored)."""
    assert set(fallback_gaps(as_root=True)) <= set(HOSTILE)
    assert set(fallback_gaps(as_root=False)) <= set(HOSTILE)
    assert {"read_outside", "write_outside", "network"} <= set(fallback_gaps(as_root=True))


# ------------------------------------------------------------------ the trainer's environment

# A trainer that needs nothing but the standard library: it loads the sandbox module from its
# file, so it also runs under the system python as an unprivileged uid (the non-root fallback).
ENV_DRIVER = """\
import importlib.util, json, os, sys, warnings
warnings.simplefilter("ignore")
spec = importlib.util.spec_from_file_location("rollkit_sandbox", sys.argv[1])
sbx = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sbx
spec.loader.exec_module(sbx)
mode = sys.argv[2]
if mode == "popped":  # gone from os.environ, still in /proc/<pid>/environ
    os.environ.pop("ROLLKIT_LEAK_SECRET")
try:
    r = sbx.run_python(sys.argv[3], isolation="rlimit", timeout_s=120, allow_env_secrets=mode == "allowed")
    print("RAN" + json.dumps({"pid": os.getpid(), "status": r.status, "stdout": r.stdout}))
except RuntimeError as e:
    print("REFUSED " + str(e))
"""


def _env_trainer(mode: str, *, as_nobody: bool) -> tuple[str, str]:
    """Run ENV_WALK in the rlimit fallback from a trainer whose environment holds a marker
    secret; ``as_nobody``: the trainer runs as uid 65534 under the system python (the non-root
    fallback, reachable here when the tests run as root). Returns (trainer stdout, marker)."""
    marker = "LEAKMARK-" + uuid.uuid4().hex
    python, ids = sys.executable, {}
    if as_nobody:
        python = "/usr/bin/python3"
        if not os.access(python, os.X_OK):
            pytest.skip("no system /usr/bin/python3 to run an unprivileged trainer")
        ids = {"user": 65534, "group": 65534, "extra_groups": []}
    env = {"PATH": "/usr/bin:/bin", "ROLLKIT_LEAK_SECRET": marker}
    drv = subprocess.run(
        [python, "-I", "-c", ENV_DRIVER, str(SANDBOX_PY), mode, ENV_WALK],
        capture_output=True,
        text=True,
        timeout=600,  # a hang's bound
        env=env,
        cwd="/tmp",
        start_new_session=True,
        **ids,
    )
    assert drv.returncode == 0, drv.stderr[-2000:]
    return drv.stdout, marker


@pytest.mark.skipif(os.geteuid() != 0, reason="the fresh-uid fallback needs root")
def test_root_fallback_env_walk_finds_no_trainer_secret():
    """As root every run gets a fresh uid: the program reads neither its parent's (the
    trainer's) nor any ancestor's /proc/<pid>/environ, so the trainer's secret stays hidden."""
    out, marker = _env_trainer("plain", as_nobody=False)
    assert out.startswith("RAN"), out
    res = json.loads(out[len("RAN") :])
    assert res["status"] == "ok" and marker not in res["stdout"]
    # the walk did reach the trainer, and was denied there
    assert f"environ {res['pid']} denied" in res["stdout"], res["stdout"][-2000:]


def test_non_root_fallback_refuses_beside_a_secret():
    """Run as a non-root user, the fallback's program shares the trainer's uid and could read
    /proc/<ppid>/environ: it is not started while the environment holds a secret-like name,
    also one already removed from os.environ (still in the start-up environment)."""
    as_nobody = os.geteuid() == 0
    for mode, where in (("plain", "os.environ"), ("popped", "/proc/")):
        out, marker = _env_trainer(mode, as_nobody=as_nobody)
        assert out.startswith("REFUSED "), out
        assert "'ROLLKIT_LEAK_SECRET'" in out and where in out and "allow_env_secrets=True" in out
        assert marker not in out and len(out.strip().splitlines()) == 1


def test_non_root_fallback_env_gap_is_real():
    """With ``allow_env_secrets=True`` the non-root fallback does leak the trainer's environment
    through /proc/<ppid>/environ: the gap that fallback_gaps(as_root=False) declares."""
    out, marker = _env_trainer("allowed", as_nobody=os.geteuid() == 0)
    assert out.startswith("RAN"), out
    res = json.loads(out[len("RAN") :])
    assert marker in res["stdout"] and f"environ {res['pid']} " in res["stdout"]
    assert "env_leak" in fallback_gaps(as_root=False) and "env_leak" not in fallback_gaps(as_root=True)

"""trainers.rewards.sandbox.run_python: statuses, limits, output caps, isolation layers, bad input.

Every behaviour test runs for the rlimit fallback and for bubblewrap (skipped, with the reason,
where bwrap cannot run). The hostile-program suite is tests/trainers/test_sandbox_security.py.
"""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest

from trainers.rewards import sandbox
from trainers.rewards.sandbox import (
    RUN_OPTIONS,
    bwrap_status,
    check_environment,
    check_options,
    fallback_gaps,
    is_secret_name,
    run_python,
    sandbox_python,
    secret_env_names,
)

pytestmark = pytest.mark.filterwarnings("ignore:trainers.rewards.sandbox:RuntimeWarning")


def _bwrap_param():
    ok, why = bwrap_status()
    return pytest.param(
        "bwrap", marks=pytest.mark.skipif(not ok, reason=f"bubblewrap cannot run here: {why}")
    )


ISOLATIONS = ["rlimit", _bwrap_param()]


@pytest.fixture(params=ISOLATIONS)
def iso(request):
    return request.param


def test_ok_with_stdin(iso):
    r = run_python(
        "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="1 2\n3", isolation=iso
    )
    assert (r.status, r.returncode, r.stdout, r.isolation_used) == ("ok", 0, "6\n", iso)
    assert r.ok and r.wall_s > 0 and r.run_id.startswith("rollkit-sbx-")


def test_error_exit_and_traceback(iso):
    r = run_python("def f():\n    return 1 / 0\nf()", isolation=iso)
    assert r.status == "error" and r.returncode == 1
    assert "ZeroDivisionError" in r.stderr and 'File "solution.py", line 2' in r.stderr
    assert run_python("raise SystemExit(7)", isolation=iso).returncode == 7


def test_wall_timeout_kills(iso):
    r = run_python("import time\ntime.sleep(600)", timeout_s=0.3, isolation=iso)
    # killed at its deadline: long before the program's own end (a loaded machine only adds the
    # start and the cleanup, seconds at most)
    assert r.status == "timeout" and r.wall_s < 120
    assert any("timeout" in n for n in r.notes)


def test_cpu_limit_sigxcpu(iso):
    # 1 s of CPU ends it long before the wall-clock limit, however little CPU a loaded machine
    # gives it
    r = run_python("while True:\n    pass", timeout_s=300, cpu_s=1, isolation=iso)
    assert r.status == "killed"
    assert any("SIGXCPU" in n for n in r.notes), r.notes


@pytest.mark.parametrize("late", [False, True])
def test_a_cpu_limit_death_past_the_deadline_is_the_timeout(iso, monkeypatch, late):
    """A busy loop reaches RLIMIT_CPU (soft = ceil(timeout_s)) only after its wall-clock limit, so
    it dies of the CPU limit only when this process was late to kill it (a loaded machine): that
    run overran its wall-clock budget and is reported as the timeout. Simulated: the program ends
    itself with SIGXCPU at once, and the wait for it returns past the deadline (``late``)."""
    real = sandbox._communicate

    def slow(proc, data, deadline, cap):
        out = real(proc, data, deadline, cap)
        while late and time.perf_counter() < deadline + 0.05:
            time.sleep(0.05)
        return out

    monkeypatch.setattr(sandbox, "_communicate", slow)
    code = "import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)"
    r = run_python(code, timeout_s=1.0, isolation=iso)
    if late:
        assert r.status == "timeout" and any("wall-clock timeout after 1 s" in n for n in r.notes), r.notes
    else:
        assert r.status == "killed" and any("SIGXCPU" in n for n in r.notes), r.notes


def test_memory_limit(iso):
    r = run_python("x = bytearray(400 * 2**20)\nprint('allocated')", memory_mb=128, isolation=iso)
    assert r.status == "error" and "MemoryError" in r.stderr and "allocated" not in r.stdout
    assert run_python("x = bytearray(20 * 2**20)\nprint('ok')", memory_mb=128, isolation=iso).stdout == "ok\n"


def test_file_size_limit(iso):
    # CPython ignores SIGXFSZ, so the write fails with EFBIG instead of killing the program
    r = run_python("open('f', 'wb').write(b'0' * (3 * 2**20))", max_file_mb=1, isolation=iso)
    assert r.status == "error" and "File too large" in r.stderr, r
    assert run_python("open('f', 'wb').write(b'0' * 2**19)", max_file_mb=1, isolation=iso).ok


def test_open_files_limit(iso):
    code = "fs = []\ntry:\n    while True:\n        fs.append(open('/dev/null'))\nexcept OSError:\n    print(len(fs))"
    r = run_python(code, max_open_files=20, isolation=iso)
    assert r.status == "ok" and 0 < int(r.stdout) < 20


def test_process_limit(iso):
    code = (
        "import os, time\nn = 0\ntry:\n    for _ in range(50):\n        if os.fork() == 0:\n"
        "            time.sleep(5)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)"
    )
    r = run_python(code, max_procs=6, timeout_s=60, isolation=iso)  # it exits at once: never reached
    # exact with bwrap (a per-namespace count) or a per-run uid (root); the non-root fallback shares
    # the trainer's uid, so its bound is relative to that uid's other tasks, which come and go
    exact = iso == "bwrap" or os.geteuid() == 0
    assert r.status == "ok" and int(r.stdout) < (6 if exact else 16), r


def test_output_cap(iso):
    r = run_python("while True:\n    print('x' * 999)", max_output_bytes=10_000, isolation=iso)
    assert r.status == "output_limit" and r.truncated
    assert len(r.stdout) + len(r.stderr) <= 10_000
    small = run_python("print('y' * 5000)", max_output_bytes=10_000, isolation=iso)
    assert small.status == "ok" and len(small.stdout) == 5001 and not small.truncated


def test_large_stdin_and_binary_output(iso):
    r = run_python("import sys\nprint(len(sys.stdin.read()))", stdin="z" * 300_000, isolation=iso)
    assert r.stdout == "300000\n"
    r = run_python("import sys\nsys.stdout.buffer.write(b'ok\\xff\\n')\nprint('\u00e9')", isolation=iso)
    assert r.stdout == "ok\ufffd\n\u00e9\n"


def test_environment_is_clean(iso, monkeypatch):
    monkeypatch.setenv("ROLLKIT_LEAK_CHECK", "must-not-leak")
    r = run_python("import os\nprint(sorted(os.environ))", isolation=iso)
    assert "ROLLKIT_LEAK_CHECK" not in r.stdout and "PATH" in r.stdout


def test_concurrent_runs_from_threads(iso):
    out = {}

    def go(i):  # six sandboxes start at once: a generous deadline for a loaded machine
        out[i] = run_python(f"print({i} * 2)", timeout_s=60, isolation=iso)

    ts = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert {i: r.stdout for i, r in out.items()} == {i: f"{i * 2}\n" for i in range(6)}


def test_bwrap_view_of_the_system():
    ok, why = bwrap_status()
    if not ok:
        pytest.skip(f"bubblewrap cannot run here: {why}")
    code = (
        "import os, socket\n"
        "print(os.getcwd(), socket.gethostname(), os.path.exists('/etc/passwd'), os.path.exists('/work'))\n"
        "print(sorted(os.listdir('/proc'))[:0], len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
        "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    print('net')\n"
        "except OSError:\n    print('nonet')\n"
        "open('/tmp/t', 'w').write('x')\nopen('w', 'w').write('x')\n"
        "try:\n    open('/usr/x', 'w')\nexcept OSError:\n    print('ro')\n"
    )
    r = run_python(code, isolation="bwrap")
    lines = r.stdout.split("\n")
    assert lines[0] == f"{sandbox.WORKDIR} sandbox False False", r
    assert int(lines[1].split()[-1]) <= 3  # only bwrap's init and the program in its PID namespace
    assert lines[2:4] == ["nonet", "ro"]
    assert r.isolation_used == "bwrap" and r.notes == ()


def test_fallback_notes_and_warning(monkeypatch):
    monkeypatch.setattr(sandbox, "_WARNED", False)
    with pytest.warns(RuntimeWarning, match="CANNOT enforce"):
        r = run_python("print(1)", isolation="rlimit")
    assert r.isolation_used == "rlimit"
    for threat in fallback_gaps():
        assert any(threat in n for n in r.notes), (threat, r.notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_python("print(1)", isolation="rlimit")  # warned once per process only


def test_auto_without_bwrap_falls_back(monkeypatch):
    monkeypatch.setattr(sandbox, "_BWRAP_STATE", (False, "pretend: not installed"))
    assert run_python("print(1)").isolation_used == "rlimit"
    with pytest.raises(RuntimeError, match="pretend: not installed"):
        run_python("print(1)", isolation="bwrap")


def test_auto_prefers_bwrap():
    ok, _ = bwrap_status()
    assert run_python("print(1)").isolation_used == ("bwrap" if ok else "rlimit")


def test_runs_as_fresh_uid_when_root(iso):
    r = run_python("import os\nprint(os.getuid())", isolation=iso)
    uid = int(r.stdout)
    if os.geteuid() == 0:
        assert sandbox.UID_RANGE[0] <= uid < sandbox.UID_RANGE[1]
    else:
        assert uid == os.getuid()


def test_sandbox_python_is_executable():
    p = sandbox_python()
    assert os.path.isabs(p) and os.access(p, os.X_OK) and os.path.realpath(p) == p


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"timeout_s": 0}, ValueError, "timeout_s"),
        ({"timeout_s": float("inf")}, ValueError, "timeout_s"),
        ({"memory_mb": -1}, ValueError, "memory_mb"),
        ({"max_procs": "8"}, TypeError, "max_procs"),
        ({"max_output_bytes": True}, TypeError, "max_output_bytes"),
        ({"isolation": "docker"}, ValueError, "isolation"),
        ({"stdin": b"x"}, TypeError, "stdin"),
    ],
)
def test_bad_arguments(kwargs, err, match):
    with pytest.raises(err, match=match):
        run_python("print(1)", **kwargs)
    with pytest.raises(TypeError, match="code"):
        run_python(b"print(1)")  # type: ignore[arg-type]


# ------------------------------------------------------------------ options and the environment check


SECRET_NAMES = """WANDB_API_KEY HF_TOKEN HUGGING_FACE_HUB_TOKEN OPENAI_API_KEY AWS_SECRET_ACCESS_KEY
AWS_SESSION_TOKEN AWS_ACCESS_KEY_ID GITHUB_TOKEN DB_PASSWORD PGPASSWORD my-secret MYAPIKEY GH_AUTHTOKEN
GOOGLE_APPLICATION_CREDENTIALS SMTP_PASS SSH_PRIVATE_KEY""".split()
PLAIN_NAMES = """PATH HOME PWD OLDPWD TOKENIZERS_PARALLELISM AWS_CA_BUNDLE AWS_REGION HF_HOME WANDB_PROJECT
SSH_AUTH_SOCK CUDA_VISIBLE_DEVICES KEYBOARD_LAYOUT PYTHONHASHSEED""".split()


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_names(name):
    assert is_secret_name(name) and is_secret_name(name.lower())


@pytest.mark.parametrize("name", PLAIN_NAMES)
def test_not_secret_names(name):
    assert not is_secret_name(name)


def test_secret_env_names_sees_os_environ(monkeypatch):
    monkeypatch.setenv("ROLLKIT_TEST_API_KEY", "x")
    monkeypatch.setenv("ROLLKIT_TEST_PLAIN", "x")
    found = dict(secret_env_names())
    assert found.get("ROLLKIT_TEST_API_KEY") == "os.environ" and "ROLLKIT_TEST_PLAIN" not in found
    assert all(w == "os.environ" or w.startswith("/proc/") for w in found.values())


def test_check_environment(monkeypatch):
    monkeypatch.setenv("ROLLKIT_TEST_API_KEY", "x")
    if os.geteuid() == 0:  # a fresh uid per run: nothing to refuse
        check_environment("rlimit")
    else:
        with pytest.raises(RuntimeError, match="refusing the rlimit fallback"):
            check_environment("rlimit")
    check_environment("rlimit", allow_env_secrets=True)
    with pytest.raises(ValueError, match="isolation must be one of"):
        check_environment("docker")
    with pytest.raises(TypeError, match="allow_env_secrets must be a bool"):
        check_environment("rlimit", allow_env_secrets="yes")


def test_check_options():
    check_options(memory_mb=256, isolation="rlimit", allow_env_secrets=True, python=None)
    assert set(RUN_OPTIONS) < set(run_python.__kwdefaults__)
    with pytest.raises(TypeError, match=r"sandbox options: unknown \['memroy_mb', 'stdin'\]"):
        check_options(memroy_mb=256, stdin="x")
    with pytest.raises(ValueError, match="max_procs must be a positive finite number"):
        check_options(max_procs=0)
    with pytest.raises(ValueError, match="isolation must be one of"):
        check_options(isolation="docker")
    with pytest.raises(TypeError, match="allow_env_secrets must be a bool"):
        check_options(allow_env_secrets=1)
    with pytest.raises(TypeError, match=r"python must be a path \(str\) or None"):
        check_options(python=3)

"""Run untrusted Python (generated code) in a sandbox: bubblewrap namespaces + rlimits, or rlimits alone.

:func:`run_python` runs one program with a wall-clock timeout, resource limits (``RLIMIT_CPU``,
``RLIMIT_AS``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, no core dumps; set inside
the sandbox with soft = hard, no ``preexec_fn``) and capped output, and returns a
:class:`RunResult`. Two isolation layers: ``"bwrap"`` (bubblewrap: new user, PID, network,
mount, IPC, UTS and cgroup namespaces, read-only system directories, a size-capped tmpfs work
directory, an empty environment, every capability dropped) and the ``"rlimit"`` fallback where
bubblewrap cannot run (a new session, a temp directory, an empty environment and the same
rlimits), whose gaps :func:`fallback_gaps` lists; run as a non-root user it also refuses to
start while the trainer's environment holds secrets (:func:`secret_env_names`). As root, every
run gets a fresh unprivileged uid. Threat model, layers, measurements: ``docs/sandbox.md``.

>>> r = run_python("print(sum(map(int, input().split())))", stdin="2 3", timeout_s=5)
>>> r.status, r.stdout
('ok', '5\\n')
>>> run_python("while True: pass", timeout_s=0.5).status
'timeout'
"""

from __future__ import annotations

import errno
import inspect
import math
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = [
    "ISOLATIONS",
    "RUN_OPTIONS",
    "SECRET_PARTS",
    "SECRET_WORDS",
    "RunResult",
    "bwrap_status",
    "check_environment",
    "check_options",
    "fallback_gaps",
    "is_secret_name",
    "run_python",
    "sandbox_python",
    "secret_env_names",
]

ISOLATIONS = ("auto", "bwrap", "rlimit")
STATUSES = ("ok", "error", "timeout", "killed", "output_limit")
#: where a sandbox sees its work directory (bwrap); the fallback uses a host temp directory
WORKDIR = "/sandbox"
#: fresh per-run uids used when the trainer runs as root
UID_RANGE = (2_000_000, 3_000_000)

# Runs inside the sandbox: set the limits (soft = hard, so they cannot be raised), then run the
# program as __main__ from solution.py. argv: run id, cpu s, address space bytes, processes,
# file bytes, open files, "count" (add the uid's existing tasks to the process limit).
_BOOT = """\
import resource as R, sys
_, _run, cpu, mem, nproc, fsize, nofile, count = sys.argv
nproc = int(nproc)
if count == "1":
    import os
    me = str(os.getuid())
    for p in os.listdir("/proc"):
        try:
            with open("/proc/" + p + "/status") as f:
                st = f.read()
        except OSError:
            continue
        uid = [ln.split()[1] for ln in st.splitlines() if ln.startswith("Uid:")]
        thr = [int(ln.split()[1]) for ln in st.splitlines() if ln.startswith("Threads:")]
        if uid and uid[0] == me and thr:
            nproc += thr[0]
R.setrlimit(R.RLIMIT_CPU, (int(cpu), int(cpu) + 1))  # SIGXCPU, then SIGKILL 1 s later
for r, v in ((R.RLIMIT_AS, int(mem)), (R.RLIMIT_NPROC, nproc),
             (R.RLIMIT_FSIZE, int(fsize)), (R.RLIMIT_NOFILE, int(nofile)), (R.RLIMIT_CORE, 0)):
    R.setrlimit(r, (v, v))
sys.argv = ["solution.py"]
with open("solution.py", encoding="utf-8") as f:
    src = f.read()
del R, f, r, v, _, _run, cpu, mem, nproc, fsize, nofile, count
exec(compile(src, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class RunResult:
    """The outcome of one sandboxed run.

    ``status``: ``"ok"`` (exit 0), ``"error"`` (non-zero exit), ``"timeout"`` (wall clock
    exceeded, killed), ``"killed"`` (died of a signal: CPU limit, file size limit, ...; the
    signal is in ``notes``) or ``"output_limit"`` (printed more than ``max_output_bytes``,
    killed). ``stdout``/``stderr`` are decoded UTF-8 (invalid bytes replaced), capped.
    ``isolation_used`` is ``"bwrap"`` or ``"rlimit"``; ``notes`` lists what happened and, for
    the fallback, what it could not enforce. ``run_id`` appears in the command line of the
    sandbox's processes (to find leftovers).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation_used: str
    notes: tuple[str, ...] = ()
    run_id: str = ""
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---------------------------------------------------------------------------------------------
# interpreter and bubblewrap discovery


def _readable_by(path: str, uid: int, gid: int) -> bool:
    """Whether ``uid``/``gid`` (no supplementary groups) can traverse to and read+execute ``path``."""
    p = Path(path)
    parts = [*reversed(p.parents), p]
    for i, part in enumerate(parts):
        try:
            st = os.stat(part)
        except OSError:
            return False
        need = (stat.S_IROTH | stat.S_IXOTH) if i == len(parts) - 1 else stat.S_IXOTH
        if st.st_uid == uid:
            need <<= 6
        elif st.st_gid == gid:
            need <<= 3
        if st.st_mode & need != need:
            return False
    return True


def sandbox_python(uid: int | None = None) -> str:
    """The real path of the interpreter that sandboxed programs run with.

    ``sys.executable`` resolved through symlinks (a venv's python points into its base
    installation) when the sandbox uid can reach it, else the system ``/usr/bin/python3``. The
    program runs with ``-I -S`` (isolated mode, no site-packages): the standard library only.
    """
    uid = _sandbox_uid_hint() if uid is None else uid
    cands = [os.path.realpath(sys.executable), os.path.realpath("/usr/bin/python3")]
    for c in cands:
        if os.path.isfile(c) and (uid < 0 or _readable_by(c, uid, uid)):
            return c
    raise RuntimeError(
        f"no Python interpreter that the sandbox uid {uid} can execute (tried {cands}); "
        "install the system python3 or make the interpreter world-readable"
    )


def _sandbox_uid_hint() -> int:
    return UID_RANGE[0] if os.geteuid() == 0 else -1


def _prefix_of(python: str) -> str | None:
    """The directory to mount for ``python`` (None when it lives under /usr)."""
    if python.startswith("/usr/"):
        return None
    return str(Path(python).parents[1])  # <prefix>/bin/python3.x -> <prefix>


def _bwrap_args(python: str, work_mb: int) -> list[str]:
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    args += ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    prefix = _prefix_of(python)
    if prefix is not None:
        args += ["--ro-bind", prefix, prefix]
    size = str(work_mb * 1024 * 1024)
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", WORKDIR, "--chdir", WORKDIR]
    args += ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORKDIR, "--setenv", "LANG", "C.UTF-8"]
    args += ["--hostname", "sandbox"]
    return args


_BWRAP_LOCK = threading.Lock()
_BWRAP_STATE: tuple[bool, str] | None = None
_TLS = threading.local()


def bwrap_status(*, refresh: bool = False) -> tuple[bool, str]:
    """``(available, reason)``: whether bubblewrap can run a sandbox here (probed once and cached)."""
    global _BWRAP_STATE
    with _BWRAP_LOCK:  # held during the probe: concurrent callers wait for its answer
        if _BWRAP_STATE is not None and not refresh:
            return _BWRAP_STATE
        exe = shutil.which("bwrap")
        if exe is None:
            _BWRAP_STATE = (False, "bwrap not found on PATH (Debian/Ubuntu: apt-get install bubblewrap)")
            return _BWRAP_STATE
        _TLS.probing = True
        try:
            r = run_python("print(6 * 7)", timeout_s=20, isolation="bwrap")
            ok = r.status == "ok" and r.stdout.strip() == "42"
            why = exe if ok else f"bwrap probe failed ({r.status}): {r.stderr.strip()[-300:]}"
        except Exception as e:  # any failure means "not available", with the reason
            ok, why = False, f"bwrap probe failed: {type(e).__name__}: {e}"
        finally:
            _TLS.probing = False
        _BWRAP_STATE = (ok, why)
        return _BWRAP_STATE


def fallback_gaps(*, as_root: bool | None = None) -> dict[str, str]:
    """What the ``"rlimit"`` fallback cannot enforce: ``{threat: why}``.

    Keys are the threat names of the security suite (``tests/trainers/test_sandbox_security.py``).
    ``as_root`` defaults to whether this process runs as root (then each run gets a fresh uid,
    which closes some gaps).
    """
    root = os.geteuid() == 0 if as_root is None else as_root
    gaps = {
        "read_outside": "no mount namespace: the program reads every world-readable file "
        "(the project's sources, /etc, other users' readable data)",
        "write_outside": "no mount namespace: the program writes to world-writable directories "
        "(/tmp, /dev/shm)",
        "network": "no network namespace: the program can open sockets and connect anywhere",
    }
    if not root:
        gaps["write_outside"] += " and, running as the trainer's own uid, to all of its files"
        gaps["kill_parent"] = "same uid as the trainer: the program can signal (kill) the trainer"
        gaps["daemon"] = (
            "same uid as the trainer: a program that calls setsid() and clears its environment "
            "leaves the process group and survives the run"
        )
        gaps["env_leak"] = (
            "same uid as the trainer: the program reads /proc/<pid>/environ of the trainer, its "
            "ancestors and every other process of that uid; runs are refused while the "
            "environment holds a secret-like name (secret_env_names) unless allow_env_secrets=True"
        )
    return gaps


# ---------------------------------------------------------------------------------------------
# secrets in the environment (the non-root fallback)

#: words of an environment variable's name (split at ``_``, ``-``, ``.``) that mark it a secret
SECRET_WORDS = frozenset(
    {"KEY", "KEYS", "APIKEY", "TOKEN", "TOKENS", "SECRET", "SECRETS", "PASS", "PASSWORD", "PASSWORDS"}
    | {"PASSWD", "CREDENTIAL", "CREDENTIALS", "PASSPHRASE", "COOKIE", "SESSION"}
)
#: substrings of a name that mark it a secret wherever they occur
SECRET_PARTS = ("SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "APIKEY", "PRIVATE_KEY", "ACCESS_KEY")


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name suggests a secret value: one of its words (split
    at ``_``, ``-``, ``.``) is in :data:`SECRET_WORDS` or ends in ``TOKEN``, or the name contains
    one of :data:`SECRET_PARTS` (case-insensitive). Paths and settings that merely mention a
    service (``AWS_CA_BUNDLE``, ``TOKENIZERS_PARALLELISM``) are not secrets.

    >>> [is_secret_name(n) for n in ("WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "GH_AUTHTOKEN")]
    [True, True, True, True]
    >>> [is_secret_name(n) for n in ("TOKENIZERS_PARALLELISM", "AWS_CA_BUNDLE", "HF_HOME", "PWD")]
    [False, False, False, False]
    """
    up = name.upper()
    if any(part in up for part in SECRET_PARTS):
        return True
    words = [w for w in up.replace("-", "_").replace(".", "_").split("_") if w]
    return any(w in SECRET_WORDS or w.endswith("TOKEN") for w in words)


def _environ_names(pid: int | str) -> list[str] | None:
    """The variable names in ``/proc/<pid>/environ`` (its start-up environment); None if unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [e.split(b"=", 1)[0].decode("utf-8", "replace") for e in raw.split(b"\0") if b"=" in e]


def _parent_of(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def secret_env_names() -> list[tuple[str, str]]:
    """``[(name, where)]``: the secret-like variables (:func:`is_secret_name`) that a program
    running as this process's uid could read: this process's ``os.environ``, its start-up
    environment (``/proc/self/environ``: a name deleted from ``os.environ`` is still there) and
    that of each ancestor whose ``/proc/<pid>/environ`` this uid can read. ``where`` is
    ``"os.environ"`` or ``"/proc/<pid>/environ"``."""
    found: list[tuple[str, str]] = [(n, "os.environ") for n in os.environ if is_secret_name(n)]
    seen = {n for n, _ in found}
    pid = os.getpid()
    for _ in range(64):  # the ancestors, up to init
        names = _environ_names(pid)
        for n in names or ():
            if n not in seen and is_secret_name(n):
                seen.add(n)
                found.append((n, f"/proc/{pid}/environ"))
        pid = _parent_of(pid)
        if pid <= 1:
            break
    return found


def check_environment(isolation: str = "auto", *, allow_env_secrets: bool = False) -> None:
    """Raise ``RuntimeError`` (one line, naming the variable) if a run with ``isolation`` would
    expose a secret of the trainer's environment: the ``"rlimit"`` fallback run as a non-root
    user (the program shares the trainer's uid and reads ``/proc/<pid>/environ``; see
    :func:`fallback_gaps`) while :func:`secret_env_names` finds one. A no-op with bubblewrap, as
    root (each run gets a fresh uid, which cannot read the trainer's environment) or with
    ``allow_env_secrets=True``. :func:`run_python` calls it before every run;
    :class:`~trainers.rewards.code.CodeVerifier` when it is built, so a trainer fails at start."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if not isinstance(allow_env_secrets, bool):
        raise TypeError(f"allow_env_secrets must be a bool, got {type(allow_env_secrets).__name__}")
    if allow_env_secrets or os.geteuid() == 0 or _resolve_isolation(isolation) != "rlimit":
        return
    found = secret_env_names()
    if found:
        name, where = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise RuntimeError(
            f"trainers.rewards.sandbox: refusing the rlimit fallback (no bubblewrap, not root): the "
            f"program would share the trainer's uid and could read the secret-like variable {name!r} "
            f"from {where}{more}; unset it, install bubblewrap, run as root, or pass allow_env_secrets=True"
        )


# ---------------------------------------------------------------------------------------------
# running


_WARNED = False


def _warn_fallback(gaps: dict[str, str]) -> None:
    global _WARNED
    if _WARNED:
        return
    _WARNED = True
    msg = (
        "trainers.rewards.sandbox: bubblewrap is not used; the rlimit fallback CANNOT enforce:\n"
        + "\n".join(f"  - {k}: {v}" for k, v in gaps.items())
    )
    warnings.warn(msg, RuntimeWarning, stacklevel=4)
    print("WARNING: " + msg, file=sys.stderr)


def _check_limits(**kw: float) -> None:
    for name, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(v).__name__}")
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a positive finite number, got {v!r}")


def _pids_where(pred) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            if pred(int(p)):
                out.append(int(p))
        except OSError:
            continue
    return out


def _live_uid(pid: int) -> int:
    """The real uid of ``pid``; -1 for a zombie (already dead, only waiting to be reaped)."""
    with open(f"/proc/{pid}/status") as f:
        st = f.read()
    uid = -1
    for ln in st.splitlines():
        if ln.startswith("State:") and ln.split()[1] in ("Z", "X"):
            return -1
        if ln.startswith("Uid:"):
            uid = int(ln.split()[1])
    return uid


def _cmdline_has(pid: int, token: bytes) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return token in f.read()


def _kill_all(pids_fn, rounds: int = 200) -> int:
    """SIGKILL every pid ``pids_fn()`` returns, until it returns none (a fork bomb refills)."""
    killed = 0
    for _ in range(rounds):
        pids = [p for p in pids_fn() if p != os.getpid()]
        if not pids:
            return killed
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.002)
    return killed


def _cleanup(proc: subprocess.Popen, uid: int | None, run_id: str) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if uid is not None:  # a fresh uid: every live process of it belongs to this run
        _kill_all(lambda: _pids_where(lambda p: _live_uid(p) == uid))
    else:  # best effort: processes that still carry the run id in their command line
        me = os.getuid()
        tok = run_id.encode()
        _kill_all(lambda: _pids_where(lambda p: _live_uid(p) == me and _cmdline_has(p, tok)))


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


@dataclass(frozen=True)
class _Limits:
    """The validated limits of one run (:func:`run_python`'s arguments)."""

    timeout_s: float
    cpu_s: float
    memory_mb: int
    max_procs: int
    max_file_mb: int
    max_open_files: int
    max_output_bytes: int
    work_mb: int

    def boot_args(self, run_id: str, count_uid_tasks: bool) -> list[str]:
        """The bootstrap's argv (:data:`_BOOT`)."""
        return [
            run_id,
            str(math.ceil(self.cpu_s)),
            str(int(self.memory_mb) * 1024 * 1024),
            str(int(self.max_procs)),
            str(int(self.max_file_mb) * 1024 * 1024),
            str(int(self.max_open_files)),
            "1" if count_uid_tasks else "0",
        ]


def _validated(code: str, stdin: str, isolation: str, limits: dict[str, float | None]) -> _Limits:
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(stdin, str):
        raise TypeError(f"stdin must be a str, got {type(stdin).__name__}")
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    _check_limits(timeout_s=limits["timeout_s"])
    if limits["cpu_s"] is None:
        limits = {**limits, "cpu_s": math.ceil(limits["timeout_s"])}
    _check_limits(**{k: v for k, v in limits.items() if k != "timeout_s"})
    return _Limits(**limits)


#: the keyword options of :func:`run_python` that a caller may fix in advance (all but the
#: program and its stdin), e.g. :class:`~trainers.rewards.code.CodeVerifier`'s ``**sandbox``
RUN_OPTIONS = (
    "timeout_s",
    "cpu_s",
    "memory_mb",
    "max_procs",
    "max_file_mb",
    "max_open_files",
    "max_output_bytes",
    "work_mb",
    "isolation",
    "python",
    "allow_env_secrets",
)


def check_options(**options: Any) -> None:
    """Check :func:`run_python` options (:data:`RUN_OPTIONS`) without running anything: a
    one-line ``TypeError`` naming an unknown option, else the error ``run_python`` would raise
    for a bad value.

    >>> check_options(memory_mb=256, isolation="rlimit")
    >>> check_options(memroy_mb=256)
    Traceback (most recent call last):
    ...
    TypeError: sandbox options: unknown ['memroy_mb']; known: timeout_s, cpu_s, memory_mb, ...
    """
    unknown = sorted(set(options) - set(RUN_OPTIONS))
    if unknown:
        raise TypeError(f"sandbox options: unknown {unknown}; known: {', '.join(RUN_OPTIONS)}")
    params = inspect.signature(run_python).parameters
    args = {k: params[k].default for k in RUN_OPTIONS} | options
    _validated("", "", args["isolation"], {f.name: args[f.name] for f in fields(_Limits)})
    if args["python"] is not None and not isinstance(args["python"], str):
        raise TypeError(f"python must be a path (str) or None, got {type(args['python']).__name__}")
    if not isinstance(args["allow_env_secrets"], bool):
        raise TypeError(f"allow_env_secrets must be a bool, got {type(args['allow_env_secrets']).__name__}")


def _resolve_isolation(isolation: str) -> str:
    """``"bwrap"`` or ``"rlimit"``: what a run with ``isolation`` uses here."""
    if isolation == "rlimit":
        return "rlimit"
    if getattr(_TLS, "probing", False):  # bwrap_status's own probe run
        return "bwrap"
    ok, why = bwrap_status()
    if not ok and isolation == "bwrap":
        raise RuntimeError(f"isolation='bwrap' but bubblewrap cannot run here: {why}")
    return "bwrap" if ok else "rlimit"


def _fallback_notes(as_root: bool) -> list[str]:
    gaps = fallback_gaps(as_root=as_root)
    _warn_fallback(gaps)
    notes = [f"not enforced: {k}: {v}" for k, v in gaps.items()]
    notes.append("not enforced: memory is per process (RLIMIT_AS), disk only per file (RLIMIT_FSIZE)")
    if not as_root:
        notes.append(
            "approximate: max_procs is added to the tasks the trainer's uid has at the start "
            "(RLIMIT_NPROC counts per uid), so other processes of that uid shift the bound"
        )
    return notes


def _spawn(
    code: str, use: str, lim: _Limits, python: str, uid: int | None, run_id: str
) -> tuple[subprocess.Popen, str | None]:
    """Start the sandboxed program; returns the process and the host temp directory to remove
    afterwards (fallback only)."""
    argv_py = [python, "-I", "-S", "-c", _BOOT, *lim.boot_args(run_id, use == "rlimit" and uid is None)]
    ids = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    if use == "bwrap":
        memfd = os.memfd_create("solution.py", 0)
        try:
            with open(memfd, "wb", closefd=False) as f:
                f.write(code.encode())
            os.lseek(memfd, 0, os.SEEK_SET)
            argv = [shutil.which("bwrap") or "bwrap", *_bwrap_args(python, int(lim.work_mb))]
            argv += ["--file", str(memfd), f"{WORKDIR}/solution.py", *argv_py]
            env = {"PATH": "/usr/bin:/bin"}
            proc = subprocess.Popen(
                argv, cwd="/", env=env, pass_fds=(memfd,), start_new_session=True, **pipes, **ids
            )
        finally:
            os.close(memfd)
        return proc, None
    tmp = tempfile.mkdtemp(prefix="rollkit-sbx-")
    try:
        Path(tmp, "solution.py").write_text(code, encoding="utf-8")
        if uid is not None:
            os.chown(tmp, uid, uid)
            os.chown(Path(tmp, "solution.py"), uid, uid)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8", "ROLLKIT_SANDBOX": run_id}
        proc = subprocess.Popen(argv_py, cwd=tmp, env=env, start_new_session=True, **pipes, **ids)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return proc, tmp


def _signal_of(rc: int | None, use: str) -> int | None:
    """The signal that ended the program (bwrap reports one as ``128 + signal``), or None."""
    if use == "bwrap" and rc is not None and rc > 128 and rc - 128 in _SIGNALS:
        return rc - 128
    return -rc if rc is not None and rc < 0 else None


def _cpu_limit_death(rc: int | None, use: str) -> bool:
    """Whether the program ended by ``RLIMIT_CPU``'s signals (``SIGXCPU``, then ``SIGKILL``)."""
    return _signal_of(rc, use) in (signal.SIGXCPU, signal.SIGKILL)


def _status(rc: int | None, why: str, use: str, lim: _Limits) -> tuple[str, list[str]]:
    """``(status, notes)`` of a finished run (:class:`RunResult`)."""
    if why == "timeout":
        return "timeout", [f"wall-clock timeout after {lim.timeout_s:g} s: killed"]
    if why == "output_limit":
        return "output_limit", [f"output over {lim.max_output_bytes} bytes: killed"]
    sig = _signal_of(rc, use)
    if sig is not None:
        return "killed", [f"killed by {_signame(sig)}{_SIGNALS.get(sig, '')}"]
    return ("ok" if rc == 0 else "error"), []


def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 10.0,
    cpu_s: float | None = None,
    memory_mb: int = 512,
    max_procs: int = 16,
    max_file_mb: int = 16,
    max_open_files: int = 64,
    max_output_bytes: int = 1 << 20,
    work_mb: int = 64,
    isolation: str = "auto",
    python: str | None = None,
    allow_env_secrets: bool = False,
) -> RunResult:
    """Run the Python program ``code`` (fed ``stdin``) in a sandbox; see the module docstring.

    Args:
        timeout_s: wall-clock limit; the run (process group, PID namespace) is killed after it.
        cpu_s: ``RLIMIT_CPU`` seconds (default ``ceil(timeout_s)``), per process.
        memory_mb: ``RLIMIT_AS`` (address space) per process, MiB.
        max_procs: ``RLIMIT_NPROC``: processes + threads of the sandbox (bubblewrap's init and
            the interpreter included).
        max_file_mb: ``RLIMIT_FSIZE``: the largest file the program may write, MiB.
        max_open_files: ``RLIMIT_NOFILE``.
        max_output_bytes: stdout + stderr bytes kept; more kills the run (``"output_limit"``).
        work_mb: size of the writable tmpfs work directory and ``/tmp`` (bwrap only).
        isolation: ``"auto"`` (bwrap when it works here, else the fallback with a warning),
            ``"bwrap"`` (raise ``RuntimeError`` if unavailable) or ``"rlimit"``.
        python: interpreter to run (default :func:`sandbox_python`), always with ``-I -S``.
        allow_env_secrets: run the non-root fallback even though the trainer's environment
            holds secret-like variables, which the program can read (:func:`check_environment`
            raises ``RuntimeError`` otherwise).
    """
    lim = _validated(
        code,
        stdin,
        isolation,
        dict(
            timeout_s=timeout_s,
            cpu_s=cpu_s,
            memory_mb=memory_mb,
            max_procs=max_procs,
            max_file_mb=max_file_mb,
            max_open_files=max_open_files,
            max_output_bytes=max_output_bytes,
            work_mb=work_mb,
        ),
    )
    use = _resolve_isolation(isolation)
    as_root = os.geteuid() == 0
    if use == "rlimit":
        check_environment("rlimit", allow_env_secrets=allow_env_secrets)
    uid = random.randrange(*UID_RANGE) if as_root else None
    python = python or sandbox_python(-1 if uid is None else uid)
    run_id = "rollkit-sbx-" + uuid.uuid4().hex[:16]
    notes = _fallback_notes(as_root) if use == "rlimit" else []
    t0 = time.perf_counter()
    proc, tmp = _spawn(code, use, lim, python, uid, run_id)
    try:
        try:
            out, err, why = _communicate(proc, stdin.encode(), t0 + lim.timeout_s, int(lim.max_output_bytes))
            if why == "exit" and time.perf_counter() - t0 >= lim.timeout_s and _cpu_limit_death(proc.returncode, use):
                # past the wall-clock limit, the CPU limit ended it first (this process was late to
                # kill it, e.g. on a loaded machine): a single-threaded program cannot spend more CPU
                # than wall time, so it overran its wall-clock budget -- report the timeout it is
                why = "timeout"
        finally:
            _cleanup(proc, uid, run_id)
        wall = time.perf_counter() - t0
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    status, more = _status(proc.returncode, why, use, lim)
    return RunResult(
        status=status,
        returncode=proc.returncode,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        wall_s=wall,
        isolation_used=use,
        notes=tuple(notes + more),
        run_id=run_id,
        truncated=why == "output_limit",
    )


_SIGNALS = {
    signal.SIGKILL: " (RLIMIT_CPU hard limit, or killed)",
    signal.SIGXCPU: " (RLIMIT_CPU)",
    signal.SIGXFSZ: " (RLIMIT_FSIZE)",
    signal.SIGSEGV: "",
    signal.SIGABRT: "",
    signal.SIGBUS: "",
    signal.SIGTERM: "",
    signal.SIGPIPE: "",
}


def _communicate(proc: subprocess.Popen, data: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, str]:
    """Feed stdin, read stdout/stderr up to ``cap`` bytes together, until exit or ``deadline``.

    Returns ``(stdout, stderr, why)`` with ``why`` in ``"exit"``, ``"timeout"``, ``"output_limit"``.
    Never buffers more than ``cap`` bytes (+ one read). Once the main process has exited, pipes
    still held open by a leftover child are drained briefly and then abandoned.
    """
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    total = 0
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    stdin_fd = proc.stdin.fileno()
    if data:
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    view, pos = memoryview(data), 0
    exited_at = None
    why = "exit"
    try:
        while sel.get_map():
            now = time.perf_counter()
            if now >= deadline:
                why = "timeout"
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.05:
                break  # the main process is gone; a leftover holds the pipe
            wait = deadline - now if exited_at is None else 0.01
            for key, _ in sel.select(timeout=min(wait, 0.05)):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        pos += os.write(fd, view[pos : pos + 65536])
                    except (BrokenPipeError, OSError) as e:
                        if not isinstance(e, BrokenPipeError) and e.errno != errno.EPIPE:
                            raise
                        pos = len(data)
                    if pos >= len(data):
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                room = cap - total
                bufs[fd] += chunk[: max(room, 0)]
                total += len(chunk)
                if total > cap:
                    why = "output_limit"
                    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), why
        if why == "exit":
            remaining = deadline - time.perf_counter()
            try:
                proc.wait(timeout=max(remaining, 0.0))
            except subprocess.TimeoutExpired:
                why = "timeout"
        return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), why
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass

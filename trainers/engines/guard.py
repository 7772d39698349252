"""A process guard: run a command and stop its whole process group when the parent that started
the guard dies, however it dies (``SIGKILL`` included) and whichever thread started it.

    python trainers/engines/guard.py PARENT_PID -- COMMAND [ARGS...]
    python trainers/engines/guard.py PARENT_PID --watch PID,PID,... GRACE_S   (see watch())

(run as a file, so that it imports nothing but the standard library: not the ``trainers``
package, whose import pulls torch)

The guard leads a process group of its own (``start_new_session=True``, or it makes one), in
which the command runs. Every ``poll_s`` seconds it checks the command and its parent: when the command
exits, the guard exits with its code (a signal ``s`` as ``128 + s``); when ``PARENT_PID`` is no
longer its parent (the trainer died and the guard was re-parented), it sends ``SIGTERM`` to the
group, then ``SIGKILL`` after ``grace_s`` seconds. A ``SIGTERM`` or ``SIGINT`` sent to the guard
alone is passed on to the command if the command has not exited a second later (a signal sent to
the group, as :meth:`~trainers.engines.vllm_server.LocalServer.stop` sends it, reaches the command
directly and is not sent twice).

Linux's ``PR_SET_PDEATHSIG`` cannot do this for a process started from a worker thread: the
signal fires when the *thread* that forked ends, not the process (so rollkit's replacement servers,
started on a background thread, outlived a trainer that died). The guard is what
:func:`trainers.engines.vllm_server.start_server` runs each ``vllm serve`` under.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["child_pids", "guarded", "main", "watch"]

POLL_S = 0.5
GRACE_S = 10.0


def guarded(command: list[str], parent_pid: int | None = None) -> list[str]:
    """``command`` run under the guard of ``parent_pid`` (default: this process)."""
    pid = os.getpid() if parent_pid is None else int(parent_pid)
    return [sys.executable, os.path.abspath(__file__), str(pid), "--", *command]


def child_pids(pid: int | None = None) -> set[int]:
    """The live children of ``pid`` (default: this process), from every thread (Linux ``/proc``;
    elsewhere none)."""
    pid = os.getpid() if pid is None else pid
    out: set[int] = set()
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in threads:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out.update(int(x) for x in f.read().split())
        except OSError:
            continue
    return out


def watch(pids: set[int] | list[int], grace_s: float = GRACE_S) -> subprocess.Popen | None:
    """Start a watcher that stops ``pids`` and their descendants when this process dies, for the
    processes a library started that the guard could not wrap (vLLM's engine core, spawned by
    ``vllm.LLM``). It exits by itself once every one of them has ended. ``None`` for no pids."""
    pids = sorted(int(p) for p in pids)
    if not pids:
        return None
    cmd = [sys.executable, os.path.abspath(__file__), str(os.getpid()), "--watch", ",".join(map(str, pids))]
    return subprocess.Popen(
        [*cmd, str(grace_s)], start_new_session=True, stdin=subprocess.DEVNULL, close_fds=True
    )


def _tree(roots: list[int]) -> list[int]:
    """``roots`` that are alive and all their live descendants."""
    out, todo = [], [p for p in roots if _alive(p)]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(c for c in child_pids(p) if c not in out)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _watch_main(parent: int, pids: list[int], poll_s: float, grace_s: float) -> int:
    while any(_alive(p) for p in pids):
        if os.getppid() != parent:
            victims = _tree(pids)
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
                for p in victims:
                    with _suppress():
                        os.kill(p, sig)
                end = time.monotonic() + wait
                while (victims := [p for p in victims if _alive(p)]) and time.monotonic() < end:
                    time.sleep(0.1)
            return 1
        time.sleep(poll_s)
    return 0


def _stop_group(grace_s: float, child: subprocess.Popen) -> None:
    with _suppress():
        os.killpg(os.getpgrp(), signal.SIGTERM)  # the guard ignores it (below), the group stops
    end = time.monotonic() + grace_s
    while child.poll() is None and time.monotonic() < end:
        time.sleep(0.1)
    with _suppress():
        os.killpg(os.getpgrp(), signal.SIGKILL)  # kills the guard too


def _others() -> list[int]:
    """The other live processes of the guard's process group (Linux ``/proc``; elsewhere none)."""
    group, me, out = os.getpgrp(), os.getpid(), []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] != "Z":  # state, ppid, pgrp
            out.append(int(name))
    return out


def _stop_others(grace_s: float) -> None:
    """SIGTERM the rest of the group, then SIGKILL what is left after ``grace_s`` seconds."""
    if not _others():
        return
    with _suppress():
        os.killpg(os.getpgrp(), signal.SIGTERM)  # the guard only notes it
    end = time.monotonic() + grace_s
    while (left := _others()) and time.monotonic() < end:
        time.sleep(0.1)
    for pid in left:
        with _suppress():
            os.kill(pid, signal.SIGKILL)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: object, tb: object) -> bool:
        return isinstance(exc, (ProcessLookupError, PermissionError))


def main(argv: list[str] | None = None, *, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 4 and args[0].isdigit() and args[1] == "--watch":
        return _watch_main(int(args[0]), [int(p) for p in args[2].split(",")], poll_s, float(args[3]))
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        print("usage: python guard.py PARENT_PID -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent = int(args[0])
    if os.getppid() != parent:  # the parent died before the guard started
        return 1
    if os.getpgrp() != os.getpid():  # started without a group of its own: never signal the caller's
        os.setpgid(0, 0)
    received: list[tuple[int, float]] = []

    def note(signum: int, frame: object) -> None:
        received.append((signum, time.monotonic()))

    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)
    child = subprocess.Popen(args[2:])
    forwarded = False
    while True:
        code = child.poll()
        if code is not None:  # what the command left in the group (a killed server's engine) goes too
            _stop_others(grace_s)
            return code if code >= 0 else 128 - code
        if received and not forwarded and time.monotonic() - received[0][1] > 1.0:
            forwarded = True
            with _suppress():
                child.send_signal(received[0][0])
        if os.getppid() != parent:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            _stop_group(grace_s, child)
            return 1
        time.sleep(poll_s)


if __name__ == "__main__":
    sys.exit(main())

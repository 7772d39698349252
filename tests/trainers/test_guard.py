"""The process guard (trainers.engines.guard): a command started under it, from the main thread or
from a worker thread, is stopped when the process that started it dies, SIGKILL included; the
guard exits with the command's code; a SIGTERM to the group stops both."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from trainers.engines.guard import guarded, main

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups and /proc: Linux")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


#: the cap of every wait below: it only bounds a hang (a loaded machine may be slow, never this slow)
CAP_S = 120.0


def wait_until(cond, cap=CAP_S, poll=0.05):
    """Poll ``cond()`` until it is truthy (its value is returned) or ``cap`` seconds passed (its
    last value is returned)."""
    end = time.monotonic() + cap
    while not (value := cond()) and time.monotonic() < end:
        time.sleep(poll)
    return value


def wait_gone(pids, cap=CAP_S):
    """The pids of ``pids`` still alive once all are gone or ``cap`` seconds passed."""
    wait_until(lambda: not any(alive(p) for p in pids), cap)
    return [p for p in pids if alive(p)]


def switches(pid: int) -> int:
    """The voluntary context switches of ``pid`` so far (-1 once it is gone): the guard's loop
    blocks once per poll, in its sleep."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(next(ln.split()[1] for ln in f if ln.startswith("voluntary_ctxt_switches")))
    except FileNotFoundError:
        return -1


def wait_polls(pid: int, n: int = 3) -> None:
    """Wait until the guard ``pid`` has blocked ``n`` more times (once more than it can block
    before its loop: so it has run at least ``n - 2`` whole checks of its parent from now, however
    slowly the machine runs it), or has died."""
    start = switches(pid)
    wait_until(lambda: not alive(pid) or switches(pid) >= start + n)


STARTER = textwrap.dedent(
    """
    import subprocess, sys, threading, time
    from trainers.engines.guard import guarded

    def start():
        p = subprocess.Popen(guarded(["sleep", "300"]), start_new_session=True)
        print(p.pid, flush=True)

    if sys.argv[1] == "thread":  # as rollkit starts a replacement server
        t = threading.Thread(target=start)
        t.start()
        t.join()  # the starting thread has ended: PR_SET_PDEATHSIG would fire now
    else:
        start()
    print("started", flush=True)
    time.sleep(300)
    """
)


@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_killed_parent_takes_the_guarded_command_with_it(where):
    parent = subprocess.Popen(
        [sys.executable, "-c", STARTER, where], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )  # fmt: skip
    guard = int(parent.stdout.readline())
    kids = wait_until(lambda: _children(guard))
    assert kids, "the guard started no command"
    # once the starting thread has ended (PR_SET_PDEATHSIG would fire then: the parent's second
    # line) and the guard has checked its parent again, both are alive while the parent lives
    assert parent.stdout.readline() == "started\n"
    wait_polls(guard)
    assert all(alive(p) for p in [guard, *kids])
    parent.kill()
    parent.wait()
    assert wait_gone([guard, *kids]) == []


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def test_the_guard_exits_with_the_commands_code_and_stops_on_sigterm():
    assert subprocess.run(guarded([sys.executable, "-c", "raise SystemExit(3)"]), cwd=ROOT).returncode == 3
    p = subprocess.Popen(guarded(["sleep", "300"]), start_new_session=True, cwd=ROOT)
    # the command runs once the guard has installed its signal handlers (it starts it after)
    kids = wait_until(lambda: _children(p.pid))
    assert kids, "the guard started no command"
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(timeout=CAP_S) == 128 + signal.SIGTERM
    assert wait_gone(kids) == []


def test_bad_arguments_are_refused():
    assert main(["x", "--", "true"]) == 2 and main(["1"]) == 2


def test_what_the_command_leaves_in_the_group_is_stopped_when_it_exits():
    """A server killed alone leaves its engine process behind: the guard stops it, then exits
    with the command's code."""
    p = subprocess.run(
        guarded(["sh", "-c", "sleep 300 & echo $!; exit 3"]), start_new_session=True, cwd=ROOT,
        capture_output=True, text=True, timeout=CAP_S,
    )  # fmt: skip
    assert p.returncode == 3
    assert wait_gone([int(p.stdout.split()[0])]) == []


WATCHER = textwrap.dedent(
    """
    import subprocess, time
    from trainers.engines.guard import child_pids, watch

    before = child_pids()
    kid = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"])  # a child and a grandchild
    end = time.monotonic() + 120
    while not child_pids(kid.pid) and time.monotonic() < end:  # until sh has started the grandchild
        time.sleep(0.05)
    w = watch(child_pids() - before)
    print(kid.pid, w.pid, flush=True)
    time.sleep(300)
    """
)


def test_a_watcher_stops_what_a_library_started_when_the_parent_is_killed():
    """As for vLLM's engine core: processes started without the guard, and their children."""
    parent = subprocess.Popen(
        [sys.executable, "-c", WATCHER], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )  # fmt: skip
    kid, watcher = map(int, parent.stdout.readline().split())
    grandkids = _children(kid)  # started before the line was printed
    assert grandkids and alive(watcher) and alive(kid)
    parent.kill()
    parent.wait()
    assert wait_gone([kid, *grandkids, watcher]) == []


def test_a_watcher_exits_when_what_it_watches_has_ended():
    from trainers.engines.guard import watch

    kid = subprocess.Popen(["sleep", "1"])
    w = watch({kid.pid}, grace_s=1.0)
    kid.wait()
    assert w.wait(timeout=CAP_S) == 0
    assert watch(set()) is None

"""Running an ablation's cells, resumably: as subprocesses or as Ray tasks.

Each cell has its own directory ``<out>/cells/<id>/`` with ``cell.json`` (its overrides), the
command's log (``log.txt``), the trainer's ``metrics.jsonl`` and, once it finished
successfully, ``done.json``. :func:`run_cells` runs the cells that are not done, so an
interrupted ablation continues where it stopped and a crashed cell runs again. See
docs/ablations.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ablations.grid import Cell
from trainers.deps import require

__all__ = ["CELL_TIMEOUT_S", "CellResult", "cell_dir", "is_done", "run_cells"]

#: The default deadline of one cell's command, in seconds (a day).
CELL_TIMEOUT_S = 24 * 3600.0

#: The return code recorded for a cell whose command ran past its deadline (as timeout(1)).
TIMEOUT_RC = 124

_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class CellResult:
    """What happened to a cell in :func:`run_cells`: ``status`` is ``"skipped"`` (already
    done), ``"ran"`` or ``"failed"``."""

    cell: Cell
    status: str
    wall_s: float = 0.0
    returncode: int | None = None
    log: Path | None = None


@dataclass
class _Job:
    """A cell to run: its index in the caller's list, its directory and its command line."""

    index: int
    cell: Cell
    dir: Path
    argv: list[str]


def cell_dir(out: str | Path, cell: Cell) -> Path:
    """The directory of ``cell`` under the ablation's output directory ``out``."""
    return Path(out) / "cells" / cell.id


def is_done(out: str | Path, cell: Cell) -> bool:
    """A cell is done when its ``done.json`` exists and names this cell's id."""
    f = cell_dir(out, cell) / "done.json"
    if not f.is_file():
        return False
    try:
        return json.loads(f.read_text()).get("id") == cell.id
    except (json.JSONDecodeError, OSError):
        return False


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)


def _run_one(
    cell_d: str, argv: list[str], env: dict[str, str], cwd: str | None, timeout_s: float
) -> tuple[int, float]:
    """Run ``argv`` with stdout and stderr to ``<cell_d>/log.txt``; ``(returncode, seconds)``.
    A command still running after ``timeout_s`` seconds is killed and returns ``TIMEOUT_RC``."""
    t0 = time.perf_counter()
    with open(Path(cell_d) / "log.txt", "w") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        try:
            proc = subprocess.run(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout_s
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            log.write(f"\n[ablate] killed after the cell deadline of {timeout_s:.0f} s\n")
            rc = TIMEOUT_RC
    return rc, time.perf_counter() - t0


def _cell_env(env: dict[str, str] | None, cpus_per_cell: int) -> dict[str, str]:
    """The cells' environment: ``env`` (default ``os.environ``) with the repository on
    ``PYTHONPATH``, ``OMP_NUM_THREADS=cpus_per_cell`` and Ray's usage stats off."""
    base = dict(os.environ if env is None else env)
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), base.get("PYTHONPATH", "")) if p)
    base["OMP_NUM_THREADS"] = str(cpus_per_cell)
    base.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return base


def _plan(
    cells: Sequence[Cell], out: Path, command: Sequence[str]
) -> tuple[dict[int, CellResult], list[_Job]]:
    """The results of the cells already done, and the jobs of the others (their directories
    cleared and recreated with a fresh ``cell.json``)."""
    results: dict[int, CellResult] = {}
    todo: list[_Job] = []
    for i, cell in enumerate(cells):
        d = cell_dir(out, cell)
        if is_done(out, cell):
            results[i] = CellResult(cell, "skipped", log=d / "log.txt")
            continue
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        _write_json(d / "cell.json", cell.to_dict())
        todo.append(_Job(i, cell, d, [*command, *cell.overrides(), f"logging.dir={d}"]))
    return results, todo


def _finish(job: _Job, rc: int, wall: float) -> CellResult:
    """Write ``done.json`` when the command exited 0 and left a ``metrics.jsonl``."""
    ok = rc == 0 and (job.dir / "metrics.jsonl").is_file()
    if ok:
        done = {**job.cell.to_dict(), "command": job.argv, "returncode": rc, "wall_s": wall}
        _write_json(job.dir / "done.json", {**done, "finished": time.time()})
    return CellResult(job.cell, "ran" if ok else "failed", wall, rc, job.dir / "log.txt")


def _run_local(
    todo: Sequence[_Job], parallel: int, run: Callable[[_Job], tuple[int, float]]
) -> Iterator[tuple[_Job, int, float]]:
    """Yield ``(job, returncode, seconds)`` as the jobs finish, at most ``parallel`` at once."""
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futs = {pool.submit(run, job): job for job in todo}
        for fut in as_completed(futs):
            yield (futs[fut], *fut.result())


def _run_ray(
    todo: Sequence[_Job], parallel: int, cpus_per_cell: int, args: tuple[Any, ...], env: dict[str, str]
) -> Iterator[tuple[_Job, int, float]]:
    """Yield ``(job, returncode, seconds)`` as Ray tasks of ``num_cpus=cpus_per_cell`` finish,
    at most ``parallel`` at once. Starts a local Ray instance (or connects to ``RAY_ADDRESS``)
    if Ray is not initialised."""
    ray = require("ray")
    if not ray.is_initialized():
        # the cells are the work: run them at this process's priority, not Ray's default worker
        # nice 15 (as trainers.ray.init_ray does; set RAY_worker_niceness to keep Ray's default)
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(
            address=os.environ.get("RAY_ADDRESS") or "local",
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": env["PYTHONPATH"]}},
        )
    remote = ray.remote(num_cpus=cpus_per_cell)(_run_one)
    pending: dict[Any, _Job] = {}
    queue = list(todo)
    while queue or pending:
        while queue and len(pending) < parallel:
            job = queue.pop(0)
            pending[remote.remote(str(job.dir), job.argv, *args)] = job
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            yield (pending.pop(ref), *ray.get(ref))


def run_cells(
    cells: Sequence[Cell],
    out: str | Path,
    command: Sequence[str],
    *,
    parallel: int = 1,
    use_ray: bool = False,
    cpus_per_cell: int = 1,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = CELL_TIMEOUT_S,
    log: Callable[[str], None] = print,
) -> list[CellResult]:
    """Run every cell that is not done: ``[*command, *cell.overrides(), logging.dir=<cell dir>]``.

    A cell whose ``done.json`` exists is skipped; any other cell directory is cleared and the
    cell runs again (so a crashed or interrupted cell restarts from scratch). At most
    ``parallel`` cells run at once: as subprocesses from a thread pool, or with
    ``use_ray=True`` as Ray tasks of ``num_cpus=cpus_per_cell`` (each runs the same
    subprocess in a Ray worker). If Ray is not initialised it starts a local Ray instance, or
    connects to the cluster at ``RAY_ADDRESS`` when that is set (its nodes must see the same
    paths: a shared filesystem). Each subprocess gets ``OMP_NUM_THREADS=cpus_per_cell``; one
    still running after ``timeout_s`` seconds is killed and its cell fails. ``done.json`` is
    written when the command exits 0 and left a ``metrics.jsonl``. Returns one
    :class:`CellResult` per cell, in order.
    """
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    if cpus_per_cell < 1:
        raise ValueError(f"cpus_per_cell must be >= 1, got {cpus_per_cell}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if not command:
        raise ValueError("command: empty")
    out = Path(out).resolve()
    cell_env = _cell_env(env, cpus_per_cell)
    args = (cell_env, str(cwd) if cwd is not None else None, float(timeout_s))
    results, todo = _plan(cells, out, command)
    log(f"[ablate] {len(cells)} cells: {len(cells) - len(todo)} done already, {len(todo)} to run")
    if not todo:
        finished: Iterable[tuple[_Job, int, float]] = ()
    elif use_ray:
        finished = _run_ray(todo, parallel, cpus_per_cell, args, cell_env)
    else:
        finished = _run_local(todo, parallel, lambda job: _run_one(str(job.dir), job.argv, *args))
    for n, (job, rc, wall) in enumerate(finished, 1):
        res = results[job.index] = _finish(job, rc, wall)
        ok = res.status == "ran"
        log(
            f"[ablate] {n}/{len(todo)} {job.cell.id}: "
            + (f"done in {wall:.1f}s" if ok else f"FAILED (exit {rc}), see {res.log}")
        )
    return [results[i] for i in range(len(cells))]

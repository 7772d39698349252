"""Parts every loop shares: a step timer, prompt encoding, checkpoint files and the fit driver.

:func:`run_fit` is the outer loop of the RL trainers (evaluate, ``train.steps`` x ``step()``,
evaluate every ``eval.every`` steps, checkpoint every ``checkpoint.every``, evaluate, plot): the
sync, async, distillation and agentic loops hand it themselves (anything with the :class:`Loop`
methods).
"""

from __future__ import annotations

import importlib
import importlib.util
import random
import resource
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch

from trainers.config import config_to_dict, save_config
from trainers.data import Prompt, encode_prompt
from trainers.tracking import Tracker

__all__ = [
    "Codec",
    "Loop",
    "Timer",
    "latest_checkpoint",
    "loop_state",
    "read_checkpoint",
    "restore_loop_state",
    "rotate_checkpoints",
    "run_fit",
    "write_checkpoint",
]


class Timer:
    """Wall-clock seconds per named phase of a step (``with timer("rollout"): ...``; ``timer.t``)."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.t[name] += time.perf_counter() - t0

    def metrics(self, t_start: float) -> dict[str, float]:
        """``time/<phase>`` for every phase and ``time/step`` since ``t_start``."""
        out = {f"time/{k}": v for k, v in self.t.items()}
        out["time/step"] = time.perf_counter() - t_start
        return out


class Codec:
    """Prompt text <-> token ids for one tokenizer (encodings cached per prompt object)."""

    def __init__(self, tokenizer: Any, chat_template: str = "auto") -> None:
        self.tok, self.chat_template = tokenizer, chat_template
        self._ids: dict[int, list[int]] = {}
        self.pad_id: int = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )

    def encode(self, p: Prompt) -> list[int]:
        key = id(p)
        if key not in self._ids:
            self._ids[key] = encode_prompt(self.tok, p, self.chat_template)
        return self._ids[key]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


# --------------------------------------------------------------------------- checkpoints


def memory_metrics() -> dict[str, float]:
    """``memory/peak_rss_mib``: this process's peak resident memory so far (``ru_maxrss``; the
    in-process roles, not Ray actors or reward workers), and on CUDA
    ``memory/cuda_peak_allocated_mib`` (``torch.cuda.max_memory_allocated``)."""
    out = {"memory/peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["memory/cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def write_checkpoint(
    state: dict[str, Any], root: str | Path, step: int, *, keep: int = 0, resume: str | Path = ""
) -> Path:
    """Write ``state`` to ``<root>/step_<step>/trainer.pt`` atomically; returns the step directory.
    ``keep > 0`` (``checkpoint.keep``): then delete the oldest checkpoints beyond ``keep``
    (:func:`rotate_checkpoints`, sparing this one and ``resume``)."""
    root = Path(root)
    if not str(root):
        raise ValueError("checkpoint.dir: empty")
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "trainer.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(path / "trainer.pt")
    if keep:
        rotate_checkpoints(root, keep, protect=[path, resume])
    return path


def rotate_checkpoints(root: str | Path, keep: int, *, protect: list[str | Path] = ()) -> list[Path]:
    """Delete the oldest ``step_<k>`` checkpoint directories under ``root`` (by step number) so
    that ``keep`` remain, never one in ``protect`` (the checkpoint just written, the one
    ``checkpoint.resume`` names; ``"auto"`` names the newest, always kept); returns the deleted
    ones. Only directories named ``step_<digits>`` are touched."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"checkpoint.keep must be an int >= 0, got {keep!r}")
    found = sorted(
        (int(d.name[5:]), d) for d in Path(root).glob("step_*") if d.is_dir() and d.name[5:].isdigit()
    )
    spared = {Path(p).resolve() for p in protect if p and str(p) != "auto"}
    deleted = []
    for _, d in found[: max(len(found) - keep, 0)]:
        if d.resolve() not in spared and not any(s.is_relative_to(d.resolve()) for s in spared):
            shutil.rmtree(d)
            deleted.append(d)
    return deleted


def latest_checkpoint(root: str | Path) -> Path:
    """The newest ``step_<k>`` directory under ``root`` (``checkpoint.resume=auto``)."""
    found = sorted(Path(root).glob("step_*/trainer.pt"))
    if not found:
        raise ValueError(f"checkpoint.resume=auto: no checkpoint under {str(root)!r}")
    return found[-1].parent


def read_checkpoint(path: str | Path, root: str | Path) -> dict[str, Any]:
    """The state saved at ``path`` (a ``step_<k>`` directory or its ``trainer.pt``; ``"auto"``:
    the latest under ``root``)."""
    path = Path(path)
    if str(path) == "auto":
        path = latest_checkpoint(root)
    f = path / "trainer.pt" if path.is_dir() else path
    if not f.is_file():
        raise ValueError(f"checkpoint.resume: no trainer.pt at {path}")
    return torch.load(f, weights_only=False)


def loop_state(loop: Any) -> dict[str, Any]:
    """The state of an RLVR loop: step, learner (weights, optimizer, scheduler), reference weights,
    prompt order, reward normaliser, length-budget draws and the global RNGs."""
    ref = getattr(loop.roles.reference, "model", None)
    return {
        "global_step": loop.global_step,
        "train": loop.learner.state_dict(),
        "reference": None if ref is None else ref.state_dict(),
        "data": loop.iterator.state_dict(),
        "update": loop.update.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "lengths": loop.maker.state_dict(),
        "critic": None if loop.roles.critic is None else loop.roles.critic.state_dict(),
    }


def restore_loop_state(loop: Any, state: dict[str, Any]) -> None:
    """Undo :func:`loop_state` (the rollout's weights are the caller's to push)."""
    loop.learner.load_state_dict(state["train"])
    if loop.roles.critic is not None:
        if state.get("critic") is None:
            raise ValueError(
                "checkpoint.resume: the checkpoint has no critic (it was written by a run without one)"
            )
        loop.roles.critic.load_state_dict(state["critic"])
    ref = getattr(loop.roles.reference, "model", None)
    if ref is not None and state.get("reference") is not None:
        ref.load_state_dict(state["reference"])
    loop.iterator.load_state_dict(state["data"])
    loop.update.load_state_dict(state["update"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    loop.maker.load_state_dict(state["lengths"])
    loop.global_step = int(state["global_step"])


# --------------------------------------------------------------------------- the fit driver


class Loop(Protocol):
    """What :func:`run_fit` drives."""

    cfg: Any
    global_step: int

    def step(self) -> dict[str, float]: ...

    def evaluate(self) -> dict[str, float]: ...

    def save_checkpoint(self) -> Path: ...

    def save_model(self, path: str | Path) -> Path: ...

    def load_checkpoint(self, path: str | Path) -> None: ...


def _progress(k: int, total: int, m: dict[str, float]) -> str:
    ev = f" eval {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""
    return (
        f"[step {k:>4}/{total}] reward {m['reward/mean']:.3f} len {m['response/length_mean']:.1f} "
        f"kept {m['rollout/kept_groups']} {m['time/step']:.1f}s "
        f"({m.get('time/rollout', 0):.1f} gen, {m.get('time/train', 0):.1f} train){ev}"
    )


def make_tracker(cfg: Any, *, resume_step: int | None = None, plot: bool | None = None) -> Tracker:
    """The run's :class:`~trainers.tracking.Tracker` from ``cfg.logging`` (JSONL, TensorBoard
    with the config as text, W&B / SwanLab when asked), with the resolved config written to
    ``<logging.dir>/config.yaml``."""
    lg = cfg.logging
    tracker = Tracker(
        lg.dir,
        tensorboard=lg.tensorboard,
        plot=lg.plot if plot is None else plot,
        resume_step=resume_step,
        wandb=lg.wandb,
        swanlab=lg.swanlab,
        project=lg.project,
        run_name=lg.run_name or None,
        config=config_to_dict(cfg),
        online=lg.online,
    )
    path = save_config(cfg, tracker.dir / "config.yaml")
    if tracker.tb is not None:  # the hyper-parameters beside the curves
        tracker.tb.add_text("config", "```yaml\n" + path.read_text() + "\n```", 0)
    return tracker


class _Bar:
    """A tqdm progress bar on stderr (count, rate, elapsed and remaining time), or plain
    lines when tqdm is missing."""

    def __init__(self, total: int, initial: int, desc: str, unit: str) -> None:
        tqdm = importlib.util.find_spec("tqdm") and importlib.import_module("tqdm").tqdm
        self.bar = (
            tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)
            if tqdm
            else None
        )

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def progress_bar(total: int, initial: int = 0, desc: str = "train", unit: str = "step") -> _Bar:
    """A progress bar with a time estimate (tqdm when installed; it comes with transformers)."""
    return _Bar(total, initial, desc, unit)


def _save_models(loop: Loop, directory: Path) -> Path:
    """The policy as ``directory/model`` (and a learned critic as ``directory/critic``); returns
    the policy's directory."""
    path = loop.save_model(directory / "model")
    critic = getattr(getattr(loop, "roles", None), "critic", None)
    if critic is not None:
        critic.save_model(directory / "critic", getattr(loop, "tok", None))
    return path


def _train_to_host(loop: Any) -> None:
    """Move the train state back to the host after a checkpoint or a resume read it
    (``placement.offload_train``; the engines onload themselves for such reads)."""
    roles = getattr(loop, "roles", None)
    if roles is not None:
        roles.offload_train()


def _curves(tracker: Tracker, plot: Callable[..., Path | None] | None, want: bool) -> Path | None:
    """``curves.png``: the loop's ``plot(history, path)`` when it has one (and ``logging.plot``),
    else the tracker's own."""
    if plot is None:
        return tracker.plot()
    return plot(tracker.history, tracker.dir / "curves.png") if want else None


#: the RLVR loops' headline metric: (summary key prefix, metric, label of the printed line)
ACCURACY = ("accuracy", "eval/accuracy", "held-out accuracy")


def run_fit(
    loop: Loop,
    steps: int | None = None,
    *,
    line: Callable[..., str] = _progress,
    headline: tuple[str, str, str] = ACCURACY,
    prepare: Callable[[bool], None] | None = None,
    finish: Callable[[], None] | None = None,
    plot: Callable[[list[dict[str, Any]], Path], Path | None] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """The fit loop of every RL trainer: resume (``checkpoint.resume``), evaluate, train up to
    ``steps`` (default ``train.steps``; counted from the start of the run, so a resumed run
    trains what is left), evaluating every ``eval.every`` and checkpointing every
    ``checkpoint.every`` steps, evaluate; returns a summary.

    Args:
        line: ``line(step, total, metrics)``, the progress line printed per step (``logging.progress``).
        headline: ``(word, metric, label)``: the evaluation metric quoted as ``<word>_before`` /
            ``<word>_after`` in the summary and printed after the first evaluation.
        prepare: ``prepare(resumed)``, run after the resume and before the first evaluation (the
            agentic warm-up and environment workers).
        finish: run after the last step, before the final evaluation (a background collection drained).
        plot: ``plot(history, path)`` draws ``curves.png`` (default: the tracker's plot).
        on_step: ``on_step(step, metrics)`` after each step is logged.
    """
    cfg = loop.cfg
    resume_step = None
    if cfg.checkpoint.resume:
        loop.load_checkpoint(cfg.checkpoint.resume)
        resume_step = loop.global_step
        _train_to_host(loop)
    total = cfg.train.steps if steps is None else steps
    lg = cfg.logging
    word, key, label = headline
    tracker = make_tracker(cfg, resume_step=resume_step, plot=False if plot is not None else None)
    for note in tracker.notes:
        print(f"[rollkit] {note}")
    if prepare is not None:
        prepare(resume_step is not None)
    before = None
    if cfg.eval.before and loop.global_step == 0:
        before = loop.evaluate()
        tracker.log(0, before)
        print(f"[eval] step 0 {label} {before.get(key, float('nan')):.3f}", flush=True)
    t0, start = time.perf_counter(), loop.global_step
    bar = progress_bar(total, loop.global_step, "train") if lg.progress else None
    while loop.global_step < total:
        m = loop.step()
        k = loop.global_step
        if cfg.eval.every and k % cfg.eval.every == 0 and k < total:
            m.update(loop.evaluate())
        tracker.log(k, m)
        if on_step is not None:
            on_step(k, m)
        if bar is not None:
            bar.update(1)
            bar.write(line(k, total, m))
        if cfg.checkpoint.dir and cfg.checkpoint.every and k % cfg.checkpoint.every == 0:
            step_dir = loop.save_checkpoint()
            if lg.save_model:
                _save_models(loop, step_dir)
            _train_to_host(loop)  # the checkpoint read the train state (placement.offload_train)
    train_time = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if finish is not None:
        finish()
    after = loop.evaluate()
    tracker.log(loop.global_step, after)
    curves = _curves(tracker, plot, lg.plot)
    tracker.close()
    if cfg.checkpoint.dir:
        loop.save_checkpoint()
    model_dir = _save_models(loop, tracker.dir) if lg.save_model else None
    _train_to_host(loop)
    steps_run = loop.global_step - start
    tb = tracker.dir / "tb"
    return {
        f"{word}_before": None if before is None else before.get(key),
        f"{word}_after": after.get(key),
        "eval_before": before,  # every held-out metric (per source, per domain, pass@k)
        "eval_after": after,
        "steps": steps_run,
        "train_seconds": train_time,
        "seconds_per_step": train_time / max(steps_run, 1),
        "metrics_file": str(tracker.jsonl),
        "tensorboard_dir": None if tracker.tb is None and not tb.exists() else str(tb),
        "plot": None if curves is None else str(curves),
        "model_dir": None if model_dir is None else str(model_dir),
        "config_file": str(tracker.dir / "config.yaml"),
        "notes": tracker.notes,
        "history": tracker.history,
    }

"""Metrics sinks of the trainers: a JSONL file always, TensorBoard and a PNG plot when installed.

:class:`Tracker` writes one JSON object per logged step to ``<dir>/metrics.jsonl`` (``{"step":
k, "reward/mean": ..., ...}``). With the ``tensorboard`` package installed it also writes
TensorBoard events (``torch.utils.tensorboard``) to ``<dir>/tb``; with ``matplotlib``
installed, :meth:`Tracker.plot` draws reward and held-out accuracy per step to
``<dir>/curves.png``. A missing optional package is reported once in :attr:`Tracker.notes`,
never an error.

Experiment trackers, used only when asked for (``wandb=True`` / ``swanlab=True``) and installed:
Weights & Biases (``wandb``) and SwanLab (``swanlab``). Both run **offline** unless
``online=True``: W&B with ``mode="offline"`` (the run lands in ``<dir>/wandb/offline-run-*``;
upload it later with ``wandb sync <that dir>``), SwanLab with ``mode="offline"`` (the run lands in
``<dir>/swanlog/run-*``; upload it later with ``swanlab sync <that dir>``). A backend that is not
installed, fails to start, or fails while logging is switched off with a one-line note in
:attr:`Tracker.notes`; it never stops the training run. The JSONL file stays the source of
truth (it is what ``resume_step`` continues).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["Tracker", "read_metrics"]


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class Tracker:
    """``log(step, metrics)`` to JSONL (+ TensorBoard, W&B, SwanLab); ``plot()`` at the end; ``close()``.

    ``resume_step`` keeps the existing JSONL lines up to that step (a resumed run continues the
    same file). ``wandb`` / ``swanlab`` turn the experiment trackers on (``project``,
    ``run_name`` and ``config`` name the run; offline unless ``online``); the live runs are in
    :attr:`backends` (``{"wandb": run, "swanlab": run}``), the reasons for any that are off in
    :attr:`notes`.
    """

    def __init__(
        self,
        log_dir: str | Path,
        *,
        tensorboard: bool = True,
        plot: bool = True,
        resume_step: int | None = None,
        wandb: bool = False,
        swanlab: bool = False,
        project: str = "rollkit",
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        online: bool = False,
    ) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.dir / "metrics.jsonl"
        self.notes: list[str] = []
        self.want_plot = plot
        rows = read_metrics(self.jsonl) if resume_step is not None and self.jsonl.exists() else []
        rows = [r for r in rows if r.get("step", 0) <= (resume_step or 0)]
        tmp = self.jsonl.with_name(self.jsonl.name + ".tmp")  # a kill mid-rewrite keeps the old rows
        with tmp.open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.jsonl)
        self.history: list[dict[str, Any]] = rows
        self.tb = None
        if tensorboard:
            if importlib.util.find_spec("tensorboard") is None:
                self.notes.append("TensorBoard logging off: the tensorboard package is not installed")
            else:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.dir / "tb"))
        if plot and importlib.util.find_spec("matplotlib") is None:
            self.notes.append("no PNG plot: matplotlib is not installed (metrics.jsonl has the numbers)")
        if not isinstance(project, str) or not project:
            raise ValueError(f"project: expected a non-empty str, got {project!r}")
        if run_name is not None and not isinstance(run_name, str):
            raise ValueError(f"run_name: expected a str or None, got {type(run_name).__name__}")
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"config: expected a dict or None, got {type(config).__name__}")
        self.backends: dict[str, Any] = {}
        mode = "online" if online else "offline"
        if wandb:
            self._start("wandb", "W&B", lambda m: _start_wandb(m, self.dir, project, run_name, config, mode))
        if swanlab:
            self._start(
                "swanlab", "SwanLab", lambda m: _start_swanlab(m, self.dir, project, run_name, config, mode)
            )

    def _start(self, package: str, label: str, start: Any) -> None:
        if importlib.util.find_spec(package) is None:
            self.notes.append(f"{label} logging off: the {package} package is not installed")
            return
        try:
            self.backends[package] = start(importlib.import_module(package))
        except Exception as e:  # a tracker must never stop the training run
            self.notes.append(f"{label} logging off: it failed to start: {_one_line(e)}")

    def _log_backends(self, step: int, scalars: dict[str, float]) -> None:
        for name, run in list(self.backends.items()):
            try:
                run.log(scalars, step=step)
            except Exception as e:
                self.notes.append(f"{name} logging off from step {step}: log failed: {_one_line(e)}")
                self._finish(name)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        self.history.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {
            k: v
            for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.backends:
            self._log_backends(int(step), scalars)

    def plot(self) -> Path | None:
        """Reward mean and held-out accuracy per step to ``curves.png``; ``None`` without matplotlib."""
        if not self.want_plot or importlib.util.find_spec("matplotlib") is None:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        mismatch = any(k.startswith("mismatch/") for r in self.history for k in r)
        domains = sorted({k.split("/")[1] for r in self.history for k in r if k.startswith("domain/")})
        panels = 1 + mismatch + bool(domains)
        fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
        ax = axes[0][0]
        for key, label in (("reward/mean", "train reward"), ("eval/accuracy", "held-out accuracy")):
            pts = [(r["step"], r[key]) for r in self.history if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o" if key.startswith("eval") else None, label=label)
        ax.set_xlabel("step")
        if any(r.get("reward/mean") is not None for r in self.history):
            ax.set_ylim(-0.02, 1.02)
        else:  # no reward (SFT / DPO): the loss
            pts = [(r["step"], r["loss"]) for r in self.history if r.get("loss") is not None]
            if pts:
                ax.plot(*zip(*pts), label="loss")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        ax.grid(alpha=0.3)
        if mismatch:
            self._plot_mismatch(axes[0][1])
        if domains:
            self._plot_domains(axes[0][-1], domains)
        path = self.dir / "curves.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return path

    def _plot_domains(self, ax: Any, domains: list[str]) -> None:
        """Per domain (``data.domains``): the train reward (line) and held-out accuracy (dots)."""
        for i, d in enumerate(domains):
            color = f"C{i % 10}"
            for key, style in ((f"domain/{d}/reward", "-"), (f"eval/domain/{d}/accuracy", "o--")):
                pts = [(r["step"], r[key]) for r in self.history if r.get(key) is not None]
                if pts:
                    label = f"{d} train reward" if style == "-" else f"{d} held-out accuracy"
                    ax.plot(*zip(*pts), style, color=color, label=label, alpha=0.8)
        ax.set_xlabel("step")
        ax.set_title("per domain")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)

    def _plot_mismatch(self, ax: Any) -> None:
        """The training-inference mismatch per step (docs/correction.md), log scale."""
        for key in ("mismatch/k3", "mismatch/ratio_out_0.9_1.1", "correction/masked_token_frac"):
            pts = [(r["step"], r[key]) for r in self.history if r.get(key) is not None and r[key] > 0]
            if pts:
                ax.plot(*zip(*pts), label=key)
        pts = [
            (r["step"], 1 - r["mismatch/ess_frac"])
            for r in self.history
            if r.get("mismatch/ess_frac") is not None
        ]
        if any(v > 0 for _, v in pts):
            ax.plot(*zip(*pts), label="1 - mismatch/ess_frac")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.set_title("behaviour vs trainer log-probs")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    def _finish(self, name: str) -> None:
        run = self.backends.pop(name, None)
        if run is None:
            return
        try:
            run.finish()
        except Exception as e:
            self.notes.append(f"{name}: finish failed: {_one_line(e)}")

    def close(self) -> None:
        """Flush and close TensorBoard and finish the W&B / SwanLab runs (idempotent)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        for name in list(self.backends):
            self._finish(name)


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _start_wandb(wandb: Any, log_dir: Path, project: str, name: str | None, config: Any, mode: str) -> Any:
    """A W&B run in ``<log_dir>/wandb`` (``mode="offline"``: nothing leaves the machine)."""
    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True)
    return wandb.init(
        project=project,
        name=name,
        dir=str(log_dir),
        config=config,
        mode=mode,
        reinit="create_new",
        settings=settings,
    )


def _start_swanlab(
    swanlab: Any, log_dir: Path, project: str, name: str | None, config: Any, mode: str
) -> Any:
    """A SwanLab run in ``<log_dir>/swanlog`` (``mode="offline"``: saved locally, synced later)."""
    return swanlab.init(
        project=project,
        name=name,
        log_dir=str(log_dir / "swanlog"),
        config=config,
        mode=mode,
    )


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

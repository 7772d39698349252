"""Metrics sinks of the trainers: a JSONL file always, TensorBoard and a PNG plot when installed.

:class:`Tracker` writes one JSON object per logged step to ``<dir>/metrics.jsonl`` (``{"step":
k, "reward/mean": ..., ...}``). With the ``tensorboard`` package installed it also writes
TensorBoard events (``torch.utils.tensorboard``) to ``<dir>/tb``; with ``matplotlib``
installed, :meth:`Tracker.plot` draws reward and held-out accuracy per step to
``<dir>/curves.png``. A missing optional package is reported once in :attr:`Tracker.notes`,
never an error.
"""

from __future__ import annotations

import importlib.util
import json
import math
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
    """``log(step, metrics)`` to JSONL (+ TensorBoard); ``plot()`` at the end; ``close()``.

    ``resume=True`` keeps the existing JSONL lines up to ``resume_step`` (a resumed run
    continues the same file).
    """

    def __init__(
        self,
        log_dir: str | Path,
        *,
        tensorboard: bool = True,
        plot: bool = True,
        resume_step: int | None = None,
    ) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.dir / "metrics.jsonl"
        self.notes: list[str] = []
        self.want_plot = plot
        rows = read_metrics(self.jsonl) if resume_step is not None and self.jsonl.exists() else []
        rows = [r for r in rows if r.get("step", 0) <= (resume_step or 0)]
        with self.jsonl.open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
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

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        self.history.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)

    def plot(self) -> Path | None:
        """Reward mean and held-out accuracy per step to ``curves.png``; ``None`` without matplotlib."""
        if not self.want_plot or importlib.util.find_spec("matplotlib") is None:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("reward/mean", "train reward"), ("eval/accuracy", "held-out accuracy")):
            pts = [(r["step"], r[key]) for r in self.history if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o" if key.startswith("eval") else None, label=label)
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.legend()
        ax.grid(alpha=0.3)
        path = self.dir / "curves.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return path

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

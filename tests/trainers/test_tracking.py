"""trainers.tracking: metrics.jsonl, TensorBoard events, the PNG plot, and the optional W&B /
SwanLab backends (real packages, offline; skipped when the package is not installed)."""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path

import pytest

import trainers.tracking as tracking
from trainers.tracking import Tracker, read_metrics

ROWS = [
    {"reward/mean": 0.25, "loss": 1.5, "eval/accuracy": 0.1},
    {"reward/mean": 0.5, "loss": 1.25},
    {"reward/mean": 0.75, "loss": 1.0, "eval/accuracy": 0.6, "note": "text is kept in jsonl only"},
]


def _log_rows(tracker: Tracker) -> None:
    for step, row in enumerate(ROWS, start=1):
        tracker.log(step, row)


def test_jsonl_tensorboard_events_and_png_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tr = Tracker(tmp_path)
    _log_rows(tr)
    png = tr.plot()
    tr.close()
    assert tr.notes == []
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["note"] == "text is kept in jsonl only"

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward/mean", "loss", "eval/accuracy"}
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [
        (1, pytest.approx(0.1)),
        (3, pytest.approx(0.6)),
    ]

    assert png == tmp_path / "curves.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100 and len(data) > 1000


def test_resume_keeps_the_rows_up_to_the_step(tmp_path):
    tr = Tracker(tmp_path, tensorboard=False, plot=False)
    _log_rows(tr)
    tr.close()
    tr = Tracker(tmp_path, tensorboard=False, plot=False, resume_step=2)
    tr.log(3, {"reward/mean": 0.9})
    tr.close()
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 0.25),
        (2, 0.5),
        (3, 0.9),
    ]


def test_missing_backend_is_a_one_line_note(tmp_path, monkeypatch):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(
        tracking.importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("wandb", "swanlab") else real(name, *a),
    )
    tr = Tracker(tmp_path, tensorboard=False, plot=False, wandb=True, swanlab=True)
    tr.log(1, {"x": 1.0})
    tr.close()
    assert tr.backends == {}
    assert tr.notes == [
        "W&B logging off: the wandb package is not installed",
        "SwanLab logging off: the swanlab package is not installed",
    ]


def test_backend_that_fails_to_start_never_stops_the_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")

    def start_fails(*args):  # fault injection: the backend's own start raises
        raise ConnectionError("no route to api.wandb.ai\nsecond line is dropped")

    monkeypatch.setattr(tracking, "_start_wandb", start_fails)
    tr = Tracker(tmp_path, tensorboard=False, plot=False, wandb=True)
    tr.log(1, {"x": 1.0})
    tr.close()
    assert tr.notes == ["W&B logging off: it failed to start: ConnectionError: no route to api.wandb.ai"]
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 1.0}]


@pytest.mark.parametrize("kwargs, match", [({"project": ""}, "project"), ({"config": [1]}, "config")])
def test_bad_tracker_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Tracker(tmp_path, tensorboard=False, plot=False, **kwargs)


def _wandb_history(run_file: str) -> list[dict]:
    """The ``history`` records of a W&B ``.wandb`` transaction log (LevelDB log format: 7-byte
    file header, 32 KiB blocks, records ``crc32 | length | type`` split FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and n == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            records.append(buf + chunk)
    rows = []
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            )
    return rows


@pytest.mark.slow
def test_wandb_offline_run_records_the_metrics(tmp_path):
    wandb = pytest.importorskip("wandb")
    tr = Tracker(
        tmp_path,
        tensorboard=False,
        plot=False,
        wandb=True,
        project="rollkit-test",
        run_name="t",
        config={"lr": 1e-3},
    )
    assert tr.notes == [] and "wandb" in tr.backends
    _log_rows(tr)
    tr.close()
    assert tr.backends == {}
    # ``run.finish()`` returns once the W&B service has the records; its writer may still hold
    # some in a buffer (CI once read a log with no history yet). Shutting the service down
    # flushes and closes the transaction log, so the file read below is complete.
    wandb.teardown()
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = _wandb_history(run_file)
    assert [(r["_step"], r["reward/mean"], r["loss"]) for r in rows] == [
        (1, 0.25, 1.5),
        (2, 0.5, 1.25),
        (3, 0.75, 1.0),
    ]
    assert "note" not in rows[2]  # only numbers go to the trackers


@pytest.mark.slow
def test_swanlab_offline_run_records_the_metrics(tmp_path):
    pytest.importorskip("swanlab")
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    tr = Tracker(
        tmp_path,
        tensorboard=False,
        plot=False,
        swanlab=True,
        project="rollkit-test",
        run_name="t",
        config={"lr": 1e-3},
    )
    assert tr.notes == [] and "swanlab" in tr.backends
    _log_rows(tr)
    tr.close()
    (run_file,) = glob.glob(str(tmp_path / "swanlog" / "run-*" / "run-*.swanlab"))
    reader = DataStoreReader()
    reader.open(run_file)
    scalars = {}
    for raw in reader:
        rec = Record()
        rec.ParseFromString(raw)
        if rec.HasField("scalar") and rec.scalar.step > 0:
            scalars[(rec.scalar.key, rec.scalar.step)] = rec.scalar.value.number
    reader.close()
    assert {k: v for k, v in scalars.items() if k[0] == "reward/mean"} == {
        ("reward/mean", 1): 0.25,
        ("reward/mean", 2): 0.5,
        ("reward/mean", 3): 0.75,
    }
    assert scalars[("loss", 3)] == 1.0
    assert "lr" in next(Path(run_file).parent.glob("files/config.yaml")).read_text()

"""The ablations package: grid expansion and ids, statistics, resumability, summary and plots.

Fast tests run the scheduler (`run_cells`) on a test-double cell command (`FAKE_CELL`, a
few lines of Python that write a `metrics.jsonl` and can be told to crash), so that crash
and resume paths are deterministic; the slow tests run `recipes/ablate.py` end to end on the
real tiny Qwen2 model through `recipes/rlvr_qwen.py` (subprocesses, and Ray tasks).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ablations as ab

ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- grid and ids


def test_parse_factor_and_split_levels():
    f = ab.parse_factor("algorithm.advantage=grpo,dr-grpo,lite-ppo")
    assert f == ab.Factor("algorithm.advantage", ("grpo", "dr-grpo", "lite-ppo")) and f.name == "advantage"
    # Commas inside braces / brackets / quotes do not split levels.
    f = ab.parse_factor("algorithm.policy_loss_kwargs={clip_high: 0.28, clip_low: 0.2},{}")
    assert f.levels == ("{clip_high: 0.28, clip_low: 0.2}", "{}")
    assert ab.split_levels("'a,b',[1, 2],c") == ["'a,b'", "[1, 2]", "c"]
    # --model is the alias of model.path; dashes in keys become underscores.
    assert ab.parse_factor("--model=tiny").key == "model.path"
    assert ab.parse_factor("filter.zero-variance=true,false").key == "filter.zero_variance"


def test_expand_grid_order_and_overrides():
    fs = [ab.parse_factor("algorithm.advantage=grpo,rloo"), ab.parse_factor("train.lr=1e-5,3e-5,1e-4")]
    cells = ab.expand_grid(fs, [0, 1], ["train.steps=5"])
    assert len(cells) == 2 * 3 * 2
    assert [c.seed for c in cells[:4]] == [0, 1, 0, 1]  # seeds vary fastest
    assert cells[0].overrides() == ["train.steps=5", "algorithm.advantage=grpo", "train.lr=1e-5", "seed=0"]
    assert cells[-1].key == ("rloo", "1e-4") and cells[-1].seed == 1
    assert len({c.id for c in cells}) == len(cells)


def test_cell_ids_are_stable_and_depend_on_everything_that_changes_the_run():
    c = ab.Cell((("algorithm.advantage", "grpo"),), 0, ("train.steps=5",))
    # A literal: the id must not change between processes or versions (resumability).
    assert c.id == ab.Cell(c.levels, 0, c.fixed).id
    assert c.id == "grpo_s0-068ba8ee7e"
    others = [
        ab.Cell((("algorithm.advantage", "rloo"),), 0, c.fixed),
        ab.Cell(c.levels, 1, c.fixed),
        ab.Cell(c.levels, 0, ("train.steps=6",)),
        ab.Cell(c.levels, 0, c.fixed, runner="sft(steps=100)"),
    ]
    assert len({c.id, *(o.id for o in others)}) == 5
    # Odd characters in levels are slugged (the id is a directory name).
    odd = ab.Cell((("algorithm.policy_loss_kwargs", "{clip_high: 0.28}"),), 0)
    assert "/" not in odd.id and " " not in odd.id and "{" not in odd.id


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("algorithm.advantage", "expected key=level1"),
        ("algorithm.advantage=grpo,,rloo", "empty level"),
        ("algorithm.advantage=grpo,grpo", "given twice"),
        ("seed=0,1", "--seeds"),
        ("logging.dir=a,b", "set by the ablation runner"),
        ("=a,b", "not a config key"),
        ("algo rithm=a", "not a config key"),
    ],
)
def test_bad_factor_is_rejected(spec, match):
    with pytest.raises(ValueError, match=match):
        ab.parse_factor(spec)


def test_bad_grid_is_rejected():
    f = ab.parse_factor("train.lr=1e-5,1e-4")
    with pytest.raises(ValueError, match="more than once"):
        ab.expand_grid([f, ab.parse_factor("train.lr=1")], [0])
    with pytest.raises(ValueError, match="ablated by --grid"):
        ab.expand_grid([f], [0], ["train.lr=3e-4"])
    with pytest.raises(ValueError, match="expected key=value"):
        ab.expand_grid([f], [0], ["train.lr"])
    with pytest.raises(ValueError, match="--seeds"):
        ab.expand_grid([f], [])
    for bad, match in (("0,0", "twice"), ("0,x", "integers"), ("-1", ">= 0")):
        with pytest.raises(ValueError, match=match):
            ab.parse_seeds(bad)
    with pytest.raises(TypeError, match="seeds"):
        ab.parse_seeds([0, 1.5])
    with pytest.raises(TypeError, match="Factor"):
        ab.expand_grid(["train.lr=1"], [0])


def test_validate_cells_names_the_registry_and_the_field():
    def cells(*specs, fixed=()):
        return ab.expand_grid([ab.parse_factor(s) for s in specs], [0], fixed)

    ab.validate_cells(cells("algorithm.advantage=grpo,dr-grpo,lite-ppo", "algorithm.aggregation=token-mean"))
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'drgrpo'; known: .*dr-grpo"):
        ab.validate_cells(cells("algorithm.advantage=grpo,drgrpo"))
    with pytest.raises(ValueError, match=r"algorithm\.aggregation: unknown aggregation mode 'mean'"):
        ab.validate_cells(cells("algorithm.aggregation=mean"))
    with pytest.raises(ValueError, match=r"algorithm\.kl\.estimator: unknown KL estimator|kl\.estimator"):
        ab.validate_cells(cells("train.lr=1e-5", fixed=["algorithm.kl.estimator=k9"]))
    with pytest.raises(ValueError, match=r"algorithm\.advantge: unknown field"):
        ab.validate_cells(cells("algorithm.advantge=grpo"))
    with pytest.raises(ValueError, match=r"train\.lr: expected float"):
        ab.validate_cells(cells("train.lr=fast"))


# ----------------------------------------------------------------------------- statistics


@pytest.mark.parametrize(
    ("df", "q"),
    # Two-sided 95% critical values of Student's t (standard tables).
    [
        (1, 12.7062),
        (2, 4.3027),
        (3, 3.1824),
        (4, 2.7764),
        (5, 2.5706),
        (10, 2.2281),
        (30, 2.0423),
        (1e9, 1.9600),
    ],
)
def test_t_quantile_matches_tables(df, q):
    assert ab.t_quantile(0.975, df) == pytest.approx(q, abs=1e-4)


def test_t_quantile_known_values_to_float_precision():
    # t_{0.975, 4} from the closed form of the df = 4 quantile (see _t4_quantile).
    assert ab.t_quantile(0.975, 4) == pytest.approx(2.7764451051977987, rel=1e-12)
    assert _t4_quantile(0.975) == pytest.approx(2.7764451051977987, rel=1e-14)
    assert ab.t_quantile(0.975, 2) == pytest.approx(0.95 / math.sqrt(2 * 0.975 * 0.025), rel=1e-12)


def test_t_quantile_other_levels_and_errors():
    assert ab.t_quantile(0.95, 2) == pytest.approx(2.9200, abs=1e-4)
    assert ab.t_quantile(0.995, 5) == pytest.approx(4.0321, abs=1e-4)
    assert ab.t_quantile(0.025, 2) == pytest.approx(-4.3027, abs=1e-4)
    assert ab.t_quantile(0.5, 7) == 0.0
    # df = 1 is the Cauchy distribution: quantile tan(pi (p - 1/2)).
    assert ab.t_quantile(0.9, 1) == pytest.approx(math.tan(math.pi * 0.4), rel=1e-9)
    for p in (0.0, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="p must be"):
            ab.t_quantile(p, 3)
    for df in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="df must be"):
            ab.t_quantile(0.9, df)


def _t4_quantile(p: float) -> float:
    """The closed-form p quantile of Student's t with 4 degrees of freedom (Shaw, 2006):
    ``sign(p - 1/2) 2 sqrt(q - 1)``, ``q = cos(arccos(sqrt(a)) / 3) / sqrt(a)``, ``a = 4p(1 - p)``."""
    a = 4 * p * (1 - p)
    q = math.cos(math.acos(math.sqrt(a)) / 3) / math.sqrt(a)
    return math.copysign(2 * math.sqrt(q - 1), p - 0.5)


@given(st.floats(0.001, 0.999))
def test_t_quantile_matches_closed_forms(p):
    # df = 1 (Cauchy), 2 and 4 have closed-form quantiles, independent of scipy.
    assert ab.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9, abs=1e-12)
    assert ab.t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9, abs=1e-12)
    assert ab.t_quantile(p, 4) == pytest.approx(_t4_quantile(p), rel=1e-9, abs=1e-12)
    assert ab.t_quantile(1 - p, 3) == pytest.approx(-ab.t_quantile(p, 3), rel=1e-9, abs=1e-12)


def test_mean_ci_known_values():
    m, h, n = ab.mean_ci([0.5, 0.6, 0.7])
    s = 0.1  # sample standard deviation
    assert (m, n) == (pytest.approx(0.6), 3) and h == pytest.approx(4.302653 * s / math.sqrt(3), rel=1e-6)
    m, h, n = ab.mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])  # t_{0.975, 4} = 2.7764451051977987, s = sqrt(2.5)
    assert (m, n) == (3.0, 5) and h == pytest.approx(2.7764451051977987 * math.sqrt(2.5 / 5), rel=1e-12)
    m, h, n = ab.mean_ci([1.0, 3.0], confidence=0.9)  # t_{0.95, 1} = 6.3138, s = sqrt(2)
    assert m == 2.0 and h == pytest.approx(6.313752 * math.sqrt(2) / math.sqrt(2), rel=1e-6)
    assert ab.mean_ci([0.4, 0.4, 0.4])[1] == pytest.approx(0.0, abs=1e-12)
    m, h, n = ab.mean_ci([0.3, None, float("nan")])
    assert (m, n) == (0.3, 1) and math.isnan(h)
    assert ab.mean_ci([])[2] == 0 and math.isnan(ab.mean_ci([])[0])
    with pytest.raises(ValueError, match="confidence"):
        ab.mean_ci([1, 2], confidence=95)


def test_auc_trapezoid_normalised_by_the_step_range():
    assert ab.auc([0, 10, 20], [0.0, 0.5, 0.5]) == pytest.approx((2.5 + 5.0) / 20)
    assert ab.auc([20, 0, 10], [0.5, 0.0, 0.5]) == pytest.approx(0.375)  # any order
    assert ab.auc([0, 5, 20], [0.2, 0.2, 0.2]) == pytest.approx(0.2)  # constant -> the constant
    assert ab.auc([0, 1], [0.0, 1.0]) == pytest.approx(0.5)
    assert ab.auc([3], [0.7]) == 0.7 and math.isnan(ab.auc([], []))
    assert ab.auc([0, 1, 2], [0.0, None, 1.0]) == pytest.approx(0.5)


# ----------------------------------------------------------------------------- scheduler (test double)

# Test double of a cell command, for the scheduler tests: writes a metrics.jsonl whose
# accuracy depends on the levels and the seed, and exits 1 when the file named by
# ABLATION_CRASH exists and names this cell's directory.
FAKE_CELL = r"""
import json, os, sys
kv = dict(a.split("=", 1) for a in sys.argv[1:])
d = kv["logging.dir"]
crash = os.environ.get("ABLATION_CRASH")
if crash and os.path.exists(crash) and open(crash).read() in d:
    sys.exit(1)
open(os.path.join(os.path.dirname(os.path.dirname(d)), "runs.log"), "a").write(os.path.basename(d) + "\n")
base = {"grpo": 0.2, "rloo": 0.4}[kv["algorithm.advantage"]] + 0.01 * int(kv["seed"])
bonus = 0.1 if kv["algorithm.aggregation"] == "seq-mean-token-mean" else 0.0
with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 0, "eval/accuracy": base}) + "\n")
    for k in (1, 2, 3, 4):
        f.write(json.dumps({"step": k, "reward/mean": base, "time/rollout": 0.5,
                            "throughput/rollout_tokens_per_s": 100.0,
                            **({"eval/accuracy": base + bonus * k / 4} if k == 2 else {})}) + "\n")
    f.write(json.dumps({"step": 4, "eval/accuracy": base + bonus}) + "\n")
"""

FACTORS = ["algorithm.advantage=grpo,rloo", "algorithm.aggregation=token-mean,seq-mean-token-mean"]


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_cell.py"
    script.write_text(FAKE_CELL)
    factors = [ab.parse_factor(s) for s in FACTORS]
    cells = ab.expand_grid(factors, [0, 1, 2], ["train.steps=4"])
    return factors, cells, [sys.executable, str(script)], tmp_path / "out"


def _runs(out):
    f = out / "runs.log"
    return sorted(f.read_text().split()) if f.exists() else []


def test_run_cells_resumes_and_reruns_crashed_cells(fake, monkeypatch, tmp_path):
    _, cells, cmd, out = fake
    crash = tmp_path / "crash"
    monkeypatch.setenv("ABLATION_CRASH", str(crash))
    crash.write_text(cells[3].id)  # this cell crashes on the first pass
    res = ab.run_cells(cells, out, cmd, parallel=3, log=lambda s: None)
    assert [r.status for r in res].count("ran") == 11 and res[3].status == "failed" and res[3].returncode == 1
    assert not ab.is_done(out, cells[3]) and len(_runs(out)) == 11
    assert "$ " in res[3].log.read_text()  # the cell's own log names the command
    crash.unlink()
    (out / "runs.log").unlink()
    res = ab.run_cells(cells, out, cmd, parallel=2, log=lambda s: None)
    assert _runs(out) == [cells[3].id]  # only the crashed cell ran again
    assert [r.status for r in res].count("skipped") == 11
    (out / "runs.log").unlink()
    assert ab.run_cells(cells, out, cmd, log=lambda s: None)[0].status == "skipped"
    assert _runs(out) == []  # all done: nothing runs
    (ab.cell_dir(out, cells[5]) / "done.json").unlink()
    ab.run_cells(cells, out, cmd, log=lambda s: None)
    assert _runs(out) == [cells[5].id]
    done = json.loads((ab.cell_dir(out, cells[5]) / "done.json").read_text())
    assert (
        done["id"] == cells[5].id
        and done["returncode"] == 0
        and done["command"][-1].startswith("logging.dir=")
    )
    # A done.json of another cell (a renamed directory) does not count.
    (ab.cell_dir(out, cells[6]) / "done.json").write_text(json.dumps({"id": "other"}))
    assert not ab.is_done(out, cells[6])
    with pytest.raises(ValueError, match="parallel"):
        ab.run_cells(cells, out, cmd, parallel=0)


def test_run_cells_kills_a_cell_past_its_deadline(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(120)\n")
    cells = ab.expand_grid([ab.parse_factor("train.lr=1e-5")], [0])
    out = tmp_path / "out"
    res = ab.run_cells(cells, out, [sys.executable, str(script)], timeout_s=1.0, log=lambda s: None)
    assert res[0].status == "failed" and res[0].returncode == 124 and res[0].wall_s < 60
    assert "deadline" in res[0].log.read_text() and not ab.is_done(out, cells[0])
    with pytest.raises(ValueError, match="timeout_s"):
        ab.run_cells(cells, out, [sys.executable, str(script)], timeout_s=0)


def test_collect_summary_and_plot(fake):
    factors, cells, cmd, out = fake
    ab.run_cells(cells, out, cmd, parallel=3, log=lambda s: None)
    rows = ab.collect(cells, out)
    assert len(rows) == 12 * 5  # steps 0..4, the end-of-run evaluation merged into step 4
    r4 = next(r for r in rows if r["step"] == 4 and r["cell"] == cells[0].id)
    assert (
        r4["eval/accuracy"] == pytest.approx(0.2) and r4["rollout/tokens"] == 50 and r4["advantage"] == "grpo"
    )
    paths = ab.write_metrics(rows, out)
    assert [p.name for p in paths] == ["metrics.csv", "metrics.parquet"]
    import pyarrow.parquet as pq

    t = pq.read_table(out / "metrics.parquet")
    assert t.num_rows == 60 and {"cell", "seed", "advantage", "aggregation", "step", "eval/accuracy"} <= set(
        t.column_names
    )
    assert (
        (out / "metrics.csv").read_text().splitlines()[0].startswith("cell,seed,advantage,aggregation,step")
    )

    stats = ab.summarize(cells, out, curve_metrics=["reward/mean"])
    s = next(x for x in stats if x.cell.key == ("rloo", "seq-mean-token-mean") and x.cell.seed == 1)
    assert s.final_accuracy == pytest.approx(0.51) and s.initial_accuracy == pytest.approx(0.41)
    # Curve 0.41 (step 0), 0.46 (2), 0.51 (4): trapezoid area / 4.
    assert s.auc == pytest.approx(((0.41 + 0.46) + (0.46 + 0.51)) / 4) and s.tokens == 200
    md = ab.write_markdown(
        stats, factors, out / "summary.md", command="python recipes/ablate.py ..."
    ).read_text()
    m, h, _ = ab.mean_ci([0.5, 0.51, 0.52])
    assert f"| `rloo` | `seq-mean-token-mean` | 3 | {m:.3f} ± {h:.3f} |" in md
    # Marginal over aggregation within each seed: rloo -> (0.4 + 0.5)/2 + 0.01 seed.
    m, h, _ = ab.mean_ci([0.45, 0.46, 0.47])
    assert f"| `rloo` | 3 | {m:.3f} ± {h:.3f} |" in md and "```bash" in md
    # Paired by seed, rloo - grpo is exactly 0.2 in every seed: the CI has zero width.
    assert "| +0.200 ± 0.000 |" in md.split("### aggregation")[0]

    png = ab.plot_curves(stats, factors, out / "curves.png", metrics=["eval/accuracy", "reward/mean"])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 800 and img.shape[1] > 800  # 2 metrics + the paired row, x 2 factors
    assert img[..., :3].std() > 0.05  # not a blank canvas
    with pytest.raises(ValueError, match="factors"):
        ab.plot_curves(stats, [], out / "x.png")

    rep = ab.write_report(cells, factors, out, title="T", command="cmd", plot_metrics=["eval/accuracy"])
    assert rep.summary.read_text().startswith("# T\n\n```bash\ncmd") and len(rep.stats) == 12
    assert rep.curves.read_bytes()[:4] == b"\x89PNG" and [p.name for p in rep.metrics] == [
        p.name for p in paths
    ]
    empty = out / "empty"
    with pytest.raises(ValueError, match="no finished cell"):
        ab.write_report(cells, factors, empty)
    assert not empty.exists()


# ----------------------------------------------------------------------------- the command line


def _ablate():
    spec = importlib.util.spec_from_file_location("ablate_recipe", ROOT / "recipes" / "ablate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("argv", "fixed", "match"),
    [
        (["--grid", "algorithm.advantage=grpo,drgrpo"], [], "known: .*dr-grpo"),
        (["--grid", "algorithm.aggregation=token-mean,mean"], [], "unknown aggregation mode 'mean'"),
        ([], [], "at least one factor"),
        (["--grid", "train.lr=1e-5", "--seeds", "1,1"], [], "twice"),
        (["--grid", "train.lr=1e-5"], ["train.lr=1"], "ablated by --grid"),
        (["--grid", "train.lr=1e-5"], ["--model"], "missing value"),
        (["--grid", "train.lr=1e-5"], ["train.stepz=3"], r"train\.stepz: unknown field"),
        (["--grid", "train.lr=1e-5", "--cpus-per-cell", "0"], [], "cpus-per-cell"),
        (["--grid", "train.lr=1e-5", "--cell-timeout", "0"], [], "cell-timeout"),
    ],
)
def test_cli_bad_input_fails_before_running(tmp_path, capsys, argv, fixed, match):
    rc = _ablate().main([*argv, "--out", str(tmp_path / "o"), "--", *fixed])
    assert rc == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "o" / "cells").exists()


TINY = ["--model", "tiny", "data.digits=1", "train.steps=2", "eval.every=1", "data.eval_size=8"]
TINY += [
    "rollout.prompts_per_step=2",
    "rollout.n=4",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.plot=false",
]


@pytest.mark.slow
def test_end_to_end_tiny_model_resumes(tmp_path, capsys):
    """2 x 1 cells of the real recipe on the tiny model (two factors, so the table has a column
    each; the grid's expansion is tested above without running cells); a second run runs
    nothing; deleting one cell's done.json re-runs that cell only."""
    ablate = _ablate()
    out = tmp_path / "abl"
    argv = [
        "--grid",
        "algorithm.advantage=grpo,dr-grpo",
        "--grid",
        "algorithm.aggregation=seq-mean-token-mean",
    ]
    argv += ["--seeds", "0", "--out", str(out), "--parallel", "1", "--", *TINY]
    assert ablate.main(argv) == 0
    assert "0 done already, 2 to run" in capsys.readouterr().out
    cells = sorted((out / "cells").iterdir())
    assert len(cells) == 2 and all((c / "done.json").is_file() and (c / "log.txt").is_file() for c in cells)
    mtimes = {c.name: (c / "metrics.jsonl").stat().st_mtime_ns for c in cells}
    for f in ("metrics.csv", "metrics.parquet", "summary.md", "curves.png"):
        assert (out / f).is_file(), f
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "summary.md").read_text()
    assert (
        "| `dr-grpo` | `seq-mean-token-mean` | 1 |" in md and "| `grpo` | `seq-mean-token-mean` | 1 |" in md
    )
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 3  # steps 0, 1, 2 per cell

    assert ablate.main(argv) == 0
    assert "2 done already, 0 to run" in capsys.readouterr().out
    assert {c.name: (c / "metrics.jsonl").stat().st_mtime_ns for c in cells} == mtimes

    (cells[1] / "done.json").unlink()
    assert ablate.main(argv) == 0
    assert "1 done already, 1 to run" in capsys.readouterr().out
    after = {c.name: (c / "metrics.jsonl").stat().st_mtime_ns for c in cells}
    assert [k for k in after if after[k] != mtimes[k]] == [cells[1].name]


@pytest.mark.slow
def test_ray_runs_cells_as_tasks(tmp_path, monkeypatch):
    """Two cells as Ray tasks at once, one step each, on a local Ray started here."""
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cells = ab.expand_grid(
            [ab.parse_factor("algorithm.advantage=grpo,rloo")],
            [0],
            [*TINY[2:], "model.path=tiny", "train.steps=1"],
        )
        cmd = [sys.executable, str(ROOT / "recipes" / "rlvr_qwen.py")]
        res = ab.run_cells(cells, tmp_path, cmd, parallel=2, use_ray=True, log=lambda s: None)
        assert [r.status for r in res] == ["ran", "ran"], [r.log.read_text()[-2000:] for r in res]
        assert all(ab.is_done(tmp_path, c) for c in cells)
        assert ab.run_cells(cells, tmp_path, cmd, use_ray=True, log=lambda s: None)[0].status == "skipped"
    finally:
        ray.shutdown()

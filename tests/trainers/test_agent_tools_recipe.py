"""recipes/agent_tools.py runs end to end (a tiny random model, one warm-up and one RL step):
the python-tool environment in worker processes, its sandboxed tool, the agentic trainer."""

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
warnings.filterwarnings("ignore", message="trainers.rewards.sandbox")


def test_agent_tools_recipe_smoke(tmp_path, capsys):
    import agent_tools

    out = agent_tools.main(
        [
            "model.path=tiny",
            "rollout.dtype=",
            "train.autocast=off",
            "env.max_context=768",
            "warmup.steps=1",
            "warmup.lr=1e-3",
            "warmup.batch_size=2",
            "train.steps=1",
            "train.lr=1e-4",
            "rollout.groups_per_step=1",
            "rollout.group_size=2",
            "eval.episodes=2",
            "logging.plot=false",
            f"logging.dir={tmp_path}",
        ]
    )
    text = capsys.readouterr().out
    assert out["steps"] == 1 and 0.0 <= out["success_after"] <= 1.0
    assert out["success_untrained"] is not None and out["success_before"] is not None
    assert "greedy success rate untrained:" in text and "greedy success rate after RL:" in text

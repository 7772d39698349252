"""The agentic trainer on real vLLM (in process, float32): its greedy episodes are the transformers
engine's, a training step with a KL reference runs and syncs the weights. vLLM runs in a spawned
process (in-process vLLM leaves global state behind that changes later tests' floats by an ulp)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from trainers.config import AgenticConfig, load_config
from trainers.engines.base import SamplingParams

BASE = [
    "--model", "tiny", "model.tiny_heads=2", "model.dtype=float32", "rollout.dtype=float32",
    "env.kwargs={size: 2, hole_prob: 0.0, max_turns: 2, end_on_format_error: false}",
    "env.max_turns=2", "env.max_context=400", "rollout.mode=lockstep", "rollout.groups_per_step=2",
    "rollout.group_size=2", "rollout.max_tokens=6", "rollout.max_model_len=512", "train.lr=3e-2",
    "train.micro_batch_size=4", "algorithm.kl.coef=0.5", "algorithm.entropy_coef=1.0",
    "logging.tensorboard=false", "logging.progress=false",
]  # fmt: skip
SEEDS = [101, 102, 103, 104, 105, 106]


def _episodes(trainer) -> list[list[str]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, seed=0)
    res = trainer.rollout.collect(SEEDS, params, groups=len(SEEDS) - 2, group_size=1, mode="lockstep")
    return [[*e.actions] for e in sorted(res.episodes, key=lambda e: e.seed)]


def _on_vllm(out: str, logdir: str) -> None:
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false"
    )
    from trainers.loops.agentic import AgenticTrainer

    cfg = load_config([*BASE, "rollout.engine=vllm", f"logging.dir={logdir}"], base=AgenticConfig())
    with AgenticTrainer(cfg) as tr:
        greedy = _episodes(tr)
        m1, m2 = tr.step(), tr.step()
        synced = tr.rollout.server.policy_version
    with open(out, "w") as f:
        json.dump(
            {"episodes": greedy, "kl1": m1["kl/rollout"], "kl2": m2["kl/rollout"], "version": synced}, f
        )


@pytest.mark.slow
def test_agentic_on_vllm_plays_the_transformers_engines_episodes(tmp_path):
    from trainers.loops.agentic import AgenticTrainer

    out = str(tmp_path / "vllm.json")
    p = mp.get_context("spawn").Process(target=_on_vllm, args=(out, str(tmp_path / "vllm")))
    p.start()
    p.join(600)
    assert p.exitcode == 0, f"the vLLM process failed (exit {p.exitcode})"
    with open(out) as f:
        got = json.load(f)
    cfg = load_config([*BASE, "rollout.engine=hf", f"logging.dir={tmp_path / 'hf'}"], base=AgenticConfig())
    with AgenticTrainer(cfg) as tr:
        want = _episodes(tr)
    assert got["episodes"] == want  # greedy, float32: the same actions turn by turn
    assert abs(got["kl1"]) < 1e-4  # vLLM's log-probs against the trainer's copy of the same weights
    assert got["kl2"] > abs(got["kl1"])  # the policy moved, the reference did not
    assert got["version"] == 2  # each step's weights reached the vLLM engine

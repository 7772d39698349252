"""trainers.loops.agentic: the multi-turn RL pipeline end to end on a real tiny Qwen2 (transformers
rollout engine, PyTorch train engine, FrozenLake in EnvWorkers worker processes), in each rollout
mode, with StarPO and GiGPO; configuration checks; the W3 benchmark and the recipe at tiny sizes."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rollkit.advantages import gigpo_advantages, starpo_advantages
from rollkit.ops import broadcast_to_tokens
from rollkit.registry import ADVANTAGE_ESTIMATORS
from trainers.config import AgenticConfig, load_config
from trainers.loops.agentic import AgenticTrainer, TrajectoryCredit, trajectory_advantages
from trainers.loops.common import Timer

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "--model",
    "tiny",
    "env.kwargs={size: 2, hole_prob: 0.0, max_turns: 2, end_on_format_error: false}",
    "env.max_turns=2",
    "env.max_context=800",
    "rollout.groups_per_step=2",
    "rollout.group_size=2",
    "rollout.max_tokens=6",
    "train.lr=1e-3",
    "train.micro_batch_size=4",
    "eval.episodes=4",
    "logging.tensorboard=false",
    "logging.progress=false",
]


def tiny_cfg(tmp_path, *extra: str) -> AgenticConfig:
    return load_config([*TINY, f"logging.dir={tmp_path}", *extra], base=AgenticConfig())


def params_of(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.train.model.named_parameters()}


# ----------------------------------------------------------------------------- config (fast)


def test_config_loads_overrides_and_rejects_bad_values():
    cfg = load_config(
        ["rollout.mode=lockstep", "--algorithm.advantage", "gigpo", "--model", "tiny"], base=AgenticConfig()
    )
    assert (cfg.rollout.mode, cfg.algorithm.advantage, cfg.model.path) == ("lockstep", "gigpo", "tiny")
    assert AgenticConfig().algorithm.advantage == "starpo"
    bad = [
        (["rollout.mode=batch"], "rollout.mode"),
        (["rollout.mode=lockstep", "rollout.redundancy=1"], "redundan"),
        (["rollout.num_env_groups=2", "rollout.groups_per_step=4"], "num_env_groups"),
        (["algorithm.advantage=nope"], "algorithm.advantage"),
        (["algorithm.policy_loss=nope"], "algorithm.policy_loss"),
        (["algorithm.reward_clip=1"], "reward_clip"),  # the RLVR credit's shaping (kl.target works here)
        (["rollout.engine=sglang"], "rollout.engine"),
        (["rollout.servers=localhost"], "rollout.servers"),
        (["rollout.tensor_parallel_size=2"], "tensor_parallel_size"),
        (["rollout.temperature=0"], "temperature"),
        (["rollout.engine_temperature=-1"], "engine_temperature"),
        (["rollout.group_size=0"], "group_size"),
        (["env.chat_template=maybe"], "chat_template"),
    ]
    for overrides, match in bad:
        with pytest.raises(ValueError, match=match):
            AgenticTrainer(load_config(["--model", "tiny", *overrides], base=AgenticConfig()))
    with pytest.raises(ValueError, match="unknown field"):
        load_config(["rollout.nope=1"], base=AgenticConfig())


def test_engines_take_rollout_dtype_and_train_autocast():
    """rollout.dtype and train.autocast reach the embedded engines (as in the RLVR trainer);
    a bad value names its field."""
    from trainers.loops.agentic import build_agentic_engines

    cfg = load_config([*TINY, "rollout.dtype=bfloat16", "train.autocast=bfloat16"], base=AgenticConfig())
    rollout, train, _ = build_agentic_engines(cfg)
    assert rollout.dtype == torch.bfloat16 and next(rollout.model.parameters()).dtype == torch.bfloat16
    assert train.autocast == torch.bfloat16 and next(train.model.parameters()).dtype == torch.float32
    rollout, train, _ = build_agentic_engines(load_config(TINY, base=AgenticConfig()))
    assert rollout.dtype == torch.float32 and train.autocast is None  # defaults: float32, no autocast
    with pytest.raises(ValueError, match=r"train\.autocast"):
        build_agentic_engines(load_config([*TINY, "train.autocast=int8"], base=AgenticConfig()))
    with pytest.raises(ValueError, match=r"rollout\.dtype"):
        build_agentic_engines(load_config([*TINY, "rollout.dtype=int8"], base=AgenticConfig()))


# ----------------------------------------------------------------------------- end to end (slow)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode_args",
    [
        ["rollout.mode=lockstep"],
        ["rollout.mode=async"],
        ["rollout.mode=async", "rollout.num_env_groups=3", "rollout.redundancy=1"],
    ],
    ids=["lockstep", "async", "async+redundant"],
)
def test_the_whole_pipeline_trains_in_each_rollout_mode(tmp_path, mode_args):
    # a random tiny model earns the same reward in every episode (all advantages 0): a small
    # entropy bonus makes sure a gradient flows through the whole pipeline
    cfg = tiny_cfg(tmp_path, *mode_args, "train.steps=2", "algorithm.entropy_coef=0.01")
    with AgenticTrainer(cfg) as trainer:
        before = params_of(trainer)
        out = trainer.fit()
        after = params_of(trainer)
    assert out["steps"] == 2 and 0 <= out["success_before"] <= 1 and 0 <= out["success_after"] <= 1
    assert any(not torch.equal(before[k], after[k]) for k in before), "the weights did not change"
    rows = [r for r in out["history"] if "time/step" in r]
    assert len(rows) == 2
    for r in rows:
        for key in (
            "env/hang",
            "env/error",
            "env/died",
            "env/replaced",
            "env/cancelled",
            "reward/mean",
            "success/rate",
            "episode/turns_mean",
            "loss/ratio_mean",
            "optim/grad_norm",
        ):
            assert key in r, key
        assert r["train/trajectories"] == 4 and r["rollout/episodes"] == 4
        # the trainer's log-probs of the action tokens equal the rollout engine's (on-policy)
        assert r["train/logprob_gap"] < 1e-3
    if "rollout.redundancy=1" in mode_args:
        assert all(r["rollout/launched"] == 9 for r in rows)
        assert all(r["env/cancelled"] + r["rollout/discarded"] == 5 for r in rows)
    assert Path(out["metrics_file"]).is_file() and Path(out["plot"]).is_file()


@pytest.mark.slow
def test_engine_temperature_injects_a_mismatch(tmp_path):
    """rollout.engine_temperature: the engine samples hotter than the trainer's log-probs assume,
    so the behaviour log-probs no longer match the trainer's (on-policy they match to 1e-3)."""
    gaps = {}
    for t in (0.0, 3.0):
        cfg = tiny_cfg(
            tmp_path / str(t), "rollout.mode=lockstep", "train.steps=1", f"rollout.engine_temperature={t}"
        )
        with AgenticTrainer(cfg) as trainer:
            gaps[t] = next(r for r in trainer.fit()["history"] if "time/step" in r)["train/logprob_gap"]
    assert gaps[0.0] < 1e-3 < 0.05 < gaps[3.0], gaps


@pytest.mark.slow
def test_gigpo_step_uses_state_groups_and_starpo_one_advantage_per_trajectory(tmp_path):
    cfg = tiny_cfg(tmp_path, "algorithm.advantage=gigpo", "algorithm.advantage_kwargs={gamma: 0.9}")
    with AgenticTrainer(cfg) as trainer:
        result = trainer.collect()
        batch = result.to_batch(max_context=cfg.env.max_context, pad_token_id=trainer.pad_id)
        adv, m = trajectory_advantages(trainer.update.adv_entry, batch, cfg.algorithm.advantage_kwargs)
        # every group's episodes start from the same state: anchor groups of size group_size exist
        assert m["adv/state_groups_multi"] >= 2
        want = gigpo_advantages(
            batch.step_rewards,
            batch.traj_ids,
            batch.step_index,
            batch.step_group_ids,
            batch.state_ids,
            batch.episode_returns,
            gamma=0.9,
        )
        torch.testing.assert_close(adv, batch.steps_to_tokens(want))
        assert not adv[~batch.response_mask].any()  # nothing on environment tokens or padding
        metrics = trainer.step()
        assert metrics["adv/state_groups_multi"] >= 2
        cfg.algorithm.advantage, cfg.algorithm.advantage_kwargs = "starpo", {}
        adv2, _ = trajectory_advantages(ADVANTAGE_ESTIMATORS.entry("starpo"), batch, cfg.algorithm.advantage_kwargs)
        want2 = broadcast_to_tokens(starpo_advantages(batch.rewards, batch.group_ids), batch.response_mask)
        torch.testing.assert_close(adv2, want2)


@pytest.mark.slow
def test_async_training_bounds_staleness_per_turn(tmp_path):
    """max_staleness=1: the next batch is collected while the current one trains; every turn
    trained on is at most one version behind."""
    cfg = tiny_cfg(tmp_path, "rollout.max_staleness=1", "train.steps=3", "eval.before=false")
    with AgenticTrainer(cfg) as trainer:
        out = trainer.fit()
    rows = [r for r in out["history"] if "time/step" in r]
    assert len(rows) == 3 and all(r["staleness/max"] <= 1 for r in rows)
    assert all(r["rollout/episodes"] == 4 for r in rows)


@pytest.mark.slow
def test_w3_benchmark_runs_and_prints_three_modes(capsys):
    spec = importlib.util.spec_from_file_location("_bench_agentic", ROOT / "benchmarks" / "bench_agentic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    n = torch.get_num_threads()
    try:
        res = mod.main(
            [
                "--quick",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--groups",
                "2",
                "--group-size",
                "2",
                "--num-env-groups",
                "3",
                "--redundancy",
                "1",
                "--latency-mean",
                "0.05",
                "--latency-std",
                "0.05",
                "--threads",
                "1",
            ]
        )
    finally:
        torch.set_num_threads(n)
    out = capsys.readouterr().out
    assert set(res) == {"lockstep", "async", "async+redundant"}
    assert all(r["step_s"] > 0 for r in res.values())
    assert re.search(r"speedup: asynchrony [\d.]+x, redundancy [\d.]+x on top, total [\d.]+x", out), out


@pytest.mark.slow
def test_recipe_tiny_runs_and_writes_plot(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "_recipe_agentic", ROOT / "recipes" / "agentic_frozenlake.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    n = torch.get_num_threads()
    try:
        out = mod.main(
            [
                "--model",
                "tiny",
                "train.steps=1",
                "warmup.steps=2",
                "eval.episodes=4",
                "rollout.groups_per_step=2",
                "rollout.group_size=2",
                f"logging.dir={tmp_path}",
                "logging.tensorboard=false",
            ]
        )
    finally:
        torch.set_num_threads(n)
    assert out["steps"] == 1 and Path(out["plot"]).is_file()
    assert 0 <= out["success_before"] <= 1 and 0 <= out["success_after"] <= 1


@pytest.mark.slow
def test_checkpoint_resume_equals_the_uninterrupted_run(tmp_path):
    """Lock-step: 3 steps in one go, and 2 steps + a checkpoint + a new trainer resuming for the
    third, play the same third step (task seeds, sampling seeds, optimizer state and RNGs are in
    the checkpoint): the same episodes token for token with the same rewards, the same counts,
    and the same update up to float rounding.

    What is exact: the episodes (sampled with the server's seeded counters), rewards and counts.
    What is compared to a tolerance: the floats the engines compute (log-probs, loss, gradient
    norm, weights), whose last bits depend on the kernels' reduction order, which can change with
    the state of the process (memory alignment, what other tests loaded: in-process vLLM moved a
    gradient norm by 1 ulp). Measured with another reduction order (the first run on one torch
    thread, the other two on two): the same episodes, log-probs 4.8e-7 apart (1 ulp), the ratio
    mean 1.2e-7 (relative), weights 2e-8. The tolerances are 50-100x that, and far below what a
    resume bug moves (one optimizer step moves a weight by up to lr = 1e-3)."""
    common = ["rollout.mode=lockstep", "algorithm.entropy_coef=0.01", "eval.before=false", "eval.episodes=2"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order within a run (2 threads drift ~2e-8 between runs)
    try:
        _resume_equals_uninterrupted(tmp_path, common)
    finally:
        torch.set_num_threads(threads)


def _run_recording_batches(cfg):
    """``fit()`` of a trainer of ``cfg``; returns (its summary, the batch each step trained on,
    its final weights, its version)."""
    with AgenticTrainer(cfg) as tr:
        batches, collect = [], tr.collect
        tr.collect = lambda: batches.append(collect()) or batches[-1]  # records, changes nothing
        out = tr.fit()
        return out, batches, params_of(tr), tr.version


def _episodes(batch):
    """What a step played, exactly: each episode's task, group, turns (tokens, rewards, states),
    actions and ending."""
    return [
        (e.seed, g, e.status, e.terminated, e.truncated, e.context_full, e.actions,
         [(list(t.obs_ids), list(t.action_ids), t.reward, t.state_id) for t in e.turns])
        for e, g in zip(batch.episodes, batch.group_ids)
    ]  # fmt: skip


def _resume_equals_uninterrupted(tmp_path, common):
    full, full_batches, w_full, _ = _run_recording_batches(
        tiny_cfg(tmp_path / "full", *common, "train.steps=3")
    )
    ck = tmp_path / "ck"
    _run_recording_batches(tiny_cfg(tmp_path / "a", *common, "train.steps=2", f"checkpoint.dir={ck}"))
    resume = [*common, "train.steps=3", f"checkpoint.dir={ck}", "checkpoint.resume=auto"]
    res, res_batches, w_res, version = _run_recording_batches(tiny_cfg(tmp_path / "b", *resume))
    assert res["steps"] == 1 and version == 3 and len(full_batches) == 3 and len(res_batches) == 1
    # the third step played the same episodes, token for token
    want, got = full_batches[2], res_batches[0]
    assert _episodes(got) == _episodes(want)
    assert got.seeds == want.seeds
    for a, b in zip(want.episodes, got.episodes):  # behaviour log-probs: the engine's floats
        for ta, tb in zip(a.turns, b.turns):
            torch.testing.assert_close(
                torch.tensor(tb.logprobs), torch.tensor(ta.logprobs), rtol=0, atol=5e-5
            )
    last = lambda out: [r for r in out["history"] if "time/step" in r][-1]  # noqa: E731
    exact = ("reward/mean", "success/rate", "episode/turns_mean", "train/trajectories", "rollout/episodes")
    assert {k: last(res)[k] for k in exact} == {k: last(full)[k] for k in exact}
    for k in ("loss/ratio_mean", "optim/grad_norm"):  # computed by the update: to float rounding
        assert last(res)[k] == pytest.approx(last(full)[k], rel=1e-5, abs=1e-9), k
    diff = max(float((w_full[k] - w_res[k]).abs().max()) for k in w_full)
    assert diff <= 1e-6, diff


# ----------------------------------------------------------------------------- KL reference


@pytest.mark.parametrize("mode", ["loss", "reward"])
def test_kl_to_a_frozen_reference(tmp_path, mode):
    """algorithm.kl.coef > 0: the reference is the policy as RL starts (frozen), its KL is 0 on the
    first step's on-policy samples and positive once the policy moved; kl.mode=reward takes each
    turn's KL off that turn's reward, kl.mode=loss adds the KL term to the update."""
    # the entropy bonus moves the policy even when every episode of the random tiny model fails
    cfg = tiny_cfg(tmp_path, "rollout.mode=lockstep", "train.lr=3e-2", "algorithm.kl.coef=0.5",
                   f"algorithm.kl.mode={mode}", "algorithm.entropy_coef=1.0")  # fmt: skip
    with AgenticTrainer(cfg) as tr:
        first = tr.step()
        ref = {k: v.detach().clone() for k, v in tr.reference.model.named_parameters()}
        second = tr.step()
        assert abs(first["kl/rollout"]) < 1e-5  # the rollout's log-probs are the reference's
        assert second["kl/rollout"] > 1e-4  # the policy moved, the reference did not
        assert all(torch.equal(ref[k], v) for k, v in tr.reference.model.named_parameters())
        assert not all(torch.equal(ref[k], v) for k, v in tr.train.model.named_parameters())
        if mode == "reward":
            assert second["kl/reward_penalty_mean"] > 0
        else:
            assert "kl/reward_penalty_mean" not in second  # the KL goes to the update's loss instead
        state = tr.state_dict()
    # a resumed run gets the saved reference back, not the resumed policy
    with AgenticTrainer(cfg) as again:
        again.load_state_dict(state)
        assert all(torch.equal(ref[k], v) for k, v in again.reference.model.named_parameters())


def test_kl_reward_penalty_lands_on_each_turn(tmp_path):
    """The per-turn KL penalty (the shared stage's reference step with the agentic credit): each
    step's reward loses coef x the summed KL of that turn's tokens."""
    from trainers.engines.step import StepBatch

    cfg = tiny_cfg(tmp_path, "rollout.mode=lockstep", "algorithm.kl.coef=2.0", "algorithm.kl.mode=reward")
    with AgenticTrainer(cfg) as tr:
        tr._ensure_reference()
        batch = tr.collect().to_batch(max_context=cfg.env.max_context, pad_token_id=tr.pad_id)
        L, T = batch.input_ids.shape[1], batch.response_mask.shape[1]
        old = batch.behavior_logprobs - 0.1 * batch.response_mask
        step = StepBatch({"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                          "response_mask": batch.response_mask, "old_logprobs": old}, prompt_len=L - T)  # fmt: skip
        before = batch.step_rewards.clone(), batch.rewards.clone()
        metrics: dict[str, float] = {}
        tr.update._reference(step, TrajectoryCredit(batch), Timer(), metrics)  # adds ref_logprobs and kl
        ref = step["ref_logprobs"] * batch.response_mask
        kl = torch.exp(ref - old) - (ref - old) - 1  # k3
        torch.testing.assert_close(step["kl"], kl * batch.response_mask, rtol=0, atol=1e-5)
        pen = 2.0 * kl * batch.response_mask
        for n in range(len(before[0])):
            row, k = int(batch.traj_ids[n]), int(batch.step_index[n])
            want = before[0][n] - pen[row][batch.step_ids[row] == k].sum()
            assert float(batch.step_rewards[n]) == pytest.approx(float(want), abs=1e-5)
        torch.testing.assert_close(batch.rewards, before[1] - pen.sum(-1), rtol=0, atol=1e-5)


def test_shared_stage_options_train_agents(tmp_path):
    """The shared update stage's options in the agentic trainer: the adaptive KL coefficient
    (``algorithm.kl.target``) moves with each step's KL and is checkpointed; the advantages are
    whitened and clipped (``algorithm.whiten_advantages``, ``algorithm.advantage_clip``)."""
    from rollkit.losses.kl import AdaptiveKLController

    cfg = tiny_cfg(tmp_path, "rollout.mode=lockstep", "algorithm.kl.coef=0.1", "algorithm.kl.target=0.001",
                   "algorithm.kl.horizon=10", "algorithm.whiten_advantages=true", "algorithm.advantage_clip=0.5",
                   "train.lr=1e-2")  # fmt: skip
    want = AdaptiveKLController(0.1, target=0.001, horizon=10)
    with AgenticTrainer(cfg) as tr:
        for _ in range(2):
            m = tr.step()
            assert m["kl/coef"] == pytest.approx(want.value)
            want.update(m["kl/rollout"], n_steps=int(m["train/trajectories"]))
            assert 0 <= m["advantage/clipped_frac"] <= 1 and m["advantage/abs_mean"] <= 0.5 + 1e-6
        assert m["kl/rollout"] > 0 and tr.update.kl_ctrl.value == pytest.approx(want.value)
        assert tr.update.kl_ctrl.value != 0.1
        state = tr.state_dict()
    with AgenticTrainer(cfg) as again:
        again.load_state_dict(state)
        assert again.update.kl_ctrl.value == pytest.approx(want.value)


# ----------------------------------------------------------------------------- one sample per turn


@pytest.mark.parametrize("advantage", ["starpo", "gigpo"])
def test_per_turn_samples_give_the_trajectory_update(tmp_path, advantage):
    """rollout.sample_per=turn on episodes that fit the context: every turn a row with its whole
    history as the prompt, the same action tokens, log-probs and advantages (StarPO's per
    trajectory, GiGPO's per step) as the one-sequence layout, so the token-mean update is the same
    (gradient norm to 1e-5; AdamW's first step moves a weight by at most lr, so weights to 2 lr)."""
    import copy

    cfg = tiny_cfg(tmp_path, "rollout.mode=lockstep", "train.lr=1e-6", "algorithm.entropy_coef=0.1",
                   f"algorithm.advantage={advantage}", "algorithm.aggregation=token-mean")  # fmt: skip
    turn_cfg = copy.deepcopy(cfg)
    turn_cfg.rollout.sample_per = "turn"
    with AgenticTrainer(cfg) as a, AgenticTrainer(turn_cfg) as b:
        result = a.collect()
        assert sum(len(e.turns) for e in result.episodes) > len(result.episodes)  # multi-turn episodes
        a._next_batch = b._next_batch = lambda: result
        ma, mb = a.step(), b.step()
        assert mb["train/trajectories"] == sum(len(e.turns) for e in result.episodes)
        assert mb["optim/grad_norm"] == pytest.approx(ma["optim/grad_norm"], rel=1e-5)
        assert mb["advantage/abs_mean"] == pytest.approx(ma["advantage/abs_mean"], rel=1e-5)
        pa, pb = params_of(a), params_of(b)
        assert max(float((pa[k] - pb[k]).abs().max()) for k in pa) <= 2e-6


@pytest.mark.slow
def test_per_turn_episodes_outlive_the_context(tmp_path):
    """A horizon longer than the context: with one sample per turn the episodes play all their
    turns in a window (each turn's row fits env.max_context), where the trajectory layout stops."""
    # FrozenLake 2x2 here: a 350-token prompt, 131-token observations; 5 turns need 904 tokens
    common = ["env.kwargs={size: 2, hole_prob: 0.0, max_turns: 5, end_on_format_error: false}", "env.max_turns=5",
              "env.max_context=700", "rollout.mode=lockstep", "train.steps=1"]  # fmt: skip
    with AgenticTrainer(tiny_cfg(tmp_path / "t", *common)) as tr:
        traj = tr.collect()
    with AgenticTrainer(tiny_cfg(tmp_path / "p", *common, "rollout.sample_per=turn")) as tr:
        turns = tr.collect()
        m = tr.step()
        batch = tr._batch(turns)
    assert max(len(e.turns) for e in traj.episodes) < 5 and all(e.context_full for e in traj.episodes)
    assert max(len(e.turns) for e in turns.episodes) == 5 and not any(e.context_full for e in turns.episodes)
    assert (
        int(batch.attention_mask.sum(-1).max()) <= 700 and m["train/trajectories"] == batch.input_ids.shape[0]
    )


def test_ipa_by_name_gets_the_turns_as_chunks(tmp_path, monkeypatch):
    """algorithm.policy_loss=ipa / advantage=ipa in the agentic config: the update sees each
    token's turn as its chunk id (docs/ipa.md)."""
    import trainers.learner as learner

    cfg = tiny_cfg(tmp_path, "algorithm.policy_loss=ipa", "algorithm.advantage=ipa",
                   "algorithm.advantage_kwargs={gamma: 0.9}", "rollout.mode=lockstep")  # fmt: skip
    seen, real = {}, learner.ppo_update

    def spy(engine, batch, spec, **kw):  # records what the update received (the step batch)
        seen["step_ids"] = batch.get("step_ids")
        return real(engine, batch, spec, **kw)

    monkeypatch.setattr(learner, "ppo_update", spy)
    with AgenticTrainer(cfg) as trainer:
        m = trainer.step()
    assert seen["step_ids"] is not None and int(seen["step_ids"].max()) >= 1  # more than one turn per row
    assert "loss/chunk_ratio_mean" in m and m["loss/num_chunks"] > 4

"""The sync trainer on Ray: placement, data-parallel train ranks, weight sync, learning end to end.

One Ray instance for the module: a 2-node ``ray.cluster_utils.Cluster`` on this machine (a head
node with the custom resource ``rollout_node`` and a second node with ``train_node``, 2 logical
CPUs each, 100 MB object stores, no dashboard), torn down at the end of the module. Real actors,
real engines, the tiny Qwen2 (head size 32: 2 heads of 64, as vLLM's CPU attention requires).

Learning task: 1-digit addition (70 train / 30 held-out pairs), as in test_sync_trainer.py: a
supervised warm-up in this process gives the tiny model a starting accuracy, RL on Ray must
raise it (margins measured, stated at the assertions).
"""

import copy
import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytest.importorskip("transformers")
pytest.importorskip("ray")

import ray
import torch
from _tiny_rl import RL_OVERRIDES, fit_and_check_learning

from trainers.config import load_config
from trainers.engines import Generation, SamplingParams, TorchTrainEngine, pack_generations
from trainers.engines.step import StepBatch
from trainers.learner import LocalLearner, UpdateSpec, supervised_warmup
from trainers.loops import SyncTrainer
from trainers.loops.lengths import LengthSampler
from trainers.models import char_tokenizer, tiny_qwen2
from trainers.ray import plan_bundles
from trainers.roles import on_ray

BASE = [
    "--model",
    "tiny",
    "data.digits=1",
    "data.eval_size=30",
    "eval.before=false",
    "eval.every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "ray.enabled=true",
]
# RL on the warmed-up model: the in-process test's settings, requests of 4 prompts to the actors.
RL = [*RL_OVERRIDES, "rollout.prompts_per_request=4"]


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine; the module's only Ray session."""
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 2, "object_store_memory": 100 * 2**20, "include_dashboard": False}
    c = Cluster(initialize_head=True, head_node_args={**node, "resources": {"rollout_node": 1}})
    c.add_node(**node, resources={"train_node": 1})
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _warm(tok, heads, kv_heads, steps):
    """The tiny model after ``steps`` supervised steps on the train split (in this process)."""
    from trainers.data import build_prompts

    torch.set_num_threads(1)
    model = tiny_qwen2(tok, seed=0, heads=heads, kv_heads=kv_heads)
    train_prompts, _ = build_prompts(load_config(["--model", "tiny", "data.digits=1", "data.eval_size=30"]))
    supervised_warmup(
        TorchTrainEngine(model, lr=3e-3), tok, train_prompts, steps=steps, batch_size=64, seed=0
    )
    return model.eval()


@pytest.fixture(scope="module")
def warm_model(tok):
    """Head size 16 (4 heads of 64), 100 warm-up steps: the model of test_sync_trainer.py."""
    return _warm(tok, 4, 2, 100)


@pytest.fixture(scope="module")
def warm_model_32(tok):
    """Head size 32 (2 heads of 64, as vLLM's CPU attention needs), 60 warm-up steps."""
    return _warm(tok, 2, 1, 60)


def _rollout_state(tr):
    """The first rollout actor's model weights (HF engine), read inside the actor."""
    actor = tr.rollout.actors[0]
    return ray.get(actor.__ray_call__.remote(lambda self: dict(self.engine.model.named_parameters())))


def _no_leaks(cap_s=120.0):
    """Every CPU free again (the actors' and placement groups' released), waited for: Ray frees
    them asynchronously; ``cap_s`` only bounds a leak."""
    import time

    end = time.monotonic() + cap_s
    while time.monotonic() < end:
        if ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_disaggregated_across_nodes_and_two_ranks_equal_one(cluster, tok, warm_model, tmp_path):
    """Disaggregated placement pinned by node resources: the rollout on the head node, two train
    ranks (gloo) and the separate reference on the other node; a step runs; and the 2-rank
    update of a fixed batch gives the weights of the 1-rank update in this process."""
    cfg = load_config(
        [
            *BASE,
            f"logging.dir={tmp_path}",
            "placement.mode=disaggregated",
            "placement.train_workers=2",
            "placement.cpus_per_worker=0.5",
            "placement.reference=separate",
            "placement.rollout_resources={rollout_node: 0.1}",
            "placement.train_resources={train_node: 0.1}",
            "algorithm.kl.coef=0.05",
            "rollout.prompts_per_step=3",
            "rollout.n=4",
            "train.lr=1e-3",
            "train.micro_batch_size=2",
            "train.mini_batch_size=6",
        ]
    )
    with SyncTrainer(cfg, model=copy.deepcopy(warm_model), tokenizer=tok) as tr:
        head = ray.get_runtime_context().get_node_id()
        train_nodes = tr.train.node_ids()
        assert tr.rollout.node_ids() == [head]
        assert len(set(train_nodes)) == 1 and train_nodes[0] != head
        assert tr.roles.reference.node_id() == train_nodes[0]

        # 2 ranks vs 1 rank on the same batch (odd sizes: 7 rows, mini-batches 6 + 1, micro 2).
        w0 = dict(tr.train.weights())
        gens = tr.rollout.generate(
            [tr.codec.encode(p) for p in tr.train_prompts[:7]], SamplingParams(n=1, seed=3)
        )
        batch = pack_generations(gens, tok.pad_token_id)
        adv = torch.linspace(-1, 1, 7)[:, None] * batch.response_mask
        m2 = tr.train.update(StepBatch.from_packed(batch, advantages=adv), seed=5)
        local = copy.deepcopy(warm_model)
        local.load_state_dict(w0, strict=False)
        eng = TorchTrainEngine(local, lr=1e-3, grad_clip=cfg.train.grad_clip)
        m1 = LocalLearner(eng, UpdateSpec.from_config(cfg)).update(StepBatch.from_packed(batch, advantages=adv), seed=5)
        w2 = dict(tr.train.weights())
        w1 = dict(eng.export_weights())
        # The ranks sum the gradient in another order over other micro-batches (other padding), so
        # gradients differ by about n_rows * eps32 * |g|; AdamW's first step divides by |g| + eps_adam,
        # so the weights can differ by up to lr * n_rows * eps32 * clip / eps_adam (clip bounds |g|).
        tol = (
            cfg.train.lr
            * batch.response_mask.shape[0]
            * torch.finfo(torch.float32).eps
            * cfg.train.grad_clip
            / 1e-8
        )
        assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < tol
        assert max(float((w1[k] - w0[k]).abs().max()) for k in w1) > 1e-4  # it did move
        assert m2["optim/grad_norm"] == pytest.approx(m1["optim/grad_norm"], rel=1e-5)
        assert m2["loss/clip_frac"] == pytest.approx(m1["loss/clip_frac"], abs=1e-6)

        m = tr.step()
        assert m["rollout/kept_groups"] == 3 and "kl/rollout" in m and "time/reference" in m
        assert tr.rollout.policy_version == 1
    assert _no_leaks()


@pytest.mark.slow
@pytest.mark.learning
def test_learning_on_ray_hf_torch_colocated(cluster, tok, warm_model, tmp_path):
    """hf + torch, colocated (rollout asleep while training), rewards scored by Ray actors as
    each request finishes: held-out accuracy rises."""
    cfg = load_config(
        [*BASE, *RL, f"logging.dir={tmp_path}", "placement.cpus_per_worker=1", "reward.backend=ray",
         "reward.num_workers=1"]
    )  # fmt: skip
    with SyncTrainer(cfg, model=copy.deepcopy(warm_model), tokenizer=tok) as tr:
        assert tr.rollout.node_ids() == tr.train.node_ids()
        fit_and_check_learning(tr)
        assert tr.rewards.metrics()["scored"] >= cfg.train.steps * 64
        state = _rollout_state(tr)
        for name, w in tr.train.weights():  # the rollout holds them in rollout.dtype
            assert torch.equal(state[name], w.to(state[name].dtype)), name
    assert _no_leaks()


@pytest.mark.slow
@pytest.mark.learning
def test_learning_on_ray_vllm_deepspeed(cluster, tok, warm_model_32, tmp_path):
    """vLLM rollout + DeepSpeed ZeRO-2 train actors (skipped where either is missing)."""
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    cfg = load_config(
        [*BASE, *RL, f"logging.dir={tmp_path}", "--rollout", "vllm", "--train", "deepspeed", "train.zero_stage=2",
         "placement.cpus_per_worker=2", "rollout.max_model_len=64", "train.lr=3e-4", "model.tiny_heads=2",
         "model.tiny_kv_heads=1"]
    )  # fmt: skip
    with SyncTrainer(cfg, model=copy.deepcopy(warm_model_32), tokenizer=tok) as tr:
        fit_and_check_learning(tr)
        assert tr.rollout.policy_version == cfg.train.steps
    assert _no_leaks()


@pytest.mark.slow
@pytest.mark.learning
def test_async_on_ray_two_rollout_actors_learns(cluster, tok, warm_model, tmp_path):
    """The asynchronous trainer on Ray, disaggregated: two rollout actors on the head node
    driven request by request (RayRequestEngine), the train rank on the other node (it also
    recomputes the proximal log-probs). Ratio 1 with decoupled PPO: samples are at most one
    version old, both actors get requests, they end with the trainer's weights, held-out
    accuracy rises."""
    from trainers.loops import AsyncTrainer

    cfg = load_config(
        [*BASE, *RL, f"logging.dir={tmp_path}", "placement.mode=disaggregated", "placement.rollout_workers=2",
         "placement.cpus_per_worker=1", "placement.rollout_resources={rollout_node: 0.1}",
         "placement.train_resources={train_node: 0.1}", "asynchronous.ratio=1",
         "algorithm.policy_loss=decoupled-ppo"]
    )  # fmt: skip
    with AsyncTrainer(cfg, model=copy.deepcopy(warm_model), tokenizer=tok) as tr:
        head = ray.get_runtime_context().get_node_id()
        assert tr.rollout.node_ids() == [head, head] and tr.train.node_ids()[0] != head
        out = fit_and_check_learning(tr)
        steps = cfg.train.steps
        hist = [h for h in out["history"] if "staleness/max" in h]
        assert len(hist) == steps and max(h["staleness/max"] for h in hist) <= 1
        assert max(h["staleness/max"] for h in hist) == 1  # it did run ahead
        assert sum(h["time/recompute"] for h in hist if "time/recompute" in h) > 0
        assert all(e.requests_added > 0 for e in tr.engines)
        s = tr.buffer.stats()
        assert s["produced"] == s["consumed"] + s["dropped_stale"] + s["held"]
        assert s["consumed"] == steps * 8  # groups
        final = dict(tr.train.weights())
        for actor in tr.rollout.actors:
            state = ray.get(
                actor.__ray_call__.remote(lambda self: dict(self.engine.model.named_parameters()))
            )
            assert all(torch.equal(state[k], final[k].to(state[k].dtype)) for k in state)
            assert ray.get(actor.__ray_call__.remote(lambda self: self.engine.policy_version)) == steps
    assert _no_leaks()


@pytest.mark.slow
def test_async_on_ray_vllm_actor(cluster, tok, warm_model_32, tmp_path):
    """The asynchronous trainer drives a vLLM rollout actor request by request (vLLM's own
    add_request / step / abort in the actor), W1-like lengths so requests are stopped and
    continued at updates; every actor update lands (skipped without vLLM)."""
    pytest.importorskip("vllm")
    from trainers.loops import AsyncTrainer

    cfg = load_config(
        [*BASE, *RL, f"logging.dir={tmp_path}", "--rollout", "vllm", "placement.mode=disaggregated",
         "placement.cpus_per_worker=1", "rollout.max_model_len=64", "model.tiny_heads=2",
         "model.tiny_kv_heads=1", "train.steps=4", "rollout.max_tokens=24", "eval.max_tokens=4",
         "rollout.length_dist=lognormal:4:1.2", "asynchronous.ratio=1", "algorithm.policy_loss=decoupled-ppo"]
    )  # fmt: skip
    with AsyncTrainer(cfg, model=copy.deepcopy(warm_model_32), tokenizer=tok) as tr:
        out = tr.fit()
        hist = [h for h in out["history"] if "staleness/max" in h]
        assert len(hist) == 4 and max(h["staleness/max"] for h in hist) <= 1
        assert sum(h["async/stopped_in_flight"] for h in hist) > 0
        assert 0 <= out["accuracy_after"] <= 1
        assert ray.get(tr.rollout.actors[0].__ray_call__.remote(lambda self: self.engine.policy_version)) == 4
    assert _no_leaks()


# RollPacker's tail batching, W1 scaled down (test_tail_batching_trainer.py's settings): a short
# round launches 3 prompts x 3 responses for P0 = R0 = 2; two short rounds queue two prompts,
# the third step is their long round.
TAIL = ["tail_batching.enabled=true", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=32",
        "rollout.length_dist=lognormal:4:1.5", "rollout.chunk_tokens=2", "train.micro_batch_size=4",
        "train.lr=1e-3", "train.steps=3"]  # fmt: skip


def _rollout_metrics(m):
    """A step's rollout-side metrics (what the round generated and kept), no timings."""
    keep = ("reward/", "response/", "tail/", "accuracy/")
    return {k: v for k, v in m.items() if k.startswith(keep)}


@pytest.mark.slow
def test_tail_batching_on_ray_one_actor_is_the_in_process_round(cluster, tok, warm_model, tmp_path):
    """One rollout actor, one train rank: the first round on Ray generates, keeps and aborts
    exactly what the same round does in this process (the actor's request engine is renewed
    every round with the round's seed, as the in-process view is)."""
    args = [*BASE, *TAIL, "train.steps=1", "placement.cpus_per_worker=1"]
    runs = {}
    for ray_on in ("false", "true"):
        cfg = load_config([*args, f"logging.dir={tmp_path / ray_on}", f"ray.enabled={ray_on}"])
        with SyncTrainer(cfg, model=copy.deepcopy(warm_model), tokenizer=tok) as tr:
            assert hasattr(tr.rollout, "actors") == (ray_on == "true")
            m = tr.step()
            runs[ray_on] = (_rollout_metrics(m), tr.last_tail_batch)
    (m_local, b_local), (m_ray, b_ray) = runs["false"], runs["true"]
    assert m_ray == m_local and m_ray["tail/aborted_responses"] > 0
    assert b_ray.prompt_ids == b_local.prompt_ids and b_ray.responses == b_local.responses
    assert _no_leaks()


@pytest.mark.slow
def test_tail_batching_on_ray_two_rollout_actors(cluster, tok, warm_model, tmp_path):
    """Tail batching on Ray, disaggregated: every round's requests spread over two rollout
    actors (a RequestEnginePool of RayRequestEngines, both stepping at once), the responses
    the policy no longer needs aborted on the actors; short, short, then the long round of the
    two queued prompts, each batch P0 x R0; the actors end with the trainer's weights."""
    cfg = load_config(
        [*BASE, *TAIL, f"logging.dir={tmp_path}", "placement.mode=disaggregated", "placement.rollout_workers=2",
         "placement.cpus_per_worker=1", "placement.rollout_resources={rollout_node: 0.1}",
         "placement.train_resources={train_node: 0.1}"]
    )  # fmt: skip
    with SyncTrainer(cfg, model=copy.deepcopy(warm_model), tokenizer=tok) as tr:
        rounds, queued = [], []
        for _ in range(3):
            queued.append(list(tr.tail.policy.queue))
            m = tr.step()
            b = tr.last_tail_batch
            rounds.append(b.round)
            assert len(b.prompt_ids) == 2 and all(len(r) == 2 for r in b.responses)
            assert m["tail/launched_responses"] == (
                m["tail/aborted_responses"] + m["tail/discarded_responses"] + 4
            )
            # least-loaded: the round's responses split evenly over the two actors
            assert m["rollout/actor_requests_max"] - m["rollout/actor_requests_min"] <= 1, m
            assert m["rollout/actor_requests_min"] >= 2
        assert rounds == ["short", "short", "long"]
        assert set(tr.last_tail_batch.prompt_ids) == set(queued[2])
        final = dict(tr.train.weights())
        for actor in tr.rollout.actors:
            state = ray.get(
                actor.__ray_call__.remote(lambda self: dict(self.engine.model.named_parameters()))
            )
            assert all(torch.equal(state[k], final[k].to(state[k].dtype)) for k in state)
            assert ray.get(actor.__ray_call__.remote(lambda self: self.engine.policy_version)) == 3
    assert _no_leaks()


@pytest.mark.slow
def test_sync_on_ray_per_request_lengths_over_two_actors(cluster, tok, warm_model, tmp_path):
    """``rollout.length_dist`` in the synchronous trainer on Ray: one request per sample, each
    with its own budget, spread over both rollout actors (the collector's RequestEnginePool,
    kept from step to step), every sample within its budget."""
    cfg = load_config(
        [*BASE, f"logging.dir={tmp_path}", "placement.mode=disaggregated", "placement.rollout_workers=2",
         "placement.cpus_per_worker=1", "placement.rollout_resources={rollout_node: 0.1}",
         "placement.train_resources={train_node: 0.1}", "rollout.prompts_per_step=2", "rollout.n=3",
         "rollout.max_tokens=32", "rollout.length_dist=lognormal:4:1.5", "train.steps=2"]
    )  # fmt: skip
    with SyncTrainer(cfg, model=copy.deepcopy(warm_model), tokenizer=tok) as tr:
        hist = [h for h in tr.fit()["history"] if "reward/mean" in h]
        assert len(hist) == 2
        pool = tr.collector.request_engine()
        assert [e.requests_added for e in pool.engines] == [6, 6]  # 2 steps x 6 samples, 3 + 3 each
        # EOS ignored: every sample runs to its own budget, the sampler's draws in order
        lengths = LengthSampler(cfg.rollout.length_dist, cap=cfg.rollout.max_tokens, seed=cfg.seed)
        budgets = [lengths.draw() for _ in range(12)]
        assert [h["response/length_mean"] for h in hist] == [sum(budgets[:6]) / 6, sum(budgets[6:]) / 6]
        assert len(set(budgets)) > 1
        assert pool.num_running == 0
    assert _no_leaks()


def test_plan_bundles_is_checked():
    """The pure plan (no Ray): shares, bundle order, errors."""
    p = plan_bundles("disaggregated", rollout_workers=2, train_workers=1, cpus=2, gpus=1, reference="train")
    assert p.strategy == "SPREAD" and len(p.bundles) == 3 and p.bundles[0] == {"CPU": 2.0, "GPU": 1.0}
    assert [(a.role, a.bundle, a.num_cpus, a.num_gpus) for a in p.actors] == [
        ("rollout", 0, 2.0, 1.0),
        ("rollout", 1, 2.0, 1.0),
        ("train", 2, 1.0, 0.5),
        ("reference", 2, 1.0, 0.5),
    ]
    c = plan_bundles("colocated", rollout_workers=1, train_workers=2, cpus=3, gpus=0, reference="separate")
    assert [(a.role, a.bundle, a.num_cpus) for a in c.actors] == [
        ("train", 0, 1.0),
        ("train", 1, 3.0),
        ("rollout", 0, 1.0),
        ("reference", 0, 1.0),
    ]
    assert math.isclose(sum(a.num_cpus for a in c.actors if a.bundle == 0), 3.0)
    with pytest.raises(ValueError, match=r"placement\.mode"):
        plan_bundles("mixed", rollout_workers=1, train_workers=1, cpus=1, gpus=0)
    with pytest.raises(ValueError, match=r"placement\.train_workers"):
        plan_bundles("colocated", rollout_workers=1, train_workers=0, cpus=1, gpus=0)
    with pytest.raises(ValueError, match=r"placement\.strategy"):
        plan_bundles("colocated", rollout_workers=1, train_workers=1, cpus=1, gpus=0, strategy="RANDOM")
    with pytest.raises(ValueError, match="only for mode=disaggregated"):
        plan_bundles(
            "colocated", rollout_workers=1, train_workers=1, cpus=1, gpus=0, rollout_resources={"x": 1}
        )


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: __import__("os").getpid()))


@pytest.mark.slow
def test_a_hung_rollout_actor_stops_the_run_with_its_name(cluster, tok, warm_model, tmp_path):
    """A rollout actor that stops answering (SIGSTOP) makes the step fail after ray.timeout_s with
    an error naming it, instead of hanging; close() then frees every actor and the placement group."""
    import signal
    import time

    from trainers.ray import ActorCallError

    cfg = load_config(
        [*BASE, f"logging.dir={tmp_path}", "placement.mode=disaggregated", "placement.cpus_per_worker=0.5",
         "rollout.prompts_per_step=2", "rollout.n=2", "ray.timeout_s=600"]
    )  # fmt: skip
    tr = SyncTrainer(cfg, model=copy.deepcopy(warm_model), tokenizer=tok)
    pid = _pid(tr.rollout.actors[0])
    try:
        tr.step()  # healthy, under ray.timeout_s=600 (a busy machine may answer slowly)
        os.kill(pid, signal.SIGSTOP)
        tr.rollout.timeout_s = 6.0  # once stopped: no answer can come, however fast the machine
        t0 = time.monotonic()
        with pytest.raises(ActorCallError, match=r"rollout actor.*0.*no answer within 6 s"):
            tr.step()
        # the deadline ended the step, not ray.timeout_s (600 s): the bound leaves a busy machine
        # time for the rest of the step
        assert time.monotonic() - t0 < 300
    finally:
        tr.close()
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert _no_leaks()


@pytest.mark.slow
def test_async_close_after_a_rollout_actor_died_frees_everything(cluster, tok, warm_model, tmp_path):
    """A rollout actor dies mid-run: the step fails naming it, and close() still stops the producer,
    the reward pool and the other actors and frees the placement group (no exception from close)."""
    from trainers.loops import AsyncTrainer

    cfg = load_config(
        [*BASE, f"logging.dir={tmp_path}", "placement.mode=disaggregated", "placement.rollout_workers=2",
         "placement.cpus_per_worker=0.5", "rollout.prompts_per_step=2", "rollout.n=2", "asynchronous.ratio=1",
         "algorithm.policy_loss=decoupled-ppo", "reward.backend=process", "reward.num_workers=1",
         "ray.timeout_s=120"]  # the healthy step's calls on a busy machine; the death is told at once
    )  # fmt: skip
    tr = AsyncTrainer(cfg, model=copy.deepcopy(warm_model), tokenizer=tok)
    pool_pids = tr.rewards.worker_pids()
    tr.step()
    ray.kill(tr.rollout.actors[1], no_restart=True)
    with pytest.raises(RuntimeError, match=r"rollout actor 1.*died"):
        for _ in range(5):
            tr.step()
    tr.close()  # warns about the dead actor, raises nothing
    assert not tr.scheduler.running
    for pid in pool_pids:  # the reward workers are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert _no_leaks()


def test_the_ray_critic_equals_the_in_process_one_and_trains_in_the_loop(cluster, tok, warm_model, tmp_path):
    """The critic actor's values and one value update equal the in-process critic's on the same
    batch; then a PPO step on Ray (colocated: the critic in train rank 0's bundle) trains it and
    the run saves it."""
    from trainers.critic import build_critic
    from trainers.ray.handles import RayCritic
    from trainers.ray.workers import CriticWorker

    cfg = load_config([*BASE, "algorithm.advantage=gae", "critic.lr=1e-3", f"logging.dir={tmp_path / 'run'}",
                       "train.steps=1", "rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=4"])  # fmt: skip
    local = build_critic(cfg, policy=copy.deepcopy(warm_model))
    actor = ray.remote(CriticWorker).options(num_cpus=1).remote(cfg, copy.deepcopy(warm_model), tok, "cpu", 1)
    try:
        remote = RayCritic(actor, timeout_s=120)
        assert remote.num_critics == 1
        gens = [Generation(i // 2, [3, 4, 5 + i // 2], [6 + i, 7], [-1.0, -1.0], "stop") for i in range(4)]
        b = pack_generations(gens, 0)
        v_l, v_r = local.values(b), remote.values(b)
        assert torch.allclose(v_l, v_r, atol=1e-6)
        ret = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.5, 0.5]])
        m_l = local.update(b, v_l, ret, None, seed=5)
        m_r = remote.update(b, v_r, ret, None, seed=5)
        assert m_l["critic/value_loss"] == pytest.approx(m_r["critic/value_loss"], abs=1e-6)
        assert torch.allclose(local.values(b), remote.values(b), atol=1e-5)
    finally:
        ray.kill(actor, no_restart=True)
    with SyncTrainer(cfg, model=copy.deepcopy(warm_model), tokenizer=tok) as tr:
        assert isinstance(tr.roles.critic, RayCritic)
        out = tr.fit()
    row = next(r for r in out["history"] if "critic/value_loss" in r)
    assert row["critic/grad_norm"] > 0 and "critic/explained_variance" in row
    assert (tmp_path / "run" / "critic" / "config.json").is_file()
    assert _no_leaks()


def test_a_vision_language_policy_on_ray(cluster, tmp_path):
    """A tiny Qwen2-VL with the Ray roles (colocated rollout, train and reference actors): the
    prompts' images reach the actors' engines and every forward, a step with the KL reference
    trains, and the rollout actor gets the new weights."""
    pytest.importorskip("PIL.Image")
    cfg = load_config(
        [
            *BASE[2:],
            "--model", "tiny_vl", "data.task=shapes", "data.eval_size=4", "reward.verifier=exact_match",
            f"logging.dir={tmp_path}", "algorithm.kl.coef=0.05", "algorithm.entropy_coef=0.01",
            "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=3", "train.lr=1e-3",
            "train.micro_batch_size=2",
        ]
    )  # fmt: skip
    with SyncTrainer(cfg) as tr:
        m = tr.step()
        assert m["optim/grad_norm"] > 0
        assert any("kl" in k for k in m), sorted(m)
        state = _rollout_state(tr)
        for name, w in tr.train.weights():
            assert torch.equal(state[name].float(), w.float()), name
    assert _no_leaks()


@pytest.mark.slow
def test_megatron_tensor_parallel_on_ray_equals_one_rank(cluster, tok, warm_model, tmp_path):
    """train.engine=megatron with megatron_tp=2 over two Ray train ranks (gloo): the update of a
    fixed batch gives the weights of the torch engine's update in this process (float32), and a
    step of the loop runs (weight sync from the gathered shards)."""
    pytest.importorskip("megatron.core")
    cfg = load_config(
        [
            *BASE,
            f"logging.dir={tmp_path}",
            "train.engine=megatron",
            "train.megatron_tp=2",
            "placement.train_workers=2",
            "placement.cpus_per_worker=0.5",
            "rollout.prompts_per_step=3",
            "rollout.n=4",
            "train.lr=1e-3",
            "train.micro_batch_size=2",
        ]
    )
    with SyncTrainer(cfg, model=copy.deepcopy(warm_model), tokenizer=tok) as tr:
        w0 = dict(tr.train.weights())
        gens = tr.rollout.generate(
            [tr.codec.encode(p) for p in tr.train_prompts[:5]], SamplingParams(n=1, seed=3)
        )
        batch = pack_generations(gens, tok.pad_token_id)
        adv = torch.linspace(-1, 1, 5)[:, None] * batch.response_mask
        m2 = tr.train.update(StepBatch.from_packed(batch, advantages=adv), seed=5)
        local = copy.deepcopy(warm_model)
        local.load_state_dict(w0, strict=False)
        eng = TorchTrainEngine(local, lr=1e-3, grad_clip=cfg.train.grad_clip)
        m1 = LocalLearner(eng, UpdateSpec.from_config(cfg)).update(StepBatch.from_packed(batch, advantages=adv), seed=5)
        w1, w2 = dict(eng.export_weights()), dict(tr.train.weights())
        assert list(w1) == list(w2)
        tol = (
            cfg.train.lr
            * batch.response_mask.shape[0]
            * torch.finfo(torch.float32).eps
            * cfg.train.grad_clip
            / 1e-8
        )
        assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < tol
        assert max(float((w1[k] - w0[k]).abs().max()) for k in w1) > 1e-4
        assert m2["optim/grad_norm"] == pytest.approx(m1["optim/grad_norm"], rel=1e-5)
        m = tr.step()
        assert m["rollout/kept_groups"] >= 0 and tr.rollout.policy_version == 1
    assert _no_leaks()


@pytest.mark.slow
def test_agentic_on_ray_reproduces_the_in_process_episodes(cluster, tmp_path):
    """The agentic trainer with ray.enabled: its rollout, train, reference and critic roles are Ray
    actors (colocated), the environments stay in this process; with lock-step seeded sampling
    (float32) the first step plays the in-process run's episodes action for action, with its
    rewards, its KL and its critic's values (GAE over a critic: algorithm.advantage=gae), and the
    update and weight sync go through the actors."""
    from trainers.config import AgenticConfig
    from trainers.loops.agentic import AgenticTrainer

    common = [
        "--model", "tiny", "env.kwargs={size: 2, hole_prob: 0.0, max_turns: 2, end_on_format_error: false}",
        "env.max_turns=2", "env.max_context=800", "rollout.mode=lockstep", "rollout.groups_per_step=2",
        "rollout.group_size=2", "rollout.max_tokens=6", "train.lr=1e-2", "train.micro_batch_size=4",
        "algorithm.kl.coef=0.1", "algorithm.entropy_coef=0.5", "logging.tensorboard=false", "logging.progress=false",
        "algorithm.advantage=gae", "critic.lr=1e-3",
    ]  # fmt: skip
    runs = {}
    for name, extra in (("local", []), ("ray", ["ray.enabled=true", "placement.cpus_per_worker=0.5"])):
        cfg = load_config([*common, *extra, f"logging.dir={tmp_path / name}"], base=AgenticConfig())
        with AgenticTrainer(cfg) as tr:
            seen = []
            collect = tr.collect
            tr.collect = lambda seen=seen, collect=collect: (
                seen.append(collect()) or seen[-1]
            )  # the steps' batches
            m1, m2 = tr.step(), tr.step()
            runs[name] = (seen, m1, m2, tr.rollout.server.policy_version)
            if name == "ray":
                # the shared roles: the rollout, train and reference roles are the Ray actors
                assert on_ray(tr.roles.rollout) and type(tr.reference).__module__.startswith("trainers.ray")
                assert type(tr.critic).__module__.startswith("trainers.ray")
    (local, l1, _, lv), (ray_, r1, r2, rv) = runs["local"], runs["ray"]
    actions = lambda batches: [[e.actions for e in b.episodes] for b in batches]  # noqa: E731
    assert actions(ray_[:1]) == actions(local[:1])
    # the loop's UpdateSpec travels to the actors; the Ray critic starts from the same policy
    for key in ("reward/mean", "kl/rollout", "train/logprob_gap", "critic/values_mean", "critic/returns_mean"):
        assert r1[key] == pytest.approx(l1[key], abs=1e-5)
    assert set(l1) - set(r1) == set(), sorted(set(l1) - set(r1))  # every in-process metric on Ray too
    assert r1["optim/grad_norm"] == pytest.approx(l1["optim/grad_norm"], rel=1e-4)
    assert rv == lv == 2 and "kl/rollout" in r2
    assert _no_leaks()


def test_the_agentic_ray_critic_starts_from_the_policy_before_its_warm_up(cluster, tmp_path):
    """On Ray the agentic trainer warms the policy up in the driver before the actors start; the
    critic actor starts from the policy as it was *before* that warm-up, as the in-process critic
    does (which loads ``model.*`` afresh): the two critics' weights are equal, and the warm-up did
    move the policy (so a critic started from the warmed policy would differ)."""
    from trainers.config import AgenticConfig
    from trainers.loops.agentic import AgenticTrainer

    common = [
        "--model", "tiny", "env.kwargs={size: 2, hole_prob: 0.0, max_turns: 2, end_on_format_error: false}",
        "env.max_turns=2", "env.max_context=800", "rollout.groups_per_step=2", "rollout.group_size=2",
        "rollout.max_tokens=6", "algorithm.advantage=gae", "warmup.steps=2", "logging.tensorboard=false",
        "logging.progress=false",
    ]  # fmt: skip
    critics = {}
    for name, extra in (("local", []), ("ray", ["ray.enabled=true", "placement.cpus_per_worker=0.5"])):
        cfg = load_config([*common, *extra, f"logging.dir={tmp_path / name}"], base=AgenticConfig())
        with AgenticTrainer(cfg) as tr:
            critics[name] = {k: v.clone() for k, v in tr.critic.state_dict()["critics"][0]["model"].items()}
            if name == "ray":
                assert type(tr.critic).__module__.startswith("trainers.ray") and tr._prewarmed
                warmed = dict(tr.learner.weights())
    local, ray_ = critics["local"], critics["ray"]
    assert list(local) == list(ray_) and all(torch.equal(local[k], ray_[k]) for k in local)
    shared = [k for k in ray_ if k.startswith("model.") and k in warmed]  # the backbone, by the policy's names
    assert shared and any(not torch.equal(ray_[k], warmed[k]) for k in shared)
    assert _no_leaks()


@pytest.mark.slow
def test_delta_weights_go_from_train_rank_0_straight_to_the_rollout_actor(cluster, tok, warm_model, tmp_path):
    """rollout.weight_sync=delta on Ray with two FSDP2 train ranks: rank 0 streams the gathered
    weights to the rollout actor over gloo (the actor's update_weights, the object-store path, is
    never called), the actor's digests match, the second sync is patches, and the actor ends up
    with the train weights exactly; the probe passes (float32)."""
    cfg = load_config(
        [
            *BASE,
            f"logging.dir={tmp_path}",
            "placement.mode=disaggregated",
            "placement.train_workers=2",
            "placement.cpus_per_worker=0.5",
            "train.engine=fsdp2",
            "rollout.weight_sync=delta",
            "rollout.weight_bucket_mb=0.05",
            "rollout.prompts_per_step=2",
            "rollout.n=4",
            "train.lr=1e-3",
        ]
    )
    with SyncTrainer(cfg, model=copy.deepcopy(warm_model), tokenizer=tok) as tr:
        first, second = tr.step(), tr.step()
        assert first["sync/buckets"] > 1 and first["sync/delta_frac"] == 1.0
        assert 0 < second["sync/bytes"] <= second["sync/dense_bytes"]
        assert 0 <= second["sync/probe_gap"] < 1e-4
        state = _rollout_state(tr)
        for name, w in tr.train.weights():
            assert torch.equal(state[name].detach(), w), name
        actor = tr.rollout.actors[0]
        direct = ray.get(actor.__ray_call__.remote(lambda self: (self.engine.policy_version, self.engine.last_sync)))
        assert direct == (2, None)  # version 2, and never through the engine's own update_weights
    assert _no_leaks()

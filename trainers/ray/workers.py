"""The roles of the reference trainers as Ray actors: rollout, train, reference, critic, teacher.

Actors (one process each, placed by :mod:`trainers.ray.placement`):

* :class:`RolloutWorker`: one rollout engine (``rollout.engine``: :class:`~trainers.engines.
  HFRolloutEngine` or :class:`~trainers.engines.vllm_rollout.VLLMRolloutEngine`, which loads
  from a directory: the actor saves the model it receives to a local temporary directory,
  so this works on any node).
* :class:`TrainWorker`: data-parallel rank ``r`` of ``N``: the ranks form a torch.distributed
  group (gloo on CPU, NCCL on GPUs; rendezvous at rank 0's node address and a free port) and
  each runs a training engine (``train.engine``: ``torch`` or ``deepspeed`` with
  ``train.zero_stage``) and :func:`~trainers.learner.ppo_update` on its share of every
  mini-batch.
* :class:`ReferenceWorker`: the frozen initial policy (log-probs for the KL term).
* :class:`TeacherWorker`: a frozen distillation teacher (any HF model path): sampled-token
  log-probs (its engine's ``logprobs``, memory-lean with ``chunk_tokens > 0``) and top-k
  log-probs (:func:`response_topk_logprobs`, chunked over the LM head); placed in a placement
  group of its own (:func:`build_ray_teacher`).

The proxies the loops hold and :func:`build_ray_roles` are in :mod:`trainers.ray.handles`.
Every actor sets ``torch.set_num_threads`` to its CPUs (at least 1; ``ray.torch_threads``
overrides).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

import torch

from rollkit.losses.distill import gather_topk_logprobs
from trainers.config import Config
from trainers.critic import build_critic
from trainers.deps import require
from trainers.engines.base import Generation, PackedBatch, SamplingParams, batch_logprobs
from trainers.engines.build import (
    build_model,
    make_rollout_engine,
    make_train_engine,
    parse_dtype,
    train_autocast,
)
from trainers.engines.options import rollout_dtype
from trainers.engines.requests import as_request_engine
from trainers.engines.torch_train import TorchTrainEngine, response_hidden
from trainers.engines.weight_transfer import Target, WeightPusher
from trainers.learner import UpdateSpec, ppo_update

__all__ = [
    "ActorCallError",
    "CriticWorker",
    "ReferenceWorker",
    "RolloutWorker",
    "TeacherWorker",
    "TrainWorker",
    "batch_topk_logprobs",
    "call",
    "init_ray",
    "ray_module",
    "response_topk_logprobs",
    "teacher_engine",
    "wait_all",
]

#: requests in flight per rollout actor (one running, one queued behind it)
MAX_INFLIGHT = 2


def ray_module() -> Any:
    """The ``ray`` module (imported when first used)."""
    return require("ray")


#: deadline of a remote call when the caller gives none (``ray.timeout_s`` in a config)
DEFAULT_TIMEOUT_S = 1800.0
#: the variable Ray's raylet reads the niceness of its worker processes from (Ray's default: 15)
WORKER_NICENESS = "RAY_worker_niceness"


class ActorCallError(RuntimeError):
    """A call to a Ray actor did not answer within its deadline, or the actor died."""


def call(refs: Any, names: Sequence[str] | str, timeout_s: float, setting: str = "ray.timeout_s") -> Any:
    """``ray.get(refs)`` with a deadline: an actor that does not answer within ``timeout_s``
    (hung, e.g. stopped by SIGSTOP, or overloaded) or that died raises :class:`ActorCallError`
    naming it (``names``: one per ref, or one for a single ref) and the config field that set
    the deadline (``setting``). Never waits longer."""
    ray = ray_module()
    single = not isinstance(refs, list)
    ref_list = [refs] if single else refs
    names = [names] * len(ref_list) if isinstance(names, str) else list(names)
    wait_all(ref_list, names, timeout_s, setting)
    try:
        out = ray.get(ref_list, timeout=timeout_s)
    except ray.exceptions.RayActorError as e:
        dead = ", ".join(names)
        raise ActorCallError(
            f"{dead}: the actor died ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from None
    return out[0] if single else out


def wait_all(refs: list[Any], names: Sequence[str], timeout_s: float, setting: str = "ray.timeout_s") -> None:
    """Wait until every ref is ready (without fetching it), at most ``timeout_s``; else raise
    :class:`ActorCallError` naming the actors that did not answer (and ``setting``)."""
    _, pending = ray_module().wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [n for r, n in zip(refs, names) if r in pending]
        raise ActorCallError(
            f"{', '.join(late)}: no answer within {timeout_s:g} s ({setting}): the actor is hung or "
            "overloaded; the run stops"
        )


def init_ray(cfg: Config) -> None:
    """``ray.init`` once: ``ray.address=""`` joins ``RAY_ADDRESS`` if set, else starts a new local
    Ray (``ray.num_cpus``, ``ray.object_store_mb``; its workers at nice 0 unless
    ``RAY_worker_niceness`` is set); ``"auto"`` / ``"host:port"`` connects to a running cluster.
    Does nothing if Ray is already initialised (e.g. by a test fixture)."""
    ray = ray_module()
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    # ray.address="" joins RAY_ADDRESS where it is set (as `ray job submit` sets it), else starts
    # a new local Ray: "local", whatever the address file of the last `ray start` (or a test's
    # cluster) says -- ray.init() would join that cluster, and refuse num_cpus there
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, **kw)
        return
    if cfg.ray.num_cpus is not None:
        kw["num_cpus"] = cfg.ray.num_cpus
    if cfg.ray.object_store_mb:
        kw["object_store_memory"] = cfg.ray.object_store_mb * 2**20
    # the actors do the run's work (generation, training): start them at the driver's priority,
    # not Ray's default nice 15, at which any busy process on the node starves them (measured
    # under two busy processes on 2 cores: a vLLM actor took minutes to start); set the variable
    # to keep Ray's default
    os.environ.setdefault(WORKER_NICENESS, "0")
    ray.init(address="local", **kw)


def _setup_process(threads: int) -> None:
    """Actor start-up: torch threads, and the environment the engines expect."""
    torch.set_num_threads(max(1, threads))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one engine core, in the actor


def _node_id() -> str:
    return ray_module().get_runtime_context().get_node_id()


def _model(cfg: Config, model: Any, tokenizer: Any) -> tuple[Any, Any]:
    """The shipped ``(model, tokenizer)``, or built from ``cfg.model`` on this node."""
    if model is not None:
        return model, tokenizer
    return build_model(cfg)


# --------------------------------------------------------------------------- actors


class RolloutWorker:
    """A Ray actor holding one rollout engine (``cfg.rollout.engine``)."""

    def __init__(self, cfg: Config, model: Any, tokenizer: Any, device: str, threads: int) -> None:
        _setup_process(threads)
        model, tokenizer = _model(cfg, model, tokenizer)
        self.engine = make_rollout_engine(cfg, model, tokenizer, device=device)
        self.requests: Any = None  # the request-level view (init_requests)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        return self.engine.generate(prompts, params)

    def update_weights(self, weights: list[tuple[str, torch.Tensor]], version: int) -> int:
        # the request engine refuses while requests run
        (self.engine if self.requests is None else self.requests).update_weights(weights, version)
        return version

    def sync_op(self, op: str, arg: Any = None) -> Any:
        """``rollout.weight_sync`` buckets / delta sent by train rank 0 straight to this actor: one
        call of the weight-sync control plane (``init``, ``start``, ``update``, ``finish``,
        ``reports``, ``forget``; ``workers``: how many ranks of this engine join the group) on
        its engine's :meth:`sync_target`."""
        if self.requests is not None and self.requests.num_running:
            raise RuntimeError(f"update_weights: {self.requests.num_running} requests are running; abort them first")
        target = self.engine.sync_target()
        if op == "workers":
            return target.workers
        if op not in ("init", "start", "update", "finish", "reports", "forget"):
            raise ValueError(f"sync_op: unknown operation {op!r}")
        fn = getattr(target, op)
        return fn() if arg is None else fn(arg)

    # request level (:class:`RayRequestEngine`: the asynchronous trainer's queue scheduling, the
    # synchronous collectors' per-request lengths and tail batching)

    def init_requests(self, chunk_tokens: int, seed: int, renew: bool = False) -> int:
        """Build the request-level view of the engine (once; again with ``renew``, which tail
        batching asks for every round: a fresh view seeded for the round); returns its policy
        version. Renewing is refused while requests run."""
        if renew and self.requests is not None and self.requests.num_running:
            raise RuntimeError(
                f"init_requests: renew with {self.requests.num_running} requests running; abort them first"
            )
        if self.requests is None or renew:
            self.requests = as_request_engine(self.engine, chunk_tokens=chunk_tokens, seed=seed)
        return self.engine.policy_version

    def add_requests(self, requests: list[Any]) -> None:
        self.requests.add(requests)

    def step_requests(self) -> list[Any]:
        return self.requests.step()

    def abort_requests(self, request_ids: list[str] | None) -> list[Any]:
        return self.requests.abort(request_ids)

    def sleep(self, level: int) -> None:
        self.engine.sleep(level)

    def wake(self) -> None:
        self.engine.wake()

    def node_id(self) -> str:
        return _node_id()


class RayActorTarget(Target):
    """A Ray rollout actor as a weight-sync target: each control call is ``RolloutWorker.sync_op``
    with a deadline; the actor's engine (a vLLM engine's workers, or the HF engine itself) joins
    the sender's gloo group."""

    def __init__(self, actor: Any, name: str, timeout_s: float) -> None:
        self.actor, self.name, self.timeout_s = actor, name, float(timeout_s)
        self.workers = int(self._call("workers"))

    def _call(self, op: str, arg: Any = None) -> Any:
        return call(self.actor.sync_op.remote(op, arg), f"{self.name} ({op})", self.timeout_s)

    def init(self, init_info: dict[str, Any]) -> None:
        self._call("init", init_info)

    def start(self) -> None:
        self._call("start")

    def update(self, update_info: dict[str, Any]) -> None:
        self._call("update", update_info)

    def finish(self, version: int) -> None:
        self._call("finish", int(version))

    def reports(self) -> list[dict[str, Any]]:
        return list(self._call("reports"))

    def forget(self) -> None:
        self._call("forget")


class TrainWorker:
    """Data-parallel rank ``rank`` of ``world_size``: a training engine and :func:`ppo_update`."""

    def __init__(self, cfg: Config, rank: int, world_size: int, device: str, threads: int) -> None:
        _setup_process(threads)
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.engine: Any = None
        self._pusher: WeightPusher | None = None  # rollout.weight_sync buckets / delta (rank 0)
        self._pusher_actors: list[int] = []

    def address(self) -> tuple[str, int]:
        """This node's address and a free port, for the rendezvous (called on rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray_module().util.get_node_ip_address(), port

    def setup(self, model: Any, tokenizer: Any, master_addr: str, master_port: int) -> str:
        """Join the process group (every rank at once) and build the engine; returns the node id."""
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
        )
        if self.device == "cuda":
            os.environ["LOCAL_RANK"] = "0"  # Ray makes the actor's GPU the only visible one
        dist = torch.distributed
        if self.world_size > 1 and not dist.is_initialized():
            dist.init_process_group(
                "nccl" if self.device == "cuda" else "gloo",
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
            )
        model, _ = _model(self.cfg, model, tokenizer)
        self.engine = make_train_engine(self.cfg, model, device=self.device)
        self.spec = UpdateSpec.from_config(self.cfg)
        return _node_id()

    def update(self, payload: dict[str, Any], seed: int) -> tuple[dict[str, float], dict[str, float]]:
        # a tensor- / pipeline-parallel engine: the ranks of one model-parallel group share the data
        dp = hasattr(self.engine, "dp_rank")
        stats = ppo_update(
            self.engine,
            payload["batch"],  # the step batch (trainers.engines.step.StepBatch), as in process
            payload.get("spec") or self.spec,
            seed=seed,
            rank=self.engine.dp_rank if dp else self.rank,
            world_size=self.engine.world_size if dp else self.world_size,
        )
        return dict(stats.sums), dict(stats.counts), stats.mismatch

    @torch.no_grad()
    def batch_logprobs(
        self,
        batch: PackedBatch,
        temperature: float,
        micro_batch_size: int,
        top_k: int = -1,
        top_p: float = 1.0,
    ) -> torch.Tensor | None:
        """The current policy's log-probs of the whole batch (every rank runs the same forwards,
        as ZeRO-3's parameter gathering needs); rank 0 returns them."""
        out = batch_logprobs(
            self.engine,
            batch,
            temperature=temperature,
            micro_batch_size=micro_batch_size,
            top_k=top_k,
            top_p=top_p,
        )
        return out if self.rank == 0 else None

    def save_model(self, path: str, tokenizer: Any) -> str:
        """Rank 0 writes the policy as a Hugging Face model directory on its node (every rank
        takes part: ZeRO-3 gathers collectively)."""
        return str(self.engine.save_model(path, tokenizer))

    def export_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        weights = list(self.engine.export_weights())  # every rank: ZeRO-3 gathers collectively
        return weights if self.rank == 0 else None

    def push_weights(self, actors: list[Any], version: int, timeout_s: float) -> dict[str, Any] | None:
        """``rollout.weight_sync`` buckets / delta on Ray: rank 0 streams its export straight to the
        rollout actors (:class:`~trainers.engines.weight_transfer.WeightPusher` over
        :class:`RayActorTarget` s, gloo groups of its own, opened once); every other rank drains
        the export (a collective where the engine gathers). Returns rank 0's sync metrics."""
        if self.rank != 0:
            for _ in self.engine.export_weights():
                pass
            return None
        if self._pusher is None or self._pusher_actors != [id(a) for a in actors]:
            if self._pusher is not None:
                self._pusher.close()
            r = self.cfg.rollout
            targets = [RayActorTarget(a, f"rollout actor {i}", timeout_s) for i, a in enumerate(actors)]
            self._pusher = WeightPusher(
                targets, mode=r.weight_sync, bucket_bytes=int(r.weight_bucket_mb * 2**20),
                dtype=rollout_dtype(self.cfg, self.device), check=r.weight_check, timeout_s=timeout_s,
                host=r.weight_sync_host or ray_module().util.get_node_ip_address(),
            )  # fmt: skip
            self._pusher_actors = [id(a) for a in actors]
        return self._pusher.push(self.engine.export_weights(), version).metrics()

    def state_dict(self) -> dict[str, Any] | None:
        state = self.engine.state_dict()
        return state if self.rank == 0 else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)

    def offload(self) -> None:
        """The engine's training state to the host (``placement.offload_train``)."""
        _engine_offload(self.engine, "offload")

    def onload(self) -> None:
        """The engine's training state back to the device."""
        _engine_offload(self.engine, "onload")

    def node_id(self) -> str:
        return _node_id()


def _engine_offload(engine: Any, what: str) -> None:
    """``engine.offload()`` / ``onload()``, or a one-line error naming the config key."""
    method = getattr(engine, what, None)
    if not callable(method):
        raise ValueError(
            f"placement.offload_train: {type(engine).__name__} has no {what}(); set placement.offload_train=false"
        )
    method()


class ReferenceWorker:
    """The frozen initial policy: log-probs without gradients."""

    def __init__(self, cfg: Config, model: Any, tokenizer: Any, device: str, threads: int) -> None:
        _setup_process(threads)
        model, _ = _model(cfg, model, tokenizer)
        self.engine = TorchTrainEngine(
            model, dtype=parse_dtype(cfg.model.dtype), device=device, packing=bool(cfg.train.packing)
        )
        self.engine.model.eval().requires_grad_(False)

    @torch.no_grad()
    def batch_logprobs(
        self,
        batch: PackedBatch,
        temperature: float,
        micro_batch_size: int,
        top_k: int = -1,
        top_p: float = 1.0,
    ) -> torch.Tensor:
        return batch_logprobs(
            self.engine,
            batch,
            temperature=temperature,
            micro_batch_size=micro_batch_size,
            top_k=top_k,
            top_p=top_p,
        )

    def node_id(self) -> str:
        return _node_id()


class CriticWorker:
    """The critic role (:class:`trainers.critic.LocalCritic`, its ``K`` critics) in an actor."""

    def __init__(self, cfg: Config, model: Any, tokenizer: Any, device: str, threads: int) -> None:
        _setup_process(threads)
        policy = None if cfg.critic.model_path else _model(cfg, model, tokenizer)[0]
        self.critic = build_critic(cfg, policy=policy, device=device)

    def num_critics(self) -> int:
        return self.critic.num_critics

    def values(self, batch: PackedBatch) -> torch.Tensor:
        return self.critic.values(batch)

    def update(
        self,
        batch: PackedBatch,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        shards: torch.Tensor | None,
        seed: int,
    ) -> dict[str, float]:
        return self.critic.update(batch, old_values, returns, shards, seed=seed)

    def save_model(self, path: str, tokenizer: Any) -> str:
        return str(self.critic.save_model(path, tokenizer))

    def state_dict(self) -> dict[str, Any]:
        return self.critic.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.critic.load_state_dict(state)

    def node_id(self) -> str:
        return _node_id()


# --------------------------------------------------------------------------- teacher


def teacher_engine(
    cfg: Config, model: Any, device: str, *, chunk_tokens: int = 0, lr: float = 1e-5
) -> TorchTrainEngine:
    """A :class:`~trainers.engines.torch_train.TorchTrainEngine` over a teacher ``model`` in
    ``cfg.model.dtype`` with ``cfg.train.autocast`` (resolved for ``device``), memory-lean
    log-probs with ``chunk_tokens > 0``. Trainable (a warm-up may train it; a frozen model is
    unfrozen first, the optimizer needs parameters); the caller freezes it."""
    return TorchTrainEngine(
        model.requires_grad_(True),
        lr=lr,
        dtype=parse_dtype(cfg.model.dtype),
        device=device,
        autocast=train_autocast(cfg, device),
        logprob_chunk_tokens=chunk_tokens,
    )


@torch.no_grad()
def response_topk_logprobs(
    model: Any,
    input_ids: torch.Tensor,  # [B, L]
    attention_mask: torch.Tensor,  # [B, L]
    response_mask: torch.Tensor,  # [B, T]
    *,
    k: int,
    temperature: float = 1.0,
    chunk_tokens: int = 256,
    autocast: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, T, K] float32, [B, T, K] int64
    """The top-``k`` tokens of ``model`` at each response position and their log-probs,
    normalised over the full vocabulary (the teacher's side of
    :func:`rollkit.losses.topk_forward_kl` / ``topk_reverse_kl`` / ``topk_jsd``)::

        logprobs[b, t], ids[b, t] = topk(log_softmax(logits[b, L - T - 1 + t] / temperature), k)

    Memory-lean: the decoder's final hidden states (:func:`~trainers.engines.torch_train.
    response_hidden`) go through the LM head ``chunk_tokens`` positions at a time, so the
    ``[B, T, V]`` logits never exist (peak ``O(chunk_tokens x V)``). Positions outside
    ``response_mask`` hold log-prob 0 and id 0. Sorted by log-prob, largest first. The rollout's
    top-k / top-p truncation is not applied (the teacher's full tempered distribution).
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dev = torch.device(device)
    B, T = response_mask.shape
    with torch.autocast(dev.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        hidden, head = response_hidden(model, input_ids.to(dev), attention_mask.to(dev), T)
        flat = hidden.reshape(B * T, -1)
        chunk = chunk_tokens if chunk_tokens > 0 else 256
        lps, ids = [], []
        for s in range(0, flat.shape[0], chunk):
            z = head(flat[s : s + chunk]).float()
            if k > z.shape[-1]:
                raise ValueError(f"k={k} exceeds the vocabulary size {z.shape[-1]}")
            i = z.topk(k, dim=-1).indices  # sorted; the same order at any temperature > 0
            # the accurate normaliser: the tail 1 - sum_k p_k that the bucket losses read is off
            # by ~1e-4 at V = 150k through torch's CPU log_softmax (rollkit.losses.distill)
            v = gather_topk_logprobs(z[None], i[None], temperature=temperature)[0]
            lps.append(v)
            ids.append(i)
    mask = response_mask.to(dev, dtype=torch.bool).unsqueeze(-1)
    lp = torch.cat(lps).reshape(B, T, k).masked_fill(~mask, 0.0)
    return lp, torch.cat(ids).reshape(B, T, k).masked_fill(~mask, 0)


@torch.no_grad()
def batch_topk_logprobs(
    policy: Any, batch: PackedBatch, *, k: int, temperature: float, micro_batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, ids)``, each ``[B, T, K]``, of a packed batch under ``policy``: its own
    ``batch_topk_logprobs`` when it has one (:class:`RayTeacher`), else
    :func:`response_topk_logprobs` of its model (a TorchTrainEngine) over micro-batches."""
    if hasattr(policy, "batch_topk_logprobs"):
        return policy.batch_topk_logprobs(
            batch, k=k, temperature=temperature, micro_batch_size=micro_batch_size
        )
    if not hasattr(policy, "model"):
        raise ValueError(
            f"teacher: {type(policy).__name__} offers no top-k log-probs (a TrainEngine with a "
            "Hugging Face causal LM does)"
        )
    kw = {
        "k": k,
        "temperature": temperature,
        "chunk_tokens": getattr(policy, "logprob_chunk_tokens", 0),
        "autocast": getattr(policy, "autocast", None),
        "device": getattr(policy, "device", "cpu"),
    }
    lps, ids = [], []
    for i in range(0, batch.input_ids.shape[0], micro_batch_size):
        mb = batch[i : i + micro_batch_size]
        lp, ix = response_topk_logprobs(policy.model, mb.input_ids, mb.attention_mask, mb.response_mask, **kw)
        lps.append(lp.cpu())
        ids.append(ix.cpu())
    return torch.cat(lps), torch.cat(ids)


class TeacherWorker(ReferenceWorker):
    """A frozen distillation teacher: sampled-token (``batch_logprobs``, the reference's) and
    top-k log-probs without gradients.

    ``cfg.model`` is the teacher's (path, dtype), ``model``: a model shipped instead (a warmed-up
    one), ``chunk_tokens > 0``: the memory-lean log-prob path of the engine."""

    def __init__(  # its own engine (the teacher's model and lean path), not the reference's
        self, cfg: Config, model: Any, tokenizer: Any, device: str, threads: int, chunk_tokens: int
    ) -> None:
        _setup_process(threads)
        model, tokenizer = _model(cfg, model, tokenizer)
        self.engine = teacher_engine(cfg, model, device, chunk_tokens=chunk_tokens)
        self.engine.model.eval().requires_grad_(False)
        get_vocab = getattr(tokenizer, "get_vocab", None)
        self._vocab = get_vocab() if callable(get_vocab) else None

    @torch.no_grad()
    def batch_topk_logprobs(
        self, batch: PackedBatch, k: int, temperature: float, micro_batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return batch_topk_logprobs(
            self.engine, batch, k=k, temperature=temperature, micro_batch_size=micro_batch_size
        )

    def vocab(self) -> dict[str, int] | None:
        """The teacher tokenizer's vocabulary (the driver checks it against the student's)."""
        return self._vocab

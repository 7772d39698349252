"""The server rollout engine: :class:`ServerRolloutEngine`, rollout over ``vllm serve`` processes.

One object is both a :class:`~trainers.engines.base.RolloutEngine` (``generate``) and a
:class:`~trainers.engines.requests.RequestEngine` (``add`` / ``step`` / ``abort`` /
``update_weights`` / ``policy_version``), token in and token out: prompt token ids go to
``/inference/v1/generate`` and the sampled ids come back with their processed log-probs
(``--logprobs-mode processed_logprobs``), streamed, so an aborted request keeps its tokens.
Requests go to the live server with the fewest outstanding requests; a server that stops
answering is dropped (restarted when rollkit started it) and its requests continue elsewhere
from their last token. Weights reach the servers as a safetensors file reloaded in place
(``/collective_rpc``). Every call carries the server's API key (``api_key``). docs/server.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainers.config import server_addresses
from trainers.engines.base import Generation, SamplingParams, prompt_seed
from trainers.engines.options import dtype_name, rollout_dtype
from trainers.engines.requests import Request, _check_new
from trainers.engines.server_pool import ServerPool
from trainers.engines.vllm_rollout import _check_cpu_head_size, _checkpoint_shapes
from trainers.engines.vllm_server import LocalServer, ServerClient, ServerError, launch_servers, stop_servers
from trainers.engines.weight_sync import MODES, SyncStats, checked_weights
from trainers.engines.weight_transfer import Target, WeightPusher
from trainers.models import save_model
from trainers.vision import image_inputs

__all__ = ["ServerRolloutEngine", "reload_weights_on", "weights_to_send"]

_GENERATE = "/inference/v1/generate"


@dataclass
class _Job:
    """One request's current segment on one server."""

    req: Request
    server: int
    rid: str  # the id sent to the server (unique per segment)
    version: int
    future: Future | None = None
    finish: str | None = None
    final_from: int = 0  # tokens before the chunk that finished the request
    detached: bool = False  # aborted: the worker thread appends nothing more
    tries: int = 0


@dataclass
class _Metrics:
    requests: int = 0
    rerouted: int = 0
    errors: int = 0
    weight_updates: int = 0
    weight_update_s: float = 0.0
    by_server: dict[str, int] = field(default_factory=dict)


def _sampling_body(p: SamplingParams, max_tokens: int, seed: int | None) -> dict[str, Any]:
    return {
        "max_tokens": int(max_tokens),
        "temperature": float(p.temperature),
        "top_p": float(p.top_p),
        "top_k": int(p.top_k) if p.top_k > 0 else 0,
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": bool(p.ignore_eos),
        "seed": seed,
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
        "skip_special_tokens": False,
    }


def _continuation_seed(req: Request) -> int | None:
    s = req.params.seed
    return None if s is None else (s + 1_000_003 * len(req.token_ids)) % (2**62)


def weights_to_send(
    named_tensors: Iterable[tuple[str, Tensor]],
    shapes: dict[str, tuple[int, ...]] | None,
    tied: bool,
    dtype: str,
) -> dict[str, Tensor]:
    """The tensors of an update, checked against the checkpoint's names and ``shapes`` (when
    known) before anything is sent (:func:`~trainers.engines.weight_sync.checked_weights`),
    detached, cast to ``dtype`` and moved to CPU; a tied ``lm_head.weight`` is dropped."""
    cast = _CASTS[dtype]
    return {n: t.detach().to(device="cpu", dtype=cast).contiguous() for n, t in checked_weights(named_tensors, shapes, tied)}


_CASTS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync_host(url: str) -> str:
    """The address a server at ``url`` reaches this machine at: 127.0.0.1 for a server on this
    machine, else this machine's address on the route to it."""
    import socket
    import urllib.parse

    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the route
        return str(s.getsockname()[0])


class HTTPTarget(Target):
    """A ``vllm serve`` server as a weight-sync target: vLLM's RL routes (``/init_weight_transfer_engine``,
    ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) and rollkit's worker
    extension for the report (``/collective_rpc``); every call with a deadline."""

    def __init__(self, client: ServerClient, name: str, *, timeout_s: float) -> None:
        self.client, self.name, self.timeout_s = client, name, float(timeout_s)
        self.shares_cores = sync_host(client.url) == "127.0.0.1"  # a server on this machine
        answer = client.get("/get_world_size?include_dp=false", timeout=timeout_s)
        self.workers = int(answer.get("world_size", 1)) if isinstance(answer, dict) else 1

    def init(self, init_info: dict[str, Any]) -> None:
        self.client.post("/init_weight_transfer_engine", {"init_info": init_info}, timeout=self.timeout_s)

    def start(self) -> None:
        self.client.post("/start_weight_update", timeout=self.timeout_s)

    def update(self, update_info: dict[str, Any]) -> None:
        self.client.post("/update_weights", {"update_info": update_info}, timeout=self.timeout_s)

    def finish(self, version: int) -> None:
        self.client.post("/finish_weight_update", {"weight_version": str(int(version))}, timeout=self.timeout_s)
        if version >= 0:
            self.client.post("/reset_prefix_cache", timeout=self.timeout_s)

    def reports(self) -> list[dict[str, Any]]:
        answer = self.client.post("/collective_rpc", {"method": "rollkit_weight_report"}, timeout=self.timeout_s)
        return list(answer.get("results", [])) if isinstance(answer, dict) else []

    def forget(self) -> None:
        self.client.post("/collective_rpc", {"method": "rollkit_weight_forget"}, timeout=self.timeout_s)


def reload_weights_on(client: ServerClient, weights_dir: Path, version: int, timeout: float) -> None:
    """One server reloads the safetensors file in ``weights_dir`` in place (rollkit's worker
    extension, else vLLM's ``reload_weights``), drops its prefix cache, takes the version."""
    body = {"method": "rollkit_reload_weights", "kwargs": {"weights_path": str(weights_dir)}}
    try:
        client.post("/collective_rpc", body, timeout=timeout)
    except ServerError as e:
        if "rollkit_reload_weights" not in str(e):
            raise
        body["method"] = "reload_weights"  # a server started without rollkit's worker extension
        client.post("/collective_rpc", body, timeout=timeout)
    client.post("/reset_prefix_cache")
    client.post("/update_weight_version", {"new_version": str(int(version))})


def _check_text(ids: Sequence[int]) -> None:
    """Servers take token ids only: refuse a prompt with images by name."""
    if image_inputs(ids) is not None:
        raise ValueError(
            "rollout.engine=server: a prompt has images, and vLLM's token-in completions API takes "
            "none; use rollout.engine=vllm (in process) or hf for a vision-language model"
        )


class ServerWeightSync:
    """``rollout.weight_sync`` buckets / delta for a server engine: a
    :class:`~trainers.engines.weight_transfer.WeightPusher` over the live servers (rebuilt, and so
    dense, whenever they change), the drops of servers that fail a sync, and the replacements
    that wait for the next sync to get the current weights."""

    def __init__(self, mode: str, bucket_mb: float, check: bool, host: str, dtype: str) -> None:
        if mode not in MODES:
            raise ValueError(f"rollout.weight_sync must be one of {MODES}, got {mode!r}")
        if not bucket_mb > 0:
            raise ValueError(f"rollout.weight_bucket_mb must be > 0, got {bucket_mb}")
        self.mode, self.check, self.host = mode, bool(check), host
        self.bucket_bytes, self.dtype = int(bucket_mb * 2**20), _CASTS.get(dtype, torch.float32)
        self.pusher: WeightPusher | None = None
        self.key: tuple[int, ...] = ()
        self.awaiting: list[tuple[ServerClient, threading.Event]] = []
        self.last: SyncStats | None = None
        self._lock = threading.Lock()

    def wait_for_weights(self, client: ServerClient, version: int, timeout_s: float) -> None:
        """A replacement (the pool's ``on_replace``): nothing to wait for at version 0 (it started
        from the checkpoint the others serve), else until the next sync sent it everything."""
        if version == 0:
            return
        done = threading.Event()
        with self._lock:
            self.awaiting.append((client, done))
        if not done.wait(timeout=timeout_s):
            raise ServerError("the replacement got no weights: no sync came while it waited")

    def push(self, engine: ServerRolloutEngine, named: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Stream the weights to every live server (and waiting replacement); a server that fails
        is dropped, as with reload."""
        timeout = engine._reload_timeout
        with self._lock:
            awaiting, self.awaiting = self.awaiting, []
        live = sorted(engine.pool.live)
        targets: list[Target] = [HTTPTarget(engine.clients[i], f"server {i} ({engine.clients[i].url})", timeout_s=timeout)
                                 for i in live]
        targets += [HTTPTarget(c, f"replacement ({c.url})", timeout_s=timeout) for c, _ in awaiting]
        key = tuple(id(engine.clients[i]) for i in live) + tuple(id(c) for c, _ in awaiting)
        if self.pusher is None or key != self.key:
            self.close()
            self.pusher = WeightPusher(
                targets, mode=self.mode, bucket_bytes=self.bucket_bytes, dtype=self.dtype, check=self.check,
                timeout_s=timeout, host=self.host or sync_host(targets[0].client.url), strict=False,
            )  # fmt: skip
            self.key = key
        try:
            self.last = self.pusher.push(checked_weights(named, engine._shapes, engine.tie_word_embeddings), version)
        except BaseException:
            self.close()  # the next sync opens new groups and sends everything
            raise
        finally:
            for _, done in awaiting:
                done.set()
        for name, why in self.last.failed.items():
            for i in live:
                if name.startswith(f"server {i} "):
                    engine.pool.drop(i, f"weight sync: {why}")

    def metrics(self) -> dict[str, float]:
        return {} if self.last is None else self.last.metrics()

    def close(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None


class ServerRolloutEngine:
    """Rollout through one or more vLLM HTTP servers (module docstring).

    Args:
        urls: the servers' addresses (``http://host:port``), already running.
        tokenizer: the trainer's tokenizer: its encoding of a probe text must equal the
            servers' (``/tokenize``), else a model mismatch is reported; also gives
            ``pad_token_id`` / ``eos_token_ids``.
        model_path: the trainer's checkpoint directory, for the names and shapes that
            :meth:`update_weights` checks before sending anything (optional).
        timeout_s: deadline of each control call (health, models, abort, version).
        api_key: the key the servers given by address require (sent as ``Authorization:
            Bearer``); ``None``: the key of a server this process started at that address,
            else the ``VLLM_API_KEY`` environment variable, else none
            (:func:`~trainers.engines.vllm_server.resolve_api_key`). The servers in
            ``local_servers`` (and their replacements) use their own keys.
        request_timeout_s: the longest wait for the next streamed token of a request.
        weights_dir: where :meth:`update_weights` writes the safetensors file the servers
            reload; it must be visible to every server (a shared filesystem for remote ones).
            ``None``: a private temporary directory.
        max_retries: how often one request may move to another server before the engine gives up.
        seeded: send the requests' seeds (``SamplingParams.seed``; a continued request a
            derived seed); ``False``: the servers sample unseeded.
        local_servers: the processes of the first ``len(local_servers)`` addresses when rollkit
            started them (:func:`~trainers.engines.vllm_server.launch_servers`): stopped by
            :meth:`shutdown` (or when the engine is collected) and replaced when one dies (``restart``).
        restart_kw: how to start a replacement (:func:`~trainers.engines.vllm_server.start_server`'s arguments).

    >>> eng = ServerRolloutEngine.launch("ckpt/", num_servers=2, run_dir="runs/servers")  # doctest: +SKIP
    >>> gens = eng.generate([[5, 6, 7]], SamplingParams(n=2, max_tokens=8))  # doctest: +SKIP
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        tokenizer: Any = None,
        model_path: str | os.PathLike | None = None,
        timeout_s: float = 30.0,
        api_key: str | None = None,
        request_timeout_s: float = 300.0,
        weights_dir: str | os.PathLike | None = None,
        max_retries: int = 2,
        seeded: bool = True,
        local_servers: Sequence[LocalServer] = (),
        restart: bool = True,
        restart_kw: dict[str, Any] | None = None,
        dtype: str = "float32",
        weight_sync: str = "reload",
        weight_bucket_mb: float = 64.0,
        weight_check: bool = True,
        weight_sync_host: str = "",
    ) -> None:
        sync = ServerWeightSync(weight_sync, weight_bucket_mb, weight_check, weight_sync_host, dtype)
        if isinstance(urls, str) or not urls:
            raise ValueError(f"urls: expected a non-empty list of server addresses, got {urls!r}")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        # routing, health, drops and replacements (the servers rollkit started stop with it)
        self.pool = ServerPool(
            urls,
            timeout_s=timeout_s,
            api_key=api_key,
            local_servers=local_servers,
            restart=restart,
            restart_kw=restart_kw,
        )
        self.pool.on_replace = self._load_current_weights
        self.timeout_s, self.request_timeout_s = float(timeout_s), float(request_timeout_s)
        self.max_retries, self.seeded, self.dtype = int(max_retries), bool(seeded), dtype
        self.tokenizer = tokenizer
        self.model_name, self.max_model_len = self.pool.check_models()
        if tokenizer is not None:
            self.pool.check_tokenizer(tokenizer, self.model_name)
        self._shapes, self.tie_word_embeddings = self._model_facts(model_path)
        self._own_weights_dir = weights_dir is None
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="rollkit-server-weights-"))
        self._weights_file: Path | None = None
        self.policy_version = 0
        self.pad_token_id, self.eos_token_ids = self._special_ids(tokenizer)
        self._jobs: dict[str, _Job] = {}
        self._direct: dict[int, int] = {}  # server -> requests of generate_one in flight
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="rollkit-server")
        self._metrics = _Metrics()
        self.sleep_frees_memory = False
        self.sync = sync
        self.weight_sync = weight_sync

    # the pool's state under the names the engine has always had
    clients = property(lambda self: self.pool.clients)
    local_servers = property(lambda self: self.pool.local_servers)
    _proc = property(lambda self: self.pool.procs)
    _live = property(lambda self: self.pool.live)

    @property
    def restart(self) -> bool:
        return self.pool.restart

    @restart.setter
    def restart(self, value: bool) -> None:
        self.pool.restart = bool(value)

    # ------------------------------------------------------------------ construction

    @classmethod
    def launch(
        cls,
        model_path: str | os.PathLike,
        *,
        num_servers: int = 1,
        run_dir: str | os.PathLike | None = None,
        startup_timeout_s: float = 600.0,
        server_kw: dict[str, Any] | None = None,
        **engine_kw: Any,
    ) -> ServerRolloutEngine:
        """Start ``num_servers`` local servers of ``model_path`` (logs and weights in ``run_dir``,
        default a temporary directory) and connect to them, each with a key of its own;
        ``server_kw``: how to start them (:func:`~trainers.engines.vllm_server.start_server`),
        ``engine_kw``: the constructor's."""
        if not torch.cuda.is_available():  # the local servers are vLLM's CPU build
            config = json.loads((Path(model_path) / "config.json").read_text())
            _check_cpu_head_size(config, model_path)
        run = Path(run_dir or tempfile.mkdtemp(prefix="rollkit-servers-"))
        kw = dict(server_kw or {})
        kw.setdefault("dtype", engine_kw.get("dtype", "float32"))
        servers = launch_servers(model_path, num_servers, run, startup_timeout_s=startup_timeout_s, **kw)
        try:
            return cls(
                [s.url for s in servers],
                model_path=engine_kw.pop("model_path", model_path),
                weights_dir=engine_kw.pop("weights_dir", run / "weights"),
                local_servers=servers,
                restart_kw=dict(
                    kw, model_path=str(model_path), run_dir=str(run), startup_timeout_s=startup_timeout_s
                ),
                **engine_kw,
            )
        except BaseException:
            stop_servers(servers)
            raise

    @staticmethod
    def _model_facts(model_path: Any) -> tuple[dict[str, tuple[int, ...]] | None, bool]:
        if model_path is None:
            return None, False
        path = Path(model_path)
        config = json.loads((path / "config.json").read_text())
        return _checkpoint_shapes(path), bool(config.get("tie_word_embeddings", False))

    @staticmethod
    def _special_ids(tokenizer: Any) -> tuple[int, tuple[int, ...]]:
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        pad = getattr(tokenizer, "pad_token_id", None)
        return (pad if pad is not None else (eos_ids or (0,))[0]), eos_ids

    # ------------------------------------------------------------------ request engine

    @property
    def num_running(self) -> int:
        return len(self._jobs)

    @property
    def num_live_servers(self) -> int:
        return len(self.pool.live)

    def _pick_server(self) -> int:
        """The live server with the fewest outstanding requests (lowest index on ties)."""
        load = dict(self._direct)
        for j in list(self._jobs.values()):
            load[j.server] = load.get(j.server, 0) + 1
        return self.pool.pick(load)

    def add(self, requests: Sequence[Request]) -> None:
        held = set(self._jobs)
        for r in requests:
            _check_text(r.prompt_ids)
            _check_new(r, held)
            held.add(r.request_id)
            self._check_length(r)
        for r in requests:
            self._submit(r, tries=0)

    def _check_length(self, r: Request) -> None:
        need = len(r.prompt_ids) + r.params.max_tokens
        if self.max_model_len is not None and need > self.max_model_len:
            raise ValueError(
                f"request {r.request_id!r}: prompt ({len(r.prompt_ids)} tokens) + max_tokens "
                f"({r.params.max_tokens}) = {need} exceeds the servers' max_model_len {self.max_model_len}"
            )

    def _submit(self, req: Request, tries: int) -> None:
        server = self._pick_server()
        job = _Job(req, server, f"{req.request_id}-{uuid.uuid4().hex[:8]}", self.policy_version, tries=tries)
        self._jobs[req.request_id] = job
        self._metrics.requests += 1
        url = self.clients[server].url
        self._metrics.by_server[url] = self._metrics.by_server.get(url, 0) + 1
        job.future = self._pool.submit(self._run, job)

    def _run(self, job: _Job) -> None:
        """Worker thread: stream one segment and append its tokens to the request."""
        req = job.req
        seed = _continuation_seed(req) if self.seeded else None
        body = {
            "request_id": job.rid,
            "token_ids": [int(t) for t in req.prompt_ids] + [int(t) for t in req.token_ids],
            "sampling_params": _sampling_body(req.params, req.remaining, seed),
        }
        client = self.clients[job.server]
        for event in client.stream(_GENERATE, body, timeout=self.request_timeout_s):
            for c in event.get("choices", ()):
                ids = [int(t) for t in c.get("token_ids") or ()]
                content = (c.get("logprobs") or {}).get("content") or []
                if len(content) != len(ids):
                    raise ServerError(
                        f"server {client.url}: request {req.request_id!r} returned {len(ids)} tokens "
                        f"with {len(content)} log-probs (start it with --logprobs-mode processed_logprobs)"
                    )
                with self._lock:
                    if job.detached:
                        return
                    if c.get("finish_reason"):
                        job.final_from = len(req.token_ids)
                    req.token_ids += ids
                    req.logprobs += [float(x["logprob"]) for x in content]
                    req.token_versions += [job.version] * len(ids)
                    if c.get("finish_reason"):
                        job.finish = str(c["finish_reason"])

    def step(self, timeout: float = 0.5) -> list[Request]:
        """Wait up to ``timeout`` seconds for requests to finish; return those that did
        (requests of a failed server continue on another one and are not returned yet)."""
        if not self._jobs:
            return []
        wait([j.future for j in self._jobs.values()], timeout=timeout, return_when=FIRST_COMPLETED)
        done: list[Request] = []
        for rid, job in list(self._jobs.items()):
            if not job.future.done():
                continue
            del self._jobs[rid]
            exc = job.future.exception()
            if exc is None and job.finish in ("stop", "length"):
                job.req.finish_reason = job.finish
                done.append(job.req)
            elif isinstance(exc, ServerError) and exc.status is not None and 400 <= exc.status < 500:
                self._metrics.errors += 1
                raise ServerError(f"request {rid!r}: {exc}", exc.status)
            elif exc is not None and not isinstance(exc, ServerError):
                raise exc
            else:
                why = str(exc) if exc is not None else f"finished with {job.finish!r}"
                self._reroute(job, why)
        return done

    def _failed(self, job: _Job, why: str) -> None:
        """A request's server failed: drop the server if it no longer answers ``/health``;
        raise once the request has failed ``max_retries + 1`` times."""
        self._metrics.errors += 1
        if not self.pool.healthy(job.server):
            self.pool.drop(job.server, why)
        if job.tries >= self.max_retries:
            raise ServerError(f"request {job.req.request_id!r} failed {job.tries + 1} times; last: {why}")
        self._metrics.rerouted += 1

    def _reroute(self, job: _Job, why: str) -> None:
        """Continue a request whose server failed on another live server, from its last token."""
        self._failed(job, why)
        self._submit(job.req, tries=job.tries + 1)

    def generate_one(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """One sample (``params.n`` is ignored) generated on the calling thread: safe to call from
        many threads at once (an HTTP endpoint's handlers), apart from :meth:`add` / :meth:`step`.
        Routed, re-routed and checked like a request."""
        req = Request(
            f"one-{uuid.uuid4().hex[:12]}", [int(t) for t in prompt_ids], dataclasses.replace(params, n=1)
        )
        _check_new(req, set())
        self._check_length(req)
        tries = 0
        while True:
            with self._lock:
                server = self._pick_server()
                self._direct[server] = self._direct.get(server, 0) + 1
                self._metrics.requests += 1
            job = _Job(req, server, f"{req.request_id}-{tries}", self.policy_version, tries=tries)
            try:
                self._run(job)
                exc: ServerError | None = None
            except ServerError as e:
                exc = e
            finally:
                with self._lock:
                    self._direct[server] -= 1
            if exc is None and job.finish in ("stop", "length"):
                req.finish_reason = job.finish
                return dataclasses.replace(req.to_generation(0), policy_version=job.version)
            if exc is not None and exc.status is not None and 400 <= exc.status < 500:
                raise ServerError(f"request {req.request_id!r}: {exc}", exc.status)
            with self._lock:
                self._failed(job, str(exc) if exc is not None else f"finished with {job.finish!r}")
            tries += 1

    def _load_current_weights(self, client: ServerClient) -> None:
        """A replacement server takes the weights the others have (the pool's ``on_replace``).

        ``weight_sync`` buckets / delta keep no file to reload: a replacement of a server that
        served trained weights waits (out of the rotation) for the next sync, which sends it
        everything."""
        if self.weight_sync != "reload":
            self.sync.wait_for_weights(client, self.policy_version, self._reload_timeout + 600.0)
        elif self._weights_file is not None:
            reload_weights_on(client, self.weights_dir, self.policy_version, self._reload_timeout)

    def abort(self, request_ids: Iterable[str] | None = None) -> list[Request]:
        ids = list(self._jobs) if request_ids is None else [i for i in request_ids if i in self._jobs]
        if not ids:
            return []
        jobs = [self._jobs.pop(i) for i in ids]
        with self._lock:
            for j in jobs:
                j.detached = True
                if j.finish is not None:  # finished but not collected: back to before its last chunk
                    n = j.final_from
                    del j.req.token_ids[n:], j.req.logprobs[n:], j.req.token_versions[n:]
        by_server: dict[int, list[str]] = {}
        for j in jobs:
            by_server.setdefault(j.server, []).append(f"generate-tokens-{j.rid}")
        for s, rids in by_server.items():
            if s in self.pool.live:
                try:
                    self.clients[s].post("/abort_requests", {"request_ids": rids}, timeout=self.timeout_s)
                except ServerError:
                    self._metrics.errors += 1
        return [j.req for j in jobs]

    # ------------------------------------------------------------------ batch interface

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """``params.n`` samples per prompt; ``out[i * n + j]`` is sample ``j`` of prompt ``i``
        (sample ``j`` seeded with ``prompt_seed(params.seed, i) + j``, a stream per prompt). Do not
        mix with running requests."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        for p in prompts:
            _check_text(p)
        if not prompts:
            return []
        seed = params.seed if params.seed is not None else random.randrange(2**62)
        tag = uuid.uuid4().hex[:8]
        reqs = [
            Request(
                f"gen-{tag}-{i}-{j}",
                [int(t) for t in p],
                dataclasses.replace(params, n=1, seed=prompt_seed(seed, i) + j),
            )
            for i, p in enumerate(prompts)
            for j in range(params.n)
        ]
        self.add(reqs)
        order = {r.request_id: k for k, r in enumerate(reqs)}
        out: list[Generation | None] = [None] * len(reqs)
        try:
            while self._jobs:
                for r in self.step():
                    k = order[r.request_id]
                    out[k] = dataclasses.replace(
                        r.to_generation(k // params.n), policy_version=self.policy_version
                    )
        except BaseException:
            self.abort([r.request_id for r in reqs])
            raise
        return [g for g in out if g is not None]

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Send new weights to every live server without restarting it; set ``policy_version``.

        The names and shapes are checked against ``model_path`` before anything is sent; the
        tensors are written as one safetensors file in ``weights_dir`` (cast to ``dtype``), which
        each server reloads through ``POST /collective_rpc`` (rollkit's worker extension:
        ``reload_weights`` plus the CPU tied-head refresh), then ``/reset_prefix_cache`` and
        ``/update_weight_version``. Refused while requests run. A server that fails is dropped.
        """
        if self._jobs:
            raise RuntimeError(f"update_weights: {len(self._jobs)} requests are running; abort them first")
        if self.weight_sync != "reload":
            t0 = time.perf_counter()
            self.sync.push(self, named_tensors, version)
            self.policy_version = int(version)
            self._metrics.weight_updates += 1
            self._metrics.weight_update_s += time.perf_counter() - t0
            return
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        weights = weights_to_send(named_tensors, self._shapes, self.tie_word_embeddings, self.dtype)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.weights_dir / "model.safetensors.tmp"
        save_file(weights, str(tmp))
        os.replace(tmp, self.weights_dir / "model.safetensors")
        self._weights_file = self.weights_dir / "model.safetensors"
        for i in sorted(self.pool.live):
            try:
                reload_weights_on(self.clients[i], self.weights_dir, version, self._reload_timeout)
            except ServerError as e:
                self.pool.drop(i, str(e))
        if not self.pool.live:
            last = f"; last: {self.pool.causes[-1]}" if self.pool.causes else ""
            raise ServerError(
                f"update_weights: no live server took the weights ({self.pool.dropped} dropped{last})"
            )
        self.policy_version = int(version)
        self._metrics.weight_updates += 1
        self._metrics.weight_update_s += time.perf_counter() - t0

    @property
    def _reload_timeout(self) -> float:
        return max(self.request_timeout_s, 60.0)

    # ------------------------------------------------------------------ health, memory, shutdown

    def check_health(self) -> int:
        """``GET /health`` on every live server; drop those that fail. Returns the live count."""
        return self.pool.check_health()

    def metrics(self) -> dict[str, Any]:
        """``server/*`` counters: live and dropped servers, restarts, re-routed requests, errors,
        weight updates and their mean seconds; once a server was dropped, ``server/drop_cause``
        (a string: the latest drop's exit code and the error lines of its log)."""
        m = self._metrics
        return {
            **self.pool.metrics(),
            "server/requests": float(m.requests),
            "server/rerouted": float(m.rerouted),
            "server/errors": float(m.errors),
            "server/weight_updates": float(m.weight_updates),
            "server/weight_update_s": m.weight_update_s / max(m.weight_updates, 1),
            **self.sync.metrics(),
        }

    def requests_per_server(self) -> dict[str, int]:
        """How many request segments each server was given (by address)."""
        return dict(self._metrics.by_server)

    def sleep(self, level: int = 1) -> None:
        """Nothing to free in the trainer's process: the servers are other processes."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")

    def wake(self) -> None:
        """Undo :meth:`sleep` (nothing to do)."""

    def shutdown(self) -> None:
        """Abort what runs, stop the servers rollkit started, remove a private weights directory."""
        if self._jobs:
            self.abort()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.sync.close()
        self.pool.close()
        if self._own_weights_dir:
            import shutil

            shutil.rmtree(self.weights_dir, ignore_errors=True)

    close = shutdown

    def __enter__(self) -> ServerRolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def build_server_rollout(cfg: Any, model: Any, tokenizer: Any, *, device: str) -> ServerRolloutEngine:
    """``rollout.engine=server``: a :class:`~trainers.engines.server_rollout.ServerRolloutEngine`
    over ``rollout.servers`` (which then get ``model``'s weights, version 0) or over
    ``rollout.num_servers`` local ``vllm serve`` processes of ``model``. The model, the server
    logs and the weight files live in ``rollout.server_dir`` (``""``: a temporary directory that
    lives as long as the engine, ``engine.model_dir``)."""
    r = cfg.rollout
    tmp = None
    if r.server_dir:
        run = Path(r.server_dir)
        run.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="rollkit-servers-")
        run = Path(tmp.name)
    model_path = save_model(model, tokenizer, run / "model")
    dtype = dtype_name(rollout_dtype(cfg, device))
    kw = dict(
        tokenizer=tokenizer,
        timeout_s=r.server_timeout_s,
        request_timeout_s=r.server_request_timeout_s,
        weights_dir=run / "weights",
        dtype=dtype,
        # vLLM's CPU sampler cannot rewind a seeded generator over a split prefill (see
        # trainers.engines.requests.VLLMRequestEngine): CPU servers sample unseeded
        seeded=torch.cuda.is_available(),
        weight_sync=r.weight_sync,
        weight_bucket_mb=r.weight_bucket_mb,
        weight_check=r.weight_check,
        weight_sync_host=r.weight_sync_host,
    )
    addresses = server_addresses(r.servers)
    if addresses:
        eng = ServerRolloutEngine(addresses, model_path=model_path, **kw)
        eng.update_weights(model.named_parameters(), version=0)
    else:
        eng = ServerRolloutEngine.launch(
            model_path,
            num_servers=r.num_servers,
            run_dir=run,
            startup_timeout_s=r.server_startup_timeout_s,
            server_kw=dict(
                max_model_len=r.max_model_len,
                seed=cfg.seed,
                kv_cache_gib=r.server_kv_cache_gib,
                tensor_parallel_size=r.tensor_parallel_size,
            ),
            **kw,
        )
    eng.model_dir = tmp  # removed with the engine
    return eng

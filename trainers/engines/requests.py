"""Request-level rollout: one sample per request, added, advanced, finished or aborted one by one.

The batch interface (:class:`~trainers.engines.base.RolloutEngine.generate`) runs a whole batch
to its end. Asynchronous training, queue scheduling and tail batching need finer control:
start a request whenever a slot frees, collect each one the moment it finishes, stop the ones
no longer wanted, and, across a weight update, *keep* what a request generated so far and
continue it under the new weights (ROLL Flash, Lu et al. 2025, arXiv:2510.11345; RollPacker,
Gao et al. 2025, arXiv:2509.21009). A :class:`RequestEngine` does that::

    engine.add([Request("a", prompt_ids, SamplingParams(max_tokens=64, seed=1))])
    while engine.num_running:
        for req in engine.step():       # the requests that finished during this step
            ...                         # req.token_ids, req.logprobs, req.finish_reason
    partial = engine.abort(["b"])       # stopped: the tokens generated so far are kept
    engine.update_weights(weights, version=1)      # only with nothing running
    engine.add(partial)                 # continues after its last token, new weights

A :class:`Request` carries its own progress: ``token_ids`` / ``logprobs`` (the processed
log-prob of each token under the policy that sampled it, as in :class:`~trainers.engines.base.
Generation`) and ``token_versions`` (the engine's ``policy_version`` when each token was
sampled). Adding a request that already has tokens continues it: the engine's prompt is
``prompt_ids + token_ids`` and it samples at most ``params.max_tokens - len(token_ids)`` more,
so a finished request has the same length budget however often it was stopped and resumed.
``start_version`` is set by the caller (the version that *started* the sample, the one the
freshness bound of :class:`rollkit.buffer.SampleBuffer` uses) and never changed by the engine.

Two implementations over the existing engines:

* :class:`VLLMRequestEngine`: vLLM's own continuous batching (``LLMEngine.add_request`` /
  ``step`` / ``abort_request``, outputs streamed as deltas so an aborted request keeps its
  tokens).
* :class:`HFRequestEngine`: the embedded default. Each :meth:`~HFRequestEngine.step` takes up
  to ``max_batch_size`` running requests (oldest first), prefills their prompts and tokens so
  far, and decodes up to ``chunk_tokens`` tokens for all of them with a KV cache; requests
  added meanwhile join at the next step. Continuous batching at a granularity of
  ``chunk_tokens`` tokens.

:class:`RequestEnginePool` puts several request engines (e.g. one
:class:`~trainers.ray.RayRequestEngine` per Ray rollout actor) behind one: tail batching drives
every rollout actor through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from trainers.engines.base import Generation, SamplingParams
from trainers.engines.hf_rollout import decode_step, prefill, sample_tokens

__all__ = [
    "HFRequestEngine",
    "Request",
    "RequestEngine",
    "RequestEnginePool",
    "VLLMRequestEngine",
    "as_request_engine",
]


@dataclass
class Request:
    """One sample to generate (``params.n`` must be 1: a prompt with ``n`` samples is ``n``
    requests, *prompt replication*).

    Attributes:
        request_id: unique among the requests an engine holds.
        prompt_ids: the prompt's token ids (at least one).
        params: sampling parameters; ``max_tokens`` is the budget of the whole response.
        start_version: the policy version that started the sample (set by the caller).
        token_ids, logprobs, token_versions: the response so far, the processed log-prob of
            each token and the engine ``policy_version`` that sampled it.
        finish_reason: ``"stop"`` (a stop token, the last of ``token_ids``) or ``"length"``
            once finished; ``None`` while running or after an abort.
        tag: the caller's bookkeeping (e.g. which prompt and sample this is); not read.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    start_version: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reason: Literal["stop", "length"] | None = None
    tag: Any = None

    @property
    def remaining(self) -> int:
        """Tokens the request may still generate."""
        return self.params.max_tokens - len(self.token_ids)

    @property
    def resumed(self) -> bool:
        """Whether more than one policy version sampled this response."""
        return len(set(self.token_versions)) > 1

    def to_generation(self, prompt_index: int = 0) -> Generation:
        """The finished request as a :class:`~trainers.engines.base.Generation` whose
        ``policy_version`` is the *start* version."""
        if self.finish_reason is None:
            raise ValueError(f"request {self.request_id!r} is not finished")
        return Generation(
            prompt_index=prompt_index,
            prompt_ids=list(self.prompt_ids),
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason,
            policy_version=self.start_version,
        )


def _check_new(req: Request, held: set[str]) -> None:
    if not isinstance(req, Request):
        raise TypeError(f"requests: expected Request objects, got {type(req).__name__}")
    if req.request_id in held:
        raise ValueError(f"requests: request_id {req.request_id!r} is already running")
    if req.params.n != 1:
        raise ValueError(
            f"requests: request {req.request_id!r} has params.n={req.params.n}; a request is one "
            "sample (make n requests for n samples)"
        )
    if not req.prompt_ids:
        raise ValueError(f"requests: request {req.request_id!r} has an empty prompt")
    if req.finish_reason is not None:
        raise ValueError(f"requests: request {req.request_id!r} is already finished")
    if req.remaining < 1:
        raise ValueError(
            f"requests: request {req.request_id!r} has no token budget left "
            f"({len(req.token_ids)} tokens, max_tokens={req.params.max_tokens})"
        )
    if not (len(req.token_ids) == len(req.logprobs) == len(req.token_versions)):
        raise ValueError(
            f"requests: request {req.request_id!r} has {len(req.token_ids)} tokens, "
            f"{len(req.logprobs)} log-probs and {len(req.token_versions)} versions"
        )


@runtime_checkable
class RequestEngine(Protocol):
    """A rollout engine driven one request at a time (module docstring)."""

    policy_version: int

    @property
    def num_running(self) -> int:
        """Requests added and neither finished nor aborted (the load, for least-loaded dispatch)."""
        ...

    def add(self, requests: Sequence[Request]) -> None:
        """Start (or continue) requests; they advance at the next :meth:`step`."""
        ...

    def step(self) -> list[Request]:
        """Advance the running requests; return those that finished (``finish_reason`` set)."""
        ...

    def abort(self, request_ids: Iterable[str] | None = None) -> list[Request]:
        """Stop requests (all if ``None``; unknown ids are ignored) and return them with the
        tokens generated so far (``finish_reason`` stays ``None``): add them again to continue."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load new weights (the underlying engine's ``update_weights``); refused while requests
        run: abort them first (and add them again after)."""
        ...


def _continuation_seed(req: Request) -> int | None:
    """The seed for the next segment of a request: its own seed for a fresh request, a seed
    derived from it and the tokens so far when it continues (a new random stream)."""
    s = req.params.seed
    if s is None:
        return None
    return (s + 1_000_003 * len(req.token_ids)) % (2**62)


class _RequestEngineBase:
    """What both request engines share: the running requests, the checks of ``add``, the
    version and the weight-update guard."""

    engine: Any
    _running: dict[str, Any]

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def num_running(self) -> int:
        return len(self._running)

    def _check_add(self, requests: Sequence[Request]) -> None:
        held = set(self._running)
        for r in requests:
            _check_new(r, held)
            held.add(r.request_id)

    def _ids_to_abort(self, request_ids: Iterable[str] | None) -> list[str]:
        return list(self._running) if request_ids is None else [i for i in request_ids if i in self._running]

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        if self._running:
            raise RuntimeError(f"update_weights: {len(self._running)} requests are running; abort them first")
        self.engine.update_weights(named_tensors, version)


# --------------------------------------------------------------------------- vLLM


class VLLMRequestEngine(_RequestEngineBase):
    """:class:`RequestEngine` over a :class:`~trainers.engines.vllm_rollout.VLLMRolloutEngine`.

    Each request is one vLLM request (``n=1``, the request's seed, a continued request a
    derived seed; on CPU unseeded, see ``seeded``) whose output is streamed as deltas (``RequestOutputKind.DELTA``), so the
    tokens and log-probs of an aborted request are kept. :meth:`step` is one
    ``LLMEngine.step()``: vLLM schedules every running request (continuous batching, chunked
    prefill), with the engine's current LoRA adapter if it serves one (``lora_request``). Use the
    rollout engine only through this object while requests run.
    """

    def __init__(self, engine: Any) -> None:
        from vllm.platforms import current_platform
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self._delta = RequestOutputKind.DELTA
        # vLLM rewinds a seeded request's generator when it splits a prefill over several steps
        # (many requests, or long continued ones), which the CPU generator cannot do ("CPU
        # Generator does not use offset"): on CPU, requests are sampled unseeded.
        self.seeded = not current_platform.is_cpu()
        self._running: dict[str, tuple[Request, str]] = {}  # request_id -> (request, vLLM internal id)

    def add(self, requests: Sequence[Request]) -> None:
        self._check_add(requests)
        self.engine._check_can_generate([r.prompt_ids for r in requests])
        core = self.engine.llm.llm_engine
        for r in requests:
            p = dataclasses.replace(r.params, n=1, max_tokens=r.remaining, seed=_continuation_seed(r))
            vp = self.engine._vllm_params(p)
            if not self.seeded:
                vp.seed = None
            vp.output_kind = self._delta
            prompt = {"prompt_token_ids": [int(t) for t in r.prompt_ids] + [int(t) for t in r.token_ids]}
            internal = core.add_request(r.request_id, prompt, vp, lora_request=self.engine.lora_request)
            self._running[r.request_id] = (r, internal)

    def step(self) -> list[Request]:
        if not self._running:
            return []
        version = self.engine.policy_version
        done: list[Request] = []
        for out in self.engine.llm.llm_engine.step():
            entry = self._running.get(out.request_id)
            if entry is None:
                continue  # an aborted request's last output
            r = entry[0]
            if len(out.outputs) != 1:
                raise RuntimeError(f"vLLM returned {len(out.outputs)} outputs for request {r.request_id!r}")
            c = out.outputs[0]
            ids = list(c.token_ids)
            if ids:
                if c.logprobs is None or len(c.logprobs) != len(ids):
                    raise RuntimeError(f"vLLM returned no per-token log-probs for request {r.request_id!r}")
                r.token_ids += ids
                r.logprobs += [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(ids)]
                r.token_versions += [version] * len(ids)
            if out.finished:
                r.finish_reason = self.engine._finish_reason(c.finish_reason, r.token_ids, r.params)
                del self._running[r.request_id]
                done.append(r)
        return done

    def abort(self, request_ids: Iterable[str] | None = None) -> list[Request]:
        ids = self._ids_to_abort(request_ids)
        if not ids:
            return []
        out = [self._running.pop(i) for i in ids]
        self.engine.llm.llm_engine.abort_request([internal for _, internal in out], internal=True)
        return [r for r, _ in out]


# --------------------------------------------------------------------------- transformers


class HFRequestEngine(_RequestEngineBase):
    """:class:`RequestEngine` over an :class:`~trainers.engines.hf_rollout.HFRolloutEngine`.

    Args:
        engine: the batch engine (its model, tokenizer, EOS tokens, ``update_weights``).
        chunk_tokens: the most tokens a request advances per :meth:`step`.
        max_batch_size: the most requests advanced per step, oldest first (``None``: all).
        seed: seeds the sampler (the requests' own seeds are not used: rows share one
            generator per step, so a sample depends on its batch; runs are reproducible for
            the same calls).

    A step groups the running requests by sampling settings (temperature, top-k, top-p, stop
    tokens) and advances the group of the oldest request: one prefill of ``prompt + tokens so
    far`` (left-padded, the layout of :func:`trainers.engines.base.pack`), then up to
    ``chunk_tokens`` decoding steps with the KV cache; a row stops at a stop token or at its own
    ``max_tokens``, and the step ends early once every row has stopped. Log-probs follow
    :func:`trainers.engines.hf_rollout.process_logits` (the processed distribution).
    """

    def __init__(
        self, engine: Any, *, chunk_tokens: int = 16, max_batch_size: int | None = None, seed: int = 0
    ) -> None:
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be None or an int >= 1, got {max_batch_size!r}")
        self.engine = engine
        self.chunk_tokens = chunk_tokens
        self.max_batch_size = max_batch_size
        self._running: dict[str, Request] = {}
        self._gen = torch.Generator(device=engine.device).manual_seed(seed)

    def add(self, requests: Sequence[Request]) -> None:
        self._check_add(requests)
        if self.engine._sleep_level:
            raise RuntimeError("the engine is asleep: call wake() first")
        if self.engine._needs_weights:
            raise RuntimeError("weights were discarded by sleep(level=2): call update_weights() first")
        for r in requests:
            self._running[r.request_id] = r

    def _stop_set(self, p: SamplingParams) -> tuple[int, ...]:
        stop = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop.update(self.engine.eos_token_ids)
        return tuple(sorted(stop))

    def _key(self, r: Request) -> tuple:
        p = r.params
        return (p.temperature, p.top_k, p.top_p, self._stop_set(p))

    @torch.inference_mode()
    def step(self) -> list[Request]:
        if not self._running:
            return []
        first = next(iter(self._running.values()))
        key = self._key(first)
        rows = [r for r in self._running.values() if self._key(r) == key]
        if self.max_batch_size is not None:
            rows = rows[: self.max_batch_size]
        eng, dev = self.engine, self.engine.device
        temperature, top_k, top_p, stop = key
        stop_t = torch.tensor(stop, dtype=torch.long, device=dev)
        B = len(rows)
        prefixes = [list(r.prompt_ids) + list(r.token_ids) for r in rows]
        mask, pos, cache, logits = prefill(eng.model, prefixes, eng.pad_token_id, dev)
        budget = torch.tensor([min(r.remaining, self.chunk_tokens) for r in rows], device=dev)
        K = int(budget.max())
        toks = torch.full((B, K), eng.pad_token_id, dtype=torch.long, device=dev)
        lps = torch.zeros((B, K), dtype=torch.float32, device=dev)
        n_new = budget.clone()  # tokens each row takes from this step
        stopped = torch.zeros(B, dtype=torch.bool, device=dev)  # hit a stop token
        active = torch.ones(B, dtype=torch.bool, device=dev)
        pos = pos[:, -1:]
        for t in range(K):
            tok, tok_lp = sample_tokens(
                logits, temperature, top_k, top_p, self._gen, ~active, eng.pad_token_id
            )
            toks[:, t], lps[:, t] = tok, tok_lp
            hit = torch.isin(tok, stop_t) & active
            n_new = torch.where(hit, t + 1, n_new)
            stopped |= hit
            active &= ~hit & (budget > t + 1)
            if t == K - 1 or not bool(active.any()):
                break
            mask, pos, cache, logits = decode_step(eng.model, tok, mask, pos, cache)
        toks, lps, n_new, stopped = toks.cpu(), lps.cpu(), n_new.tolist(), stopped.tolist()
        version, done = eng.policy_version, []
        for b, r in enumerate(rows):
            k = n_new[b]
            r.token_ids += toks[b, :k].tolist()
            r.logprobs += lps[b, :k].tolist()
            r.token_versions += [version] * k
            if stopped[b] or r.remaining <= 0:
                r.finish_reason = "stop" if stopped[b] else "length"
                del self._running[r.request_id]
                done.append(r)
        return done

    def abort(self, request_ids: Iterable[str] | None = None) -> list[Request]:
        return [self._running.pop(i) for i in self._ids_to_abort(request_ids)]

    def state_dict(self) -> dict[str, Any]:
        """The sampler's generator state (with nothing running, the whole state of the view)."""
        if self._running:
            raise RuntimeError(f"state_dict: {len(self._running)} requests are running; abort them first")
        return {"generator": self._gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._gen.set_state(state["generator"])


class RequestEnginePool:
    """Several request engines behind one :class:`RequestEngine`.

    :meth:`add` gives each request to the engine with the fewest running requests (the lowest
    index on ties); :meth:`step` first starts every engine's step where it can start one
    without waiting (``start_step``, as :class:`~trainers.ray.RayRequestEngine` has: the Ray
    actors then step at the same time), then collects each engine's step in order, and returns
    what finished, in engine order; :meth:`abort` stops each request on the engine that holds
    it. ``policy_version`` is the oldest of the engines'.

    >>> from trainers.engines.hf_rollout import HFRolloutEngine
    >>> from trainers.models import char_tokenizer, tiny_qwen2
    >>> tok = char_tokenizer()
    >>> engines = [HFRequestEngine(HFRolloutEngine(tiny_qwen2(tok), tok), seed=k) for k in range(2)]
    >>> pool = RequestEnginePool(engines)
    >>> pool.add([Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=3, seed=i)) for i in range(3)])
    >>> [e.num_running for e in engines], pool.num_running
    ([2, 1], 3)
    >>> done = []
    >>> while pool.num_running:
    ...     done += pool.step()
    >>> sorted(r.request_id for r in done), [len(r.token_ids) for r in done]
    (['r0', 'r1', 'r2'], [3, 3, 3])
    """

    def __init__(self, engines: Sequence[Any]) -> None:
        self.engines = list(engines)
        if not self.engines:
            raise ValueError("engines: a pool needs at least one request engine")
        self._owner: dict[str, int] = {}  # request id -> index of the engine that holds it

    @property
    def policy_version(self) -> int:
        return min(int(e.policy_version) for e in self.engines)

    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.engines)

    def add(self, requests: Sequence[Request]) -> None:
        requests = list(requests)
        held = set(self._owner)
        for r in requests:
            _check_new(r, held)
            held.add(r.request_id)
        load = [e.num_running for e in self.engines]
        parts: list[list[Request]] = [[] for _ in self.engines]
        for r in requests:
            k = min(range(len(load)), key=lambda i: (load[i], i))
            parts[k].append(r)
            load[k] += 1
        for k, part in enumerate(parts):
            if part:
                self.engines[k].add(part)
                self._owner.update((r.request_id, k) for r in part)

    def step(self) -> list[Request]:
        busy = [e for e in self.engines if e.num_running]
        for e in busy:
            start = getattr(e, "start_step", None)
            if start is not None:
                start()
        done: list[Request] = []
        error: BaseException | None = None
        for e in busy:  # every started step is collected, also after one of them failed
            try:
                done += e.step()
            except BaseException as exc:  # re-raised below, once every step is collected
                error = error or exc
        for r in done:
            self._owner.pop(r.request_id, None)
        if error is not None:
            raise error
        return done

    def abort(self, request_ids: Iterable[str] | None = None) -> list[Request]:
        if request_ids is None:
            stopped = [r for e in self.engines for r in e.abort(None)]
        else:
            by_engine: dict[int, list[str]] = {}
            for i in request_ids:
                if i in self._owner:
                    by_engine.setdefault(self._owner[i], []).append(i)
            stopped = [r for k, ids in by_engine.items() for r in self.engines[k].abort(ids)]
        for r in stopped:
            self._owner.pop(r.request_id, None)
        return stopped

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load the same weights into every engine (each refuses while it runs requests)."""
        weights = list(named_tensors)
        for e in self.engines:
            e.update_weights(weights, version)


def as_request_engine(engine: Any, *, chunk_tokens: int = 16, seed: int = 0) -> RequestEngine:
    """The request-level view of a batch rollout engine: a :class:`VLLMRequestEngine` for a
    ``VLLMRolloutEngine``, an :class:`HFRequestEngine` for an ``HFRolloutEngine``; a
    :class:`RequestEngine` is returned as is."""
    if isinstance(engine, (HFRequestEngine, VLLMRequestEngine)):
        return engine
    name = type(engine).__name__
    if name == "VLLMRolloutEngine":
        return VLLMRequestEngine(engine)
    if name == "HFRolloutEngine":
        return HFRequestEngine(engine, chunk_tokens=chunk_tokens, seed=seed)
    if isinstance(engine, RequestEngine):
        return engine
    raise TypeError(f"engine: no request-level view of {name} (expected an HF or vLLM rollout engine)")

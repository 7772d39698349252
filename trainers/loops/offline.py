"""Offline SFT and preference training (DPO, IPO, SimPO, ORPO) over a JSONL / Parquet file,
through the same training engines as the RL loops, and reward-model training on the same pairs.

:class:`OfflineTrainer` takes ``offline.batch_size`` examples (or pairs) per optimizer step, in
micro-batches of ``train.micro_batch_size`` examples (pairs), each loss aggregated with rollkit's
global normalisers of the whole batch, so the step's gradient does not depend on the split.
DPO and IPO score the pairs with a frozen reference engine too (a copy of the initial policy
unless one is given); SimPO and ORPO need none. Metrics carry TRL's names (``loss``,
``rewards/chosen``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``grad_norm``,
``learning_rate``). Guide: ``docs/offline.md``.

``offline.loss=rm`` trains a **reward model** instead of a policy: the checkpoint with a scalar
head (``AutoModelForSequenceClassification``, ``num_labels=1``; :func:`build_reward_model`)
scores the chosen and rejected responses of each pair, and
:func:`rollkit.losses.bradley_terry` (``-log sigma(r_chosen - r_rejected)``) is the loss;
``eval/accuracy`` is the share of held-out pairs with ``r(chosen) > r(rejected)``. The saved
model is what :class:`~trainers.rewards.RewardModelVerifier` loads
(``reward.verifier=reward_model reward.rm_path=...``); guide: ``docs/rewards-workers.md``.
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from rollkit.losses import (
    aggregate,
    aggregate_pairs,
    bradley_terry,
    dpo,
    global_normalizers,
    ipo,
    orpo,
    sequence_logprobs,
    sft_nll,
    simpo,
)
from rollkit.types import LossOutput
from trainers.config import (
    OFFLINE_LOSSES,
    PREFERENCE_LOSSES,
    REFERENCE_LOSSES,
    OfflineAlgorithmConfig,
    OfflineConfig,
    OfflineDataConfig,
    validate_offline,
)
from trainers.data import Prompt, PromptIterator, encode_prompt
from trainers.data_pairs import Example, Pair, load_examples, load_pairs
from trainers.deps import require
from trainers.engines.base import PackedBatch, TrainEngine, pack
from trainers.engines.build import build_model, frozen_reference, make_train_engine, parse_dtype
from trainers.loops.common import read_checkpoint, run_fit, write_checkpoint
from trainers.rewards.reward_model import (
    encode_reward_input,
    is_reward_checkpoint,
    reward_model_from_lm,
    reward_scores,
)

__all__ = [
    "OFFLINE_LOSSES",
    "OfflineAlgorithmConfig",
    "OfflineConfig",
    "OfflineDataConfig",
    "OfflineTrainer",
    "build_reward_model",
    "frozen_copy",
    "load_offline_data",
    "preference_loss",
    "validate_offline",
]

def load_offline_data(cfg: OfflineConfig) -> tuple[list[Any], list[Any]]:
    """``(train, held_out)`` examples (``offline.loss=sft``) or pairs of ``data.train_file`` /
    ``data.eval_file`` (else the first ``data.eval_size`` records held out)."""
    d = cfg.data
    if not d.train_file:
        raise ValueError("data.train_file: required (a JSONL / Parquet file; recipes/sft_dpo.py writes one)")
    load = load_examples if cfg.offline.loss == "sft" else load_pairs
    train = load(d.train_file, field="data.train_file")
    if d.eval_file:
        return train, load(d.eval_file, field="data.eval_file")
    if d.eval_size >= len(train):
        raise ValueError(
            f"data.eval_size={d.eval_size}: {d.train_file} has {len(train)} records; "
            "set a smaller data.eval_size or a data.eval_file"
        )
    return train[d.eval_size :], train[: d.eval_size]


def frozen_copy(engine: TrainEngine) -> TrainEngine:
    """A frozen reference behind the same ``logprobs``
    (:func:`trainers.engines.build.frozen_reference`: a torch engine's shallow copy with a deep
    copy of its model; any other engine's exported weights in a fresh model)."""
    return frozen_reference(engine)


def preference_loss(
    name: str,
    chosen: torch.Tensor,  # [P] summed log-probs, carry the gradient
    rejected: torch.Tensor,  # [P]
    ref_chosen: torch.Tensor | None,  # [P] (dpo / ipo)
    ref_rejected: torch.Tensor | None,  # [P]
    chosen_len: torch.Tensor,  # [P] token counts
    rejected_len: torch.Tensor,  # [P]
    o: OfflineAlgorithmConfig,
) -> LossOutput:
    """The ``[P]`` loss of ``offline.loss`` ``name`` (rollkit.losses.preference), with ``o``'s
    hyper-parameters. IPO is length-normalised (TRL's ``loss_type="ipo"``)."""
    if name == "dpo":
        return dpo(chosen, rejected, ref_chosen, ref_rejected, beta=o.beta, label_smoothing=o.label_smoothing)
    if name == "ipo":
        return ipo(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len, beta=o.beta)
    if name == "simpo":
        return simpo(
            chosen,
            rejected,
            chosen_len,
            rejected_len,
            beta=o.beta,
            gamma=o.gamma,
            label_smoothing=o.label_smoothing,
        )
    if name == "orpo":
        return orpo(chosen, rejected, chosen_len, rejected_len, beta=o.beta, nll_weight=o.nll_weight)
    raise ValueError(
        f"offline.loss: {name!r} is not a preference loss; known: {', '.join(PREFERENCE_LOSSES)}"
    )


def build_reward_model(cfg: OfflineConfig, *, model: Any = None, tokenizer: Any = None) -> tuple[Any, Any]:
    """``(reward model, tokenizer)`` for ``offline.loss=rm``: ``model`` (a causal LM, with
    ``tokenizer``) or ``cfg.model``'s checkpoint with a new scalar head (a ``num_labels=1``
    ``AutoModelForSequenceClassification`` over its backbone, the head initialised from
    ``cfg.seed``, ``pad_token_id`` set: the tokenizer's pad token, else EOS); a
    sequence-classification checkpoint (a reward model trained before) loads with its head."""
    path = cfg.model.path
    if model is None and path not in ("", "tiny") and is_reward_checkpoint(path):
        transformers = require("transformers")
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            path, dtype=parse_dtype(cfg.model.dtype)
        )
        if model.config.num_labels != 1:
            raise ValueError(
                f"model.path: {path} scores {model.config.num_labels} labels; a reward model has 1"
            )
        return model, transformers.AutoTokenizer.from_pretrained(path)
    if model is None:
        model, tokenizer = build_model(cfg)
    if tokenizer is None:
        raise ValueError("tokenizer: required with model")
    if type(model).__name__.endswith("ForSequenceClassification"):
        return model, tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return reward_model_from_lm(model, pad, seed=cfg.seed), tokenizer


class _Sums:
    """Weighted metric sums of one step (means at the end)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, metrics: dict[str, Any], weight: float) -> None:
        for k, v in metrics.items():
            self.sums[k] += float(v) * weight
            self.weights[k] += weight

    def means(self, prefix: str = "") -> dict[str, float]:
        return {prefix + k: self.sums[k] / max(self.weights[k], 1e-12) for k in self.sums}


class OfflineTrainer:
    """SFT or preference training on a fixed dataset (module docstring).

    Args:
        cfg: the configuration.
        train, tokenizer: a TrainEngine and its tokenizer (default: built from ``cfg.model`` /
            ``cfg.train``, or over ``model``).
        model: the initial policy (with ``tokenizer``) instead of ``cfg.model``; with
            ``offline.loss=rm`` a causal LM (a scalar head is put on it) or a reward model.
        reference: the frozen reference (anything with the TrainEngine ``logprobs``) for DPO /
            IPO; default: :func:`frozen_copy` of the initial policy.
        train_data, eval_data: lists of :class:`~trainers.data_pairs.Example` (SFT) or
            :class:`~trainers.data_pairs.Pair`; default :func:`load_offline_data`.

    ``fit()`` runs the shared driver (:func:`trainers.loops.common.run_fit`): evaluate, steps,
    evaluate, logs under ``logging.dir``, the trained model saved at the end.
    """

    def __init__(
        self,
        cfg: OfflineConfig,
        *,
        train: TrainEngine | None = None,
        tokenizer: Any = None,
        model: Any = None,
        reference: Any = None,
        train_data: list[Any] | None = None,
        eval_data: list[Any] | None = None,
    ) -> None:
        validate_offline(cfg)
        self.cfg, self.loss_name = cfg, cfg.offline.loss
        if train_data is None or eval_data is None:
            td, ed = load_offline_data(cfg)
            train_data = td if train_data is None else train_data
            eval_data = ed if eval_data is None else eval_data
        if not train_data:
            raise ValueError("train_data: empty")
        if train is None:
            if self.loss_name == "rm":
                model, tokenizer = build_reward_model(cfg, model=model, tokenizer=tokenizer)
            elif model is None:
                model, tokenizer = build_model(cfg)
            train = make_train_engine(cfg, model, device=cfg.train.device)
        if tokenizer is None:
            raise ValueError("tokenizer: required with train or model")
        self.train, self.tok = train, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.reference = None
        if self.loss_name in REFERENCE_LOSSES:
            self.reference = reference if reference is not None else frozen_copy(train)
        self.train_data, self.eval_data = train_data, eval_data
        self._train_enc = self.encode(train_data)
        self._eval_enc = self.encode(eval_data)
        self.iterator = PromptIterator(list(range(len(train_data))), seed=cfg.seed)
        self.global_step = 0
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    # ------------------------------------------------------------------ data

    def _ids(self, text: str) -> list[int]:
        return [*self.tok(text, add_special_tokens=False).input_ids, self.tok.eos_token_id]

    def encode(self, records: list[Any]) -> list[tuple[list[int], ...]]:
        """Token ids per record: ``(prompt, completion)`` for SFT, ``(prompt, chosen, rejected)``
        for pairs, each completion ending with EOS; ``offline.loss=rm``: ``(chosen, rejected)``,
        each the whole conversation the reward model scores
        (:func:`~trainers.rewards.reward_model.encode_reward_input`)."""
        out: list[tuple[list[int], ...]] = []
        for i, r in enumerate(records):
            sft = self.loss_name == "sft"
            if not isinstance(r, Example if sft else Pair):
                want = "Example" if sft else "Pair"
                raise ValueError(
                    f"data: record {i} is a {type(r).__name__}, offline.loss={self.loss_name} needs {want}"
                )
            if self.loss_name == "rm":
                out.append(tuple(encode_reward_input(self.tok, r.prompt, c) for c in (r.chosen, r.rejected)))
                continue
            prompt = encode_prompt(self.tok, Prompt(r.prompt, ""), self.cfg.data.chat_template)
            if sft:
                out.append((prompt, self._ids(r.completion)))
            else:
                out.append((prompt, self._ids(r.chosen), self._ids(r.rejected)))
        return out

    # ------------------------------------------------------------------ losses

    def _micro_rows(self, n: int) -> list[range]:
        m = self.cfg.train.micro_batch_size
        return [range(i, min(i + m, n)) for i in range(0, n, m)]

    def sft_batch(self, enc: list[tuple[list[int], ...]], *, backward: bool) -> dict[str, float]:
        """Token NLL of ``enc`` over micro-batches with the global normalisers of the whole batch
        (the summed micro-batch losses are the batch loss); backpropagates when ``backward``."""
        b = pack([e[0] for e in enc], [e[1] for e in enc], self.pad_id)
        norms = global_normalizers(b.response_mask)
        sums, total = _Sums(), 0.0
        for rows in self._micro_rows(len(enc)):
            mb = b[torch.tensor(list(rows))]
            with torch.set_grad_enabled(backward):
                lp, ent = self.train.logprobs(
                    mb.input_ids, mb.attention_mask, mb.response_mask, with_entropy=True
                )
                out = sft_nll(lp, mb.response_mask)
                loss = aggregate(out.loss, mb.response_mask, self.cfg.offline.aggregation, **norms)
            if backward:
                self.train.backward(loss)
            total += float(loss.detach())
            n = int(mb.response_mask.sum())
            sums.add({"entropy": float(ent.detach()[mb.response_mask].sum()) / max(n, 1)}, n)
        return {"loss": total, "num_tokens": float(b.response_mask.sum()), **sums.means()}

    def _pair_logps(self, engine: Any, b: PackedBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        lp = engine.logprobs(b.input_ids, b.attention_mask, b.response_mask)
        seq = sequence_logprobs(lp, b.response_mask)
        return seq[:k], seq[k:]

    def preference_batch(self, enc: list[tuple[list[int], ...]], *, backward: bool) -> dict[str, float]:
        """The preference loss of the pairs ``enc``: each micro-batch packs its chosen and
        rejected responses in one forward (and one of the reference, without gradients), the
        per-pair losses averaged with the global pair count (:func:`aggregate_pairs`)."""
        norms = global_normalizers(torch.ones(len(enc), 1, dtype=torch.bool))
        sums, total = _Sums(), 0.0
        for rows in self._micro_rows(len(enc)):
            part = [enc[i] for i in rows]
            k = len(part)
            b = pack([e[0] for e in part] * 2, [e[1] for e in part] + [e[2] for e in part], self.pad_id)
            lengths = b.response_mask.sum(-1)
            ref_c = ref_r = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_c, ref_r = self._pair_logps(self.reference, b, k)
            with torch.set_grad_enabled(backward):
                c, r = self._pair_logps(self.train, b, k)
                out = preference_loss(
                    self.loss_name, c, r, ref_c, ref_r, lengths[:k], lengths[k:], self.cfg.offline
                )
                loss = aggregate_pairs(out.loss, num_pairs=norms["num_seqs"], dp_size=norms["dp_size"])
            if backward:
                self.train.backward(loss)
            total += float(loss.detach())
            prefers = (c.detach() > r.detach()).float().mean()
            sums.add({**out.metrics, "policy/prefers_chosen": prefers}, k)
        return {"loss": total, **sums.means()}

    def reward_model_batch(self, enc: list[tuple[list[int], ...]], *, backward: bool) -> dict[str, float]:
        """``offline.loss=rm``: the Bradley-Terry loss of the pairs ``enc``; each micro-batch
        scores its chosen and rejected conversations in one forward of the reward model, the
        per-pair losses averaged with the global pair count (:func:`aggregate_pairs`)."""
        norms = global_normalizers(torch.ones(len(enc), 1, dtype=torch.bool))
        model, pad = self.train.model, self.train.model.config.pad_token_id
        sums, total = _Sums(), 0.0
        for rows in self._micro_rows(len(enc)):
            part = [enc[i] for i in rows]
            k = len(part)
            with torch.set_grad_enabled(backward):
                r = reward_scores(
                    model,
                    [e[0] for e in part] + [e[1] for e in part],
                    pad,
                    device=self.train.device,
                    autocast=getattr(self.train, "autocast", None),
                )
                out = bradley_terry(r[:k], r[k:])
                loss = aggregate_pairs(out.loss, num_pairs=norms["num_seqs"], dp_size=norms["dp_size"])
            if backward:
                self.train.backward(loss)
            total += float(loss.detach())
            sums.add(out.metrics, k)
        return {"loss": total, **sums.means()}

    def _batch_fn(self) -> Any:
        if self.loss_name == "sft":
            return self.sft_batch
        return self.reward_model_batch if self.loss_name == "rm" else self.preference_batch

    # ------------------------------------------------------------------ loop

    def step(self) -> dict[str, float]:
        """One optimizer step on the next ``offline.batch_size`` records; returns its metrics."""
        rows = self.iterator.next_batch(self.cfg.offline.batch_size)
        enc = [self._train_enc[i] for i in rows]
        metrics = self._batch_fn()(enc, backward=True)
        optim = self.train.step()
        metrics["grad_norm"] = float(optim.get("grad_norm", float("nan")))
        metrics["learning_rate"] = float(optim.get("lr", float("nan")))
        metrics["epoch"] = self.iterator.epoch + self.iterator.position / len(self._train_enc)
        self.global_step += 1
        return metrics

    @torch.no_grad()
    def evaluate(self, records: list[Any] | None = None) -> dict[str, float]:
        """The loss and metrics on ``records`` (default: the held-out ones), as ``eval/*``
        (no gradient). Preference losses: ``eval/accuracy`` is the share of pairs whose
        chosen response has the higher sequence log-prob under the policy; ``rm``: the share
        whose chosen response the reward model scores higher (preference accuracy)."""
        enc = self._eval_enc if records is None else self.encode(records)
        if not enc:
            return {}
        m = self._batch_fn()(enc, backward=False)
        out = {f"eval/{k}": v for k, v in m.items()}
        if "eval/policy/prefers_chosen" in out:
            out["eval/accuracy"] = out.pop("eval/policy/prefers_chosen")
        if self.loss_name == "rm":
            out["eval/accuracy"] = out["eval/rewards/accuracies"]
        return out

    def fit(self, steps: int | None = None) -> dict[str, Any]:
        """Evaluate, train ``steps`` (default ``train.steps``), evaluate; logs, the model saved."""
        return run_fit(self, steps, line=_progress)

    def save_model(self, path: str | Path) -> Path:
        """The trained policy (``rm``: the reward model) and tokenizer as a Hugging Face model
        directory."""
        return self.train.save_model(path, self.tok)

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "train": self.train.state_dict(),
            "data": self.iterator.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train.load_state_dict(state["train"])
        self.iterator.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.global_step = int(state["global_step"])

    def save_checkpoint(self, directory: str | Path | None = None) -> Path:
        """``<checkpoint.dir>/step_<k>/trainer.pt`` (the reference is the initial policy, rebuilt)."""
        ck = self.cfg.checkpoint
        return write_checkpoint(
            self.state_dict(), directory or ck.dir, self.global_step, keep=ck.keep, resume=ck.resume
        )

    def load_checkpoint(self, path: str | Path) -> None:
        self.load_state_dict(read_checkpoint(path, self.cfg.checkpoint.dir))

    def close(self) -> None:
        """Nothing to stop (in process); for symmetry with the RL loops."""


def _progress(k: int, total: int, m: dict[str, float]) -> str:
    pref = (
        f" acc {m['rewards/accuracies']:.2f} margin {m['rewards/margins']:.3f}"
        if "rewards/accuracies" in m
        else ""
    )
    ev = f" eval loss {m['eval/loss']:.4f}" if "eval/loss" in m else ""
    return f"[step {k:>4}/{total}] loss {m['loss']:.4f}{pref} grad_norm {m['grad_norm']:.3f}{ev}"

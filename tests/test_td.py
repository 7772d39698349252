"""TensorDict adapters (rollkit.td): the mechanism on a private registry, every registered
primitive against a direct call, and the advantage -> loss -> aggregation pipeline."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential

from rollkit.registry import REGISTRIES, Registry
from rollkit.td import (
    KEEP,
    PrimitiveModule,
    apply_keep,
    missing_in_keys,
    resolve,
    td_loss,
    td_module,
    tensor_args,
)
from rollkit.testing import batches, group_ids, masks, rewards
from rollkit.types import LossOutput

# ------------------------------------------------------------------------------------------
# A private registry of small primitives
# ------------------------------------------------------------------------------------------

REG = Registry("test primitive")


@REG.register("center", in_keys={"rewards": "rewards", "group_ids": "group_ids"}, out_keys=["advantages"])
def center(rewards, group_ids, *, scale: float = 1.0):  # [B], [B] -> [B]
    same = group_ids[:, None] == group_ids[None, :]
    mean = (same * rewards[None, :]).sum(-1) / same.sum(-1)
    return scale * (rewards - mean)


@REG.register(
    "pg",
    in_keys={"mask": "response_mask", "advantages": "advantages", "logprobs": "logprobs"},
    out_keys=["loss"],
)
def pg(logprobs, advantages, mask, *, coef: float = 1.0) -> LossOutput:  # [B,T], [B] or [B,T], [B,T]
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    loss = torch.where(mask, -coef * adv * logprobs, torch.zeros(()))
    return LossOutput(loss, {"n_tokens": mask.sum().float(), "adv_mean": adv.mean().detach()})


@REG.register("token-sum", in_keys={"loss": "loss", "mask": "response_mask"}, out_keys=["loss_scalar"])
def token_sum(loss, mask):  # [B,T], [B,T] -> []
    return torch.where(mask, loss, torch.zeros(())).sum()


@REG.register("split", in_keys={"x": "values"}, out_keys=["pos", "neg"])
def split(x):  # [B,T] -> ([B,T], [B,T])
    return x.clamp(min=0), x.clamp(max=0)


@REG.register("positive", in_keys={"rewards": "rewards"}, out_keys=[KEEP])
def positive(rewards):  # [B] -> [B] bool
    return rewards > 0


@REG.register("offset", in_keys={"rewards": "rewards", "bonus": "bonus"}, out_keys=["shaped"])
def offset(rewards, bonus=None):  # [B], optional [B]
    return rewards if bonus is None else rewards + bonus


@REG.register("incomplete", in_keys={"rewards": "rewards"}, out_keys=["x"])
def incomplete(rewards, group_ids):
    return rewards


def _td(B=3, T=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] < torch.tensor([T, 2, 1][:B] + [T] * max(0, B - 3))[:, None]
    return TensorDict(
        rewards=torch.tensor([1.0, 0.0, 3.0][:B] + [0.5] * max(0, B - 3)),
        group_ids=torch.tensor([5, 5, 9][:B] + [9] * max(0, B - 3)),
        logprobs=-torch.rand(B, T, generator=g),
        values=torch.randn(B, T, generator=g),
        response_mask=mask,
        batch_size=[B],
    )


# ------------------------------------------------------------------------------------------
# Mechanism
# ------------------------------------------------------------------------------------------


def test_is_a_tensordict_module_with_keys_in_argument_order():
    m = td_module("pg", registry=REG)
    assert isinstance(m, TensorDictModule) and isinstance(m, PrimitiveModule)
    assert m.in_keys == ["logprobs", "advantages", "response_mask"]  # signature order, not dict order
    assert m.out_keys == ["loss", "loss_metrics"]


def test_b_output_hand_computed():
    td = _td()
    out = td_module("center", registry=REG)(td)
    # group 5: rewards 1, 0 -> mean 0.5; group 9: 3 -> 0
    assert torch.equal(out["advantages"], torch.tensor([0.5, -0.5, 0.0]))
    assert out is td  # inplace=True writes into the given TD


def test_hyper_parameters_and_in_keys_override():
    td = _td()
    td["r2"] = torch.tensor([2.0, 0.0, 0.0])
    out = td_module("center", registry=REG, in_keys={"rewards": "r2"}, out_keys=["a2"], scale=2.0)(td)
    assert torch.equal(out["a2"], torch.tensor([2.0, -2.0, 0.0]))
    assert "advantages" not in out


def test_unregistered_function_needs_keys():
    with pytest.raises(ValueError, match="out_keys"):
        td_module(lambda rewards: rewards, in_keys={"rewards": "rewards"})
    with pytest.raises(ValueError, match=r"in_keys: .*\['rewards'\]"):
        td_module(lambda rewards: rewards, out_keys=["y"])
    m = td_module(lambda rewards: -rewards, in_keys={"rewards": "rewards"}, out_keys=["y"])
    assert torch.equal(m(_td())["y"], torch.tensor([-1.0, -0.0, -3.0]))


def test_registered_function_object_finds_its_entry():
    # a function is matched to its registry entry, whose keys are used
    assert resolve(center, REG).name == "center"
    out = td_module(center, registry=REG)(_td())
    assert "advantages" in out


def test_loss_output_loss_and_metrics():
    td = _td()
    td["advantages"] = torch.tensor([1.0, -1.0, 2.0])
    out = td_module("pg", registry=REG)(td)
    direct = pg(td["logprobs"], td["advantages"], td["response_mask"])
    assert torch.equal(out["loss"], direct.loss)
    metrics = out["loss_metrics"]
    assert isinstance(metrics, dict) and set(metrics) == {"n_tokens", "adv_mean"}
    assert metrics["n_tokens"].item() == 4 + 2 + 1
    out2 = td_module("pg", registry=REG, metrics_key="m", out_keys=["l"])(td.copy())
    assert set(out2["m"]) == {"n_tokens", "adv_mean"}
    out3 = td_module("pg", registry=REG, metrics_key=None, out_keys=["l3"])(td.copy())
    assert "l3" in out3 and "l3_metrics" not in out3 and "m" not in out3


def test_loss_output_without_annotation_must_choose_metrics_key():
    def f(logprobs):  # returns a LossOutput but does not say so
        return LossOutput(logprobs, {"a": logprobs.sum()})

    with pytest.raises(ValueError, match="metrics_key"):
        td_module(f, in_keys={"logprobs": "logprobs"}, out_keys=["l"])(_td())
    out = td_module(f, in_keys={"logprobs": "logprobs"}, out_keys=["l"], metrics_key="mm")(_td())
    assert set(out["mm"]) == {"a"}


def test_tuple_outputs():
    td = _td()
    out = td_module("split", registry=REG)(td)
    assert torch.equal(out["pos"], td["values"].clamp(min=0))
    assert torch.equal(out["neg"], td["values"].clamp(max=0))
    with pytest.raises(ValueError, match="out_keys"):
        td_module("split", registry=REG, out_keys=["only_one"])(_td())


def test_broadcast_b_outputs_over_tokens():
    td = _td()
    out = td_module("center", registry=REG, broadcast=True)(td)
    expected = torch.tensor([[0.5, 0.5, 0.5, 0.5], [-0.5, -0.5, 0, 0], [0, 0, 0, 0]])
    assert torch.equal(out["advantages"], expected)
    assert out["advantages"].shape == td["response_mask"].shape


def test_scalar_output_is_stored_as_non_tensor_and_keeps_grad():
    td = _td()
    td["loss"] = (td["values"] * 2).requires_grad_()
    out = td_module("token-sum", registry=REG)(td)
    s = out["loss_scalar"]
    assert s.ndim == 0
    assert torch.allclose(s, 2 * td["values"][td["response_mask"]].sum())
    s.backward()
    assert torch.equal(td["loss"].grad, td["response_mask"].float())
    # carried along by indexing
    assert apply_keep(out, torch.tensor([True, False, True]))["loss_scalar"] is s


def test_optional_argument_uses_default_when_key_absent():
    td = _td()
    m = td_module("offset", registry=REG)
    assert torch.equal(m(td)["shaped"], td["rewards"])
    td["bonus"] = torch.ones(3)
    assert torch.equal(m(td)["shaped"], td["rewards"] + 1)


def test_missing_key_names_key_argument_and_primitive():
    td = _td()
    del td["group_ids"]
    with pytest.raises(ValueError, match=r"center.*'group_ids'.*argument 'group_ids'"):
        td_module("center", registry=REG)(td)
    with pytest.raises(ValueError, match="mask"):
        td_module("center", registry=REG, broadcast=True, mask_key="nope")(_td())


def test_incomplete_entry_is_reported_by_name():
    assert missing_in_keys(REG.entry("incomplete")) == ["group_ids"]
    with pytest.raises(ValueError, match=r"'incomplete'.*\['group_ids'\]"):
        td_module("incomplete", registry=REG)


def test_bad_arguments():
    with pytest.raises(ValueError, match="nope: is not a parameter"):
        td_module("center", registry=REG, nope=1.0)
    with pytest.raises(ValueError, match="rewards: is read from the batch"):
        td_module("center", registry=REG, rewards=torch.ones(3))
    with pytest.raises(ValueError, match="in_keys: 'zzz' is not a tensor argument"):
        td_module("center", registry=REG, in_keys={"zzz": "rewards"})
    with pytest.raises(ValueError, match="not registered"):
        td_module("no-such-thing", registry=REG)
    with pytest.raises(ValueError, match="registry: unknown registry"):
        td_module("grpo", registry="no-such-registry")
    with pytest.raises(ValueError, match="inplace"):
        td_module("center", registry=REG, inplace="sometimes")


def test_wrong_shapes_are_reported_by_the_primitive():
    def checked(rewards):
        from rollkit.validation import check_ndim

        check_ndim("rewards", rewards, 1)
        return rewards

    td = TensorDict(rewards=torch.ones(3, 2), batch_size=[3])
    with pytest.raises(ValueError, match="rewards: expected 1 dimensions"):
        td_module(checked, in_keys={"rewards": "rewards"}, out_keys=["y"])(td)


def test_keyword_call_without_a_tensordict():
    # tensordict's dispatch: keyword tensors in, outputs out (a tuple for several out keys)
    adv = td_module("center", registry=REG)(
        rewards=torch.tensor([1.0, 0.0, 3.0]), group_ids=torch.tensor([5, 5, 9])
    )
    assert torch.equal(adv, torch.tensor([0.5, -0.5, 0.0]))
    loss, metrics = td_module("pg", registry=REG)(
        logprobs=-torch.ones(2, 2), advantages=torch.ones(2), response_mask=torch.ones(2, 2, dtype=torch.bool)
    )
    assert torch.equal(loss, torch.ones(2, 2)) and metrics["n_tokens"].item() == 4


def test_tensor_args_reads_signature():
    def f(a, b=None, *, c=None, eps=0.1): ...

    assert tensor_args(f) == {"a": True, "b": False}
    assert tensor_args(f, keyed=["c"]) == {"a": True, "b": False, "c": False}


# ------------------------------------------------------------------------------------------
# Mutation semantics
# ------------------------------------------------------------------------------------------


def test_inplace_true_only_adds_declared_out_keys():
    td = _td()
    before = {k: v.clone() for k, v in td.items()}
    ptrs = {k: v.data_ptr() for k, v in td.items()}
    td_module("center", registry=REG)(td)
    assert set(td.keys()) == {*before, "advantages"}
    for k, v in before.items():
        assert torch.equal(td[k], v) and td[k].data_ptr() == ptrs[k]


@pytest.mark.parametrize("inplace", [False, "empty"])
def test_inplace_false_returns_new_td_and_leaves_input(inplace):
    td = _td()
    keys = set(td.keys())
    out = td_module("center", registry=REG, inplace=inplace)(td)
    assert out is not td and set(td.keys()) == keys
    assert set(out.keys()) == {"advantages"}
    assert out.batch_size == (torch.Size([]) if inplace is False else td.batch_size)
    assert torch.equal(out["advantages"], torch.tensor([0.5, -0.5, 0.0]))


def test_primitive_never_sees_mutated_inputs_on_replace():
    # an out key that is also an in key (reward transforms write "rewards") replaces the entry,
    # the original tensor is untouched
    m = td_module(lambda rewards: rewards * 10, in_keys={"rewards": "rewards"}, out_keys=["rewards"])
    td = _td()
    original = td["rewards"]
    snapshot = original.clone()
    out = m(td)
    assert torch.equal(original, snapshot)
    assert torch.equal(out["rewards"], snapshot * 10)


# ------------------------------------------------------------------------------------------
# Filters
# ------------------------------------------------------------------------------------------


def test_filter_and_apply_keep():
    td = td_module("positive", registry=REG)(_td())
    assert torch.equal(td[KEEP], torch.tensor([True, False, True]))
    kept = apply_keep(td)
    assert kept.batch_size == torch.Size([2])
    assert torch.equal(kept["rewards"], torch.tensor([1.0, 3.0]))
    assert torch.equal(kept["logprobs"], td["logprobs"][[0, 2]])
    assert td.batch_size == torch.Size([3])  # input untouched


def test_apply_keep_nothing_kept_and_errors():
    td = _td()
    empty = apply_keep(td, torch.zeros(3, dtype=torch.bool))
    assert empty.batch_size == torch.Size([0]) and empty["logprobs"].shape == (0, 4)
    with pytest.raises(ValueError, match=r"keep: expected a torch\.bool mask"):
        apply_keep(td, torch.ones(3))
    with pytest.raises(ValueError, match=r"keep: expected shape \[3\]"):
        apply_keep(td, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep: the batch has no key 'keep'"):
        apply_keep(td)
    with pytest.raises(ValueError, match="td: expected a TensorDict"):
        apply_keep({"a": torch.ones(3)}, torch.ones(3, dtype=torch.bool))


# ------------------------------------------------------------------------------------------
# Sequential pipeline and scalar losses
# ------------------------------------------------------------------------------------------


def test_sequential_advantage_loss_aggregation():
    pipe = TensorDictSequential(
        td_module("center", registry=REG),
        td_module("pg", registry=REG),
        td_module("token-sum", registry=REG),
    )
    td = _td()
    td["logprobs"] = td["logprobs"].requires_grad_()
    out = pipe(td.copy())
    assert "advantages" not in td and "loss" not in td
    adv = center(td["rewards"], td["group_ids"])
    direct = token_sum(pg(td["logprobs"], adv, td["response_mask"]).loss, td["response_mask"])
    assert torch.allclose(out["loss_scalar"], direct)
    out["loss_scalar"].backward()
    expected_grad = torch.where(td["response_mask"], -adv[:, None], torch.zeros(()))
    assert torch.allclose(td["logprobs"].grad, expected_grad.expand_as(td["logprobs"]))


def test_td_loss_returns_scalar_td_with_metrics():
    m = td_loss("pg", registry=REG, aggregation="token-sum", aggregation_registry=REG, coef=2.0)
    td = _td()
    td["advantages"] = torch.tensor([1.0, -1.0, 2.0])
    keys = set(td.keys())
    out = m(td)
    assert out.batch_size == torch.Size([]) and set(td.keys()) == keys
    direct = token_sum(
        pg(td["logprobs"], td["advantages"], td["response_mask"], coef=2.0).loss, td["response_mask"]
    )
    assert torch.allclose(out["loss_objective"], direct)
    assert out["n_tokens"].item() == 7
    assert set(out.keys()) == {"loss_objective", "n_tokens", "adv_mean"}
    assert set(m.in_keys) == {"logprobs", "advantages", "response_mask"}


def test_td_loss_needs_a_loss_output():
    with pytest.raises(ValueError, match="LossOutput"):
        td_loss("center", registry=REG, aggregation="token-sum", aggregation_registry=REG)


# ------------------------------------------------------------------------------------------
# Property tests
# ------------------------------------------------------------------------------------------


@given(batches())
def test_property_adapter_equals_direct_call(b):
    td = TensorDict(b, batch_size=[b["rewards"].shape[0]])
    out = td_module("pg", registry=REG, coef=0.5)(td.copy())
    direct = pg(b["logprobs"], b["advantages"], b["response_mask"], coef=0.5)
    assert torch.equal(out["loss"], direct.loss)
    assert torch.equal(out["loss_metrics"]["n_tokens"], direct.metrics["n_tokens"])
    adv = td_module("center", registry=REG, broadcast=True)(td.copy())["advantages"]
    assert adv.shape == b["response_mask"].shape
    assert torch.equal(
        adv, torch.where(b["response_mask"], center(b["rewards"], b["group_ids"])[:, None], 0.0)
    )


@settings(max_examples=25)
@given(batches(), st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]))
def test_property_is_correction_ppo_weighted_aggregation_pipeline(b, mode):
    """importance_weights -> ppo (reads is_weights) -> aggregation (reads sample_weights), by
    registered names, equals the direct calls; the [B, T] loss survives the aggregation."""
    from rollkit.losses import aggregate, importance_weights, ppo_clip

    n = b["rewards"].shape[0]
    td = TensorDict(b, batch_size=[n])
    td["sample_weights"] = b["rewards"].abs()
    pipe = TensorDictSequential(
        td_module("rollout-is", registry="is_correction", cap=2.0),
        td_module("ppo", registry="policy_loss", clip_low=0.2, clip_high=0.28),
        td_module(mode, registry="aggregation", norm_length=7),
    )
    out = pipe(td.copy())
    m = b["response_mask"]
    w, _ = importance_weights(b["old_logprobs"], b["behavior_logprobs"], m, cap=2.0)
    per_token = ppo_clip(
        b["logprobs"], b["old_logprobs"], b["advantages"], m, clip_low=0.2, clip_high=0.28, is_weights=w
    )
    assert torch.equal(out["loss"], per_token.loss)
    expected = aggregate(per_token.loss, m, mode, weights=b["rewards"].abs(), norm_length=7)
    assert torch.equal(out["loss_objective"], expected)


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(rewards(n), group_ids(n), masks(n, 3))))
def test_property_apply_keep_selects_rows(args):
    r, g, m = args
    td = TensorDict(rewards=r, group_ids=g, response_mask=m, batch_size=[r.shape[0]])
    kept = apply_keep(td_module("positive", registry=REG)(td))
    assert kept.batch_size[0] == int((r > 0).sum())
    assert torch.equal(kept["rewards"], r[r > 0])
    assert torch.equal(kept["response_mask"], m[r > 0])
    assert bool(kept[KEEP].all())


# ------------------------------------------------------------------------------------------
# Every registered primitive: adapter == direct call
# ------------------------------------------------------------------------------------------

B, T = 6, 5


def _full_batch() -> dict[str, torch.Tensor]:
    """Every standard key plus the non-standard keys that registered entries declare."""
    g = torch.Generator().manual_seed(1234)
    lens = torch.tensor([5, 3, 1, 4, 5, 2])
    mask = torch.arange(T)[None, :] < lens[:, None]
    mask[0, 2] = False  # an interior hole (tool tokens)
    lp = -torch.rand(B, T, generator=g) * 3

    def near(x):
        return (x + 0.3 * torch.randn(B, T, generator=g)).clamp(max=0.0)

    rewards_ = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # binary: pass@k needs 0/1
    ref = near(lp)
    return {
        # standard keys (rollkit.keys)
        "response_mask": mask,
        "logprobs": lp,
        "old_logprobs": near(lp),
        "behavior_logprobs": near(lp),
        "ref_logprobs": ref,
        "values": torch.randn(B, T, generator=g),
        "old_values": torch.randn(B, T, generator=g),
        "returns": torch.randn(B, T, generator=g),
        "advantages": torch.where(mask, torch.randn(B, 1, generator=g).expand(B, T), 0.0),
        "rewards": rewards_,
        "token_rewards": torch.randn(B, T, generator=g) * mask,
        "group_ids": torch.tensor([7, 7, 7, 7, 9, 9]),
        "policy_version": torch.tensor([10, 9, 8, 3, 10, 6]),
        "response_length": mask.sum(-1),
        "step_ids": torch.zeros(B, T, dtype=torch.long),
        # non-standard keys declared by entries
        "greedy_rewards": torch.tensor([0.5, 0.5, 0.0, 1.0, 0.0, 1.0]),
        "kl": lp - ref,
        "step_rewards": torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 0.5]),
        "traj_ids": torch.tensor([0, 0, 1, 1, 2, 2]),
        "step_index": torch.tensor([0, 1, 0, 1, 0, 1]),
        "state_ids": torch.tensor([3, 4, 3, 5, 3, 4]),
        "truncated": torch.tensor([False, True, False, False, True, False]),
        "accuracy": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
        "episode_returns": torch.tensor([1.0, 1.0, 0.0, 0.0, 1.5, 1.5]),  # constant per episode
        "loss": torch.randn(B, T, generator=g) * mask,  # a per-token loss matrix, for aggregations
        "entropy": torch.rand(B, T, generator=g) * 2,  # per-token entropy, for the entropy bonus
        "ensemble_values": torch.randn(B, T, 2, generator=g),  # two critics' values (asyppo)
    }


# Required keyword-only hyper-parameters of registered entries (no default in the signature).
HYPER = {
    ("advantage", "pass@k"): {"k": 2},
    ("reward", "clip"): {"low": -0.5, "high": 0.5},
    ("reward", "clip_advantages"): {"max_abs": 0.5},
    ("reward", "overlong_penalty"): {"max_length": 5, "cache_length": 2},
    ("filter", "staleness"): {"current_version": 10, "max_staleness": 4},
}


def _entries():
    out = []
    for kind, reg in REGISTRIES.items():
        for name in reg.names():
            out.append(pytest.param(kind, name, id=f"{kind}:{name}"))
    return out


def _assert_same(a, b, what):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), what
        torch.testing.assert_close(a, b, equal_nan=True, atol=0, rtol=0, msg=what)
    elif isinstance(a, dict):
        assert set(a) == set(b), what
        for k in a:
            _assert_same(a[k], b[k], f"{what}[{k}]")
    else:
        assert a == b, what


@pytest.mark.parametrize(("kind", "name"), _entries())
def test_every_registered_primitive_runs_on_a_tensordict(kind, name):
    entry = REGISTRIES[kind].entry(name)
    missing = missing_in_keys(entry)
    assert not missing, (
        f"{kind} entry {name!r}: required tensor argument(s) {missing} have no in_keys; "
        "complete its register(..., in_keys=...)"
    )
    assert entry.out_keys, f"{kind} entry {name!r}: declares no out_keys"
    batch = _full_batch()
    required = tensor_args(entry.fn, keyed=list(entry.in_keys))
    unknown = [k for a, k in entry.in_keys.items() if k not in batch and required[a]]
    assert not unknown, f"{kind} entry {name!r}: test batch lacks key(s) {unknown}; add them to _full_batch"
    hyper = HYPER.get((kind, name), {})
    params = inspect.signature(entry.fn).parameters
    need = [
        p.name
        for p in params.values()
        if p.kind == p.KEYWORD_ONLY and p.default is p.empty and p.name not in entry.in_keys
    ]
    assert set(need) <= set(hyper), f"{kind} entry {name!r}: give test values for hyper-parameters {need}"

    td = TensorDict({k: v.clone() for k, v in batch.items()}, batch_size=[B])
    snapshot = {k: v.clone() for k, v in td.items()}
    originals = dict(td.items())
    module = td_module(name, registry=kind, **hyper)
    torch.manual_seed(0)
    out = module(td)
    torch.manual_seed(0)
    # optional arguments whose key is not in the batch get their default on both paths
    direct = entry.fn(**{a: batch[k] for a, k in entry.in_keys.items() if k in batch}, **hyper)

    if isinstance(direct, LossOutput):
        outs = [direct.loss, direct.metrics]
    elif isinstance(direct, tuple):
        outs = list(direct)
    else:
        outs = [direct]
    assert len(outs) == len(module.out_keys), f"{kind} entry {name!r}: out_keys {module.out_keys}"
    for key, value in zip(module.out_keys, outs):
        _assert_same(value, out[key], f"{kind} entry {name!r}, out key {key!r}")
    # nothing but the declared out keys changed, and no input tensor was modified in place
    for k, v in snapshot.items():
        assert torch.equal(originals[k], v), f"{kind} entry {name!r} modified input {k!r} in place"
        if k not in module.out_keys:
            assert out[k] is originals[k], f"{kind} entry {name!r} replaced input key {k!r}"


def test_real_pipeline_grpo_ppo_token_mean():
    """advantage estimator -> policy loss -> aggregation on one batch, by registered names."""
    from rollkit.advantages import grpo_advantages
    from rollkit.losses import aggregate, ppo_clip

    pipe = TensorDictSequential(
        td_module("grpo", registry="advantage", broadcast=True, eps=1e-6),
        td_module("ppo", registry="policy_loss", clip_low=0.2, clip_high=0.28),
        td_module("token-mean", registry="aggregation", out_keys=["loss_objective"]),
    )
    batch = _full_batch()
    td = TensorDict({k: v for k, v in batch.items() if k not in ("advantages", "loss")}, batch_size=[B])
    td["logprobs"] = td["logprobs"].clone().requires_grad_()
    out = pipe(td.copy())
    assert "advantages" not in td and "loss_objective" not in td
    adv = grpo_advantages(td["rewards"], td["group_ids"], eps=1e-6)
    adv_tok = torch.where(td["response_mask"], adv[:, None], 0.0)
    torch.testing.assert_close(out["advantages"], adv_tok)
    per_token = ppo_clip(
        td["logprobs"], td["old_logprobs"], adv_tok, td["response_mask"], clip_low=0.2, clip_high=0.28
    )
    torch.testing.assert_close(out["loss"], per_token.loss)
    expected = aggregate(per_token.loss, td["response_mask"], "token-mean")
    torch.testing.assert_close(out["loss_objective"], expected)
    assert set(out["loss_metrics"]) == set(per_token.metrics)
    out["loss_objective"].backward()
    assert td["logprobs"].grad is not None and bool(td["logprobs"].grad[~td["response_mask"]].eq(0).all())


def test_ambiguous_name_needs_its_registry():
    both = [k for k, r in REGISTRIES.items() if "gpg" in r]
    if len(both) < 2:
        pytest.skip("'gpg' is not registered twice")
    with pytest.raises(ValueError, match="several registries"):
        td_module("gpg")
    assert td_module("gpg", registry="advantage").out_keys == ["advantages"]


# ------------------------------------------------------------------------------------------
# Optional tensor arguments and the loss-term registries
# ------------------------------------------------------------------------------------------


def test_every_entry_metadata_is_complete():
    """The registry itself reports incomplete metadata (Entry.missing_in_keys), and every
    keyword-only argument an entry maps to a key is optional (a tensor with a default)."""
    for kind, reg in REGISTRIES.items():
        for name in reg.names():
            entry = reg.entry(name)
            assert entry.missing_in_keys() == missing_in_keys(entry) == [], (kind, name)
            assert set(entry.tensor_args()) >= set(entry.in_keys), (kind, name)
    assert REG.entry("incomplete").missing_in_keys() == ["group_ids"]


def test_register_rejects_in_keys_that_are_not_parameters():
    reg = Registry("test primitive")
    with pytest.raises(ValueError, match=r"in_keys: \['x'\] are not parameters of test primitive 'f'"):
        reg.register("f", lambda rewards: rewards, in_keys={"x": "rewards"})
    assert "f" not in reg


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_aggregation_reads_optional_sample_weights(mode):
    from rollkit.losses import aggregate

    batch = _full_batch()
    td = TensorDict({k: batch[k] for k in ("loss", "response_mask")}, batch_size=[B])
    m = td_module(mode, registry="aggregation")
    assert m.in_keys == ["loss", "response_mask", "sample_weights"]
    assert m.out_keys == ["loss_objective"]
    out = m(td.copy())
    assert torch.equal(out["loss"], td["loss"])  # the [B, T] loss is not overwritten
    assert torch.equal(out["loss_objective"], aggregate(td["loss"], td["response_mask"], mode))
    w = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.0, 3.0])
    td["sample_weights"] = w
    got = m(td.copy())["loss_objective"]
    assert torch.equal(got, aggregate(td["loss"], td["response_mask"], mode, weights=w))
    assert not torch.equal(got, out["loss_objective"])


def test_ppo_reads_optional_is_weights_written_by_is_correction():
    from rollkit.losses import importance_weights, ppo_clip

    batch = _full_batch()
    keys = ("logprobs", "old_logprobs", "behavior_logprobs", "advantages", "response_mask")
    td = TensorDict({k: batch[k] for k in keys}, batch_size=[B])
    is_mod = td_module("importance_weights", registry="is_correction", cap=1.5)
    ppo = td_module("ppo", registry="policy_loss")
    assert is_mod.out_keys == ["is_weights", "is_metrics"] and "is_weights" in ppo.in_keys
    without = ppo(td.copy())
    plain = ppo_clip(td["logprobs"], td["old_logprobs"], td["advantages"], td["response_mask"])
    assert torch.equal(without["loss"], plain.loss)
    out = TensorDictSequential(is_mod, ppo)(td.copy())
    w, w_metrics = importance_weights(
        td["old_logprobs"], td["behavior_logprobs"], td["response_mask"], cap=1.5
    )
    assert torch.equal(out["is_weights"], w)
    assert set(out["is_metrics"]) == set(w_metrics)
    expected = ppo_clip(
        td["logprobs"], td["old_logprobs"], td["advantages"], td["response_mask"], is_weights=w
    )
    assert torch.equal(out["loss"], expected.loss)
    assert not torch.equal(out["loss"], plain.loss)


def test_loss_terms_write_their_own_keys_and_compose():
    """policy + KL + entropy + value terms in one batch: each writes its own [B, T] key, and
    registered aggregations reduce each of them to its own scalar."""
    from rollkit.losses import aggregate, entropy_bonus, kl_loss, value_loss

    batch = _full_batch()
    td = TensorDict({k: v for k, v in batch.items() if k != "loss"}, batch_size=[B])
    pipe = TensorDictSequential(
        td_module("ppo", registry="policy_loss"),
        td_module("kl", registry="regularizer", estimator="k3", coef=0.1),
        td_module("entropy", registry="regularizer", coef=0.01),
        td_module("clipped", registry="value_loss", clip_range=0.2),
        td_module("token-mean", registry="aggregation", in_keys={"loss": "kl_loss"}, out_keys=["loss_kl"]),
    )
    out = pipe(td.copy())
    mask = td["response_mask"]
    kl = kl_loss(td["logprobs"], td["ref_logprobs"], mask, estimator="k3", coef=0.1)
    ent = entropy_bonus(td["entropy"], mask, coef=0.01)
    val = value_loss(td["values"], td["old_values"], td["returns"], mask, clip_range=0.2)
    assert torch.equal(out["kl_loss"], kl.loss) and set(out["kl_loss_metrics"]) == set(kl.metrics)
    assert torch.equal(out["entropy_loss"], ent.loss)
    assert torch.equal(out["value_loss"], val.loss)
    assert torch.equal(out["loss_kl"], aggregate(kl.loss, mask, "token-mean"))
    assert "loss" in out and not torch.equal(out["loss"], out["kl_loss"])


def test_new_registries_are_listed_with_their_names():
    assert {"regularizer", "value_loss", "is_correction"} <= set(REGISTRIES)
    assert set(REGISTRIES["regularizer"].names()) == {"kl", "entropy"}
    assert "kl_loss" in REGISTRIES["regularizer"] and "entropy_bonus" in REGISTRIES["regularizer"]
    assert REGISTRIES["value_loss"].names() == ["clipped"] and "value_loss" in REGISTRIES["value_loss"]
    assert REGISTRIES["is_correction"].names() == ["importance_weights"]

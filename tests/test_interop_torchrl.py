"""rollkit losses as torchrl LossModules (rollkit.integrations.torchrl)."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

pytest.importorskip("torchrl")

from rollkit.integrations import torchrl as rt
from rollkit.losses import aggregate, ppo_clip
from rollkit.testing import batches
from rollkit.types import LossOutput

V, D = 6, 8


class TokenLogProbs(torch.nn.Module):
    """A tiny policy: token logits from the previous token; log-probs of the taken tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.head = torch.nn.Linear(D, V)

    def forward(self, prev_tokens, tokens):  # [B, T] int, [B, T] int -> [B, T]
        logits = self.head(self.emb(prev_tokens))
        return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _actor(seed=0):
    torch.manual_seed(seed)
    return TensorDictModule(TokenLogProbs(), in_keys=["prev_tokens", "tokens"], out_keys=["logprobs"])


def _batch(actor, B=4, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, T), generator=g)
    prev = torch.cat([torch.zeros(B, 1, dtype=torch.long), tokens[:, :-1]], dim=1)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 4, 2])[:B, None]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])[:B, None].expand(B, T) * mask
    td = TensorDict(tokens=tokens, prev_tokens=prev, response_mask=mask, advantages=adv, batch_size=[B])
    with torch.no_grad():
        td["old_logprobs"] = actor.module(prev, tokens)  # on-policy: the rollout policy is the actor
    return td


def test_is_a_torchrl_loss_module():
    from torchrl.objectives import LossModule

    loss = rt.RollkitLossModule(_actor(), "ppo")
    assert isinstance(loss, LossModule)
    assert loss.out_keys == ["loss_objective"]
    # the actor's inputs, plus what the loss reads that the actor does not produce
    # (+ the optional keys of "ppo" and of the aggregation, read when the batch has them)
    assert set(loss.in_keys) == {
        "prev_tokens",
        "tokens",
        "old_logprobs",
        "advantages",
        "response_mask",
        "is_weights",
        "sample_weights",
    }


def test_value_equals_direct_rollkit_call():
    actor = _actor()
    td = _batch(actor)
    loss_fn = rt.RollkitLossModule(actor, "ppo", aggregation="token-mean", clip_low=0.1, clip_high=0.3)
    out = loss_fn(td)
    assert out.batch_size == torch.Size([])
    lp = actor.module(td["prev_tokens"], td["tokens"])
    direct = ppo_clip(
        lp, td["old_logprobs"], td["advantages"], td["response_mask"], clip_low=0.1, clip_high=0.3
    )
    expected = aggregate(direct.loss, td["response_mask"], "token-mean")
    torch.testing.assert_close(out["loss_objective"], expected)
    for k, v in direct.metrics.items():
        torch.testing.assert_close(out[k], v)
    # on-policy, token-mean: the objective is -mean(A) over the valid tokens
    m = td["response_mask"]
    torch.testing.assert_close(out["loss_objective"], -(td["advantages"][m]).mean())


def test_training_step_moves_logprobs_in_the_advantage_direction():
    actor = _actor()
    td = _batch(actor)
    loss_fn = rt.RollkitLossModule(actor, "ppo")
    opt = torch.optim.SGD(loss_fn.parameters(), lr=0.5)
    keys_before = set(td.keys())
    m, adv = td["response_mask"], td["advantages"]

    def weighted_logprob():
        with torch.no_grad():
            lp = actor.module(td["prev_tokens"], td["tokens"])
        return float((adv * lp)[m].sum())

    before = weighted_logprob()
    out = loss_fn(td)
    out["loss_objective"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in actor.parameters())
    opt.step()
    opt.zero_grad()
    after = weighted_logprob()
    assert after > before  # positive-advantage tokens up, negative-advantage tokens down
    assert set(td.keys()) == keys_before  # the input batch is not modified
    assert loss_fn(td)["loss_objective"].item() < out["loss_objective"].item()


def test_set_keys_remaps_batch_keys():
    actor = _actor()
    td = _batch(actor)
    ref = rt.RollkitLossModule(actor, "ppo")(td)["loss_objective"]
    td2 = td.clone()
    td2.rename_key_("advantages", "adv")
    td2.rename_key_("response_mask", ("masks", "response"))
    loss_fn = rt.RollkitLossModule(actor, "ppo")
    loss_fn.set_keys(advantages="adv", response_mask=("masks", "response"))
    assert "adv" in loss_fn.in_keys and ("masks", "response") in loss_fn.in_keys
    torch.testing.assert_close(loss_fn(td2)["loss_objective"], ref)
    with pytest.raises(ValueError, match="not an accepted tensordict key"):
        loss_fn.set_keys(nonsense="x")


def test_optional_weights_are_read_from_the_batch_and_remappable():
    actor = _actor()
    td = _batch(actor)
    B, T = td["advantages"].shape
    w_is = torch.linspace(0.5, 2.0, B * T).reshape(B, T)
    w_s = torch.tensor([1.0, 0.0, 2.0, 0.5])
    loss_fn = rt.RollkitLossModule(actor, "ppo", aggregation="seq-mean-token-mean")
    plain = loss_fn(td)["loss_objective"]
    td2 = td.clone()
    td2["iw"], td2["sw"] = w_is, w_s
    loss_fn.set_keys(is_weights="iw", sample_weights="sw")
    assert {"iw", "sw"} <= set(loss_fn.in_keys)
    got = loss_fn(td2)["loss_objective"]
    lp = actor.module(td["prev_tokens"], td["tokens"])
    per_token = ppo_clip(lp, td["old_logprobs"], td["advantages"], td["response_mask"], is_weights=w_is).loss
    expected = aggregate(per_token, td["response_mask"], "seq-mean-token-mean", weights=w_s)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, plain)
    # absent optional keys: the defaults (no IS weights, unit sample weights)
    torch.testing.assert_close(loss_fn(td)["loss_objective"], plain)


def test_actor_as_plain_callable_and_no_actor():
    actor = _actor()
    td = _batch(actor)
    ref = rt.RollkitLossModule(actor, "ppo")(td)["loss_objective"]
    call = rt.RollkitLossModule(lambda t: actor.module(t["prev_tokens"], t["tokens"]), "ppo")
    torch.testing.assert_close(call(td)["loss_objective"], ref)
    td3 = td.clone()
    td3["logprobs"] = actor.module(td["prev_tokens"], td["tokens"])
    torch.testing.assert_close(rt.RollkitLossModule(None, "ppo")(td3)["loss_objective"], ref)
    with pytest.raises(ValueError, match="actor_network"):
        rt.RollkitLossModule(lambda t: 3, "ppo")(td)


def test_custom_policy_loss_function_and_aggregation_kwargs():
    def pg(logprobs, advantages, mask) -> LossOutput:
        return LossOutput(torch.where(mask, -advantages * logprobs, 0.0), {"n": mask.sum().float()})

    actor = _actor()
    td = _batch(actor)
    loss_fn = rt.RollkitLossModule(
        actor,
        pg,
        in_keys={"logprobs": "logprobs", "advantages": "advantages", "mask": "response_mask"},
        aggregation="token-mean",
    )
    lp = actor.module(td["prev_tokens"], td["tokens"])
    m = td["response_mask"]
    torch.testing.assert_close(loss_fn(td)["loss_objective"], (-td["advantages"] * lp)[m].mean())
    assert float(loss_fn(td)["n"]) == int(m.sum())
    # a global token count (gradient accumulation): the sum is divided by it instead
    loss_fn.aggregation_kwargs = {"num_tokens": 100.0}
    torch.testing.assert_close(loss_fn(td)["loss_objective"], (-td["advantages"] * lp)[m].sum() / 100)


@given(batches(allow_empty_rows=False))
def test_property_equals_direct_call(b):
    td = TensorDict(b, batch_size=[b["rewards"].shape[0]])
    loss_fn = rt.RollkitLossModule(None, "ppo", aggregation="token-sum")
    out = loss_fn(td)
    direct = ppo_clip(b["logprobs"], b["old_logprobs"], b["advantages"], b["response_mask"])
    torch.testing.assert_close(out["loss_objective"], aggregate(direct.loss, b["response_mask"], "token-sum"))


def test_missing_torchrl_gives_install_hint(monkeypatch):
    rt._build_class.cache_clear()
    monkeypatch.setitem(sys.modules, "torchrl.objectives", None)
    try:
        with pytest.raises(ImportError, match=r"pip install 'rollkit-rl\[torchrl\]'"):
            rt.RollkitLossModule  # noqa: B018
    finally:
        monkeypatch.undo()
        rt._build_class.cache_clear()
    assert rt.RollkitLossModule.__name__ == "RollkitLossModule"


def _policy_losses():
    from rollkit.registry import POLICY_LOSSES

    return POLICY_LOSSES.names()


@pytest.mark.parametrize("name", _policy_losses())
def test_every_registered_policy_loss_as_loss_module(name):
    from rollkit.registry import POLICY_LOSSES

    entry = POLICY_LOSSES.entry(name)
    g = torch.Generator().manual_seed(7)
    B, T = 4, 5
    lp = -torch.rand(B, T, generator=g) * 2
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 1, 4])[:, None]
    batch = {
        "logprobs": lp,
        "old_logprobs": (lp + 0.3 * torch.randn(B, T, generator=g)).clamp(max=0),
        "behavior_logprobs": (lp + 0.3 * torch.randn(B, T, generator=g)).clamp(max=0),
        "ref_logprobs": (lp + 0.3 * torch.randn(B, T, generator=g)).clamp(max=0),
        "advantages": torch.where(mask, torch.randn(B, 1, generator=g), 0.0),
        "response_mask": mask,
        "is_weights": torch.rand(B, T, generator=g) * 2,  # optional (ppo)
        "step_ids": (torch.arange(T)[None, :] // 2).expand(B, T).clone(),  # ipa: the turn of each token
    }
    missing = [k for k in entry.in_keys.values() if k not in batch]
    assert not missing, f"policy loss {name!r} reads {missing}; add them to this test's batch"
    out = rt.RollkitLossModule(None, name, aggregation="seq-mean-token-mean")(
        TensorDict(batch, batch_size=[B])
    )
    direct = entry.fn(**{a: batch[k] for a, k in entry.in_keys.items()})
    torch.testing.assert_close(out["loss_objective"], aggregate(direct.loss, mask, "seq-mean-token-mean"))
    assert set(out.keys()) == {"loss_objective", *direct.metrics}


def test_documented_hyper_parameters_are_real_and_the_example_runs():
    """The module docstring's example uses ``ppo``'s real hyper-parameters and is executed
    (no ``+SKIP``); a made-up one (``clip_eps``) is rejected."""
    import doctest
    import re

    doc = rt.__doc__
    assert "+SKIP" not in doc and "clip_eps" not in doc
    init_doc = rt.RollkitLossModule.__init__.__doc__ or rt.RollkitLossModule.__doc__
    assert "clip_eps" not in init_doc
    for kw in re.findall(r"(\w+)=[\d.]+", doc):
        if kw.startswith("clip"):
            assert kw in ppo_clip.__code__.co_varnames, kw
    test = doctest.DocTestParser().get_doctest(doc, {}, "torchrl-doc", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0 and runner.tries > 5
    with pytest.raises(Exception, match="clip_eps"):
        loss_fn = rt.RollkitLossModule(None, "ppo", clip_eps=0.2)
        td = TensorDict(
            {
                "logprobs": torch.zeros(1, 2),
                "old_logprobs": torch.zeros(1, 2),
                "advantages": torch.ones(1),
                "response_mask": torch.ones(1, 2, dtype=torch.bool),
            },
            batch_size=[1],
        )
        loss_fn(td)


def test_former_module_path_reexports_the_same_class():
    from rollkit.interop.torchrl import RollkitLossModule

    assert RollkitLossModule is rt.RollkitLossModule

"""Sweeps over every registered primitive: devices, the ``meta`` device, hyper-parameter types,
``T = 0``. Each entry is called through ``Entry.call`` with a batch that holds every key any
entry reads, so a primitive registered later is swept too."""

import inspect

import pytest
import torch

from rollkit.losses import bradley_terry
from rollkit.losses.ipa import chunk_clip_mask, chunk_index, chunk_log_ratio, chunk_mask
from rollkit.ops import explained_variance
from rollkit.registry import REGISTRIES
from rollkit.rewards import token_level_rewards
from rollkit.validation import value_checks

B, T = 4, 5

# hyper-parameters without a default
REQUIRED = {
    ("advantage", "pass@k"): {"k": 2},
    ("reward", "clip"): {"low": -1.0, "high": 1.0},
    ("reward", "clip_advantages"): {"max_abs": 1.0},
    ("reward", "overlong_penalty"): {"max_length": 10, "cache_length": 2},
    ("filter", "staleness"): {"current_version": 10, "max_staleness": 3},
}

# Families that read values by design (grouping by id, running statistics): they refuse
# ``meta`` by name even inside value_checks(False). Everything else runs on meta there.
GROUPS_ON_META = {
    ("advantage", n)
    for n in (
        "grpo",
        "dr-grpo",
        "lite-ppo",
        "rloo",
        "opo",
        "gpg",
        "pass@k",
        "gigpo",
        "starpo",
        "reinforce++-baseline",
        "discounted_return",
        "ipa",
        "asyppo",  # the disagreement masks rank the critics' std (quantiles read values)
    )
} | {("filter", "zero_variance"), ("filter", "accuracy_band")}

# Families with no value checks at all (no device synchronisation): they run on meta even
# with the checks on.
NO_VALUE_CHECKS = {"policy_loss", "kl", "regularizer", "value_loss", "is_correction"}
NO_VALUE_CHECKS_ENTRIES = {("reward", "mask_truncated"), ("filter", "length")}


def universal_batch(device="cpu", length=T):
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor(
        [[1, 1, 0, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool
    )[:, :length]
    lp = -torch.rand(B, length, generator=g) * 3

    def f(*s):
        return torch.randn(*s, generator=g)

    b = {
        "response_mask": mask,
        "logprobs": lp,
        "old_logprobs": lp - 0.1 * f(B, length).abs(),
        "behavior_logprobs": lp - 0.2,
        "ref_logprobs": lp + 0.1,
        "advantages": f(B, length),
        "values": f(B, length),
        "ensemble_values": f(B, length, 2),
        "old_values": f(B, length),
        "returns": f(B, length),
        "token_rewards": f(B, length),
        "kl": f(B, length).abs(),
        "loss": f(B, length),
        "entropy": f(B, length).abs(),
        "is_weights": torch.rand(B, length, generator=g),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        "greedy_rewards": torch.tensor([0.5, 0.5, 0.0, 1.0]),
        "sample_weights": torch.rand(B, generator=g),
        "bootstrap_value": f(B),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "response_length": torch.tensor([3, 5, 1, 3]),
        "truncated": torch.tensor([False, True, False, False]),
        "accuracy": torch.tensor([1.0, 0.0, 0.5, 1.0]),
        "policy_version": torch.tensor([9, 10, 8, 10]),
        "step_rewards": f(B),
        "traj_ids": torch.tensor([0, 0, 1, 1]),
        "step_index": torch.tensor([0, 1, 0, 1]),
        "state_ids": torch.tensor([5, 6, 5, 7]),
        "episode_returns": torch.tensor([1.0, 1.0, 0.0, 0.0]),
        # the turn of each action token (IPA's chunks), -1 off the mask
        "step_ids": torch.tensor(
            [[0, 0, -1, 1, -1], [0, 0, 1, 1, 2], [3, -1, -1, -1, -1], [0, 1, 1, -1, -1]]
        )[:, :length],
    }
    return {k: v.to(device) for k, v in b.items()}


ENTRIES = [(r, n) for r, reg in REGISTRIES.items() for n in reg.names()]


def _call(reg, name, batch, **kw):
    return REGISTRIES[reg].entry(name).call(batch, **{**REQUIRED.get((reg, name), {}), **kw})


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if out is None or isinstance(out, (int, float)):  # e.g. chunk_index's number of chunks
        return []
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors(v)]
    return _tensors(getattr(out, "loss", None)) + _tensors(getattr(out, "metrics", None))


@pytest.mark.parametrize(("reg", "name"), ENTRIES)
def test_every_entry_runs_on_the_universal_batch(reg, name):
    assert _tensors(_call(reg, name, universal_batch()))


@pytest.mark.parametrize(("reg", "name"), ENTRIES)
def test_a_tensor_on_another_device_is_a_named_value_error(reg, name):
    """One argument on ``meta``, the others on the CPU: a ValueError naming it, never torch's
    error or (scatter with a meta index) uninitialised memory. Checks off, so that only the
    device check can catch it."""
    entry = REGISTRIES[reg].entry(name)
    base = universal_batch()
    args = [(a, k) for a, k in entry.in_keys.items() if k in base]
    if len(args) < 2:
        pytest.skip("a single tensor argument has no other device to disagree with")
    for arg, key in args:
        batch = {**base, key: base[key].to("meta")}
        with value_checks(False), pytest.raises(ValueError, match="device") as err:
            _call(reg, name, batch)
        assert arg in str(err.value)  # "x: is on device meta but y is on cpu" names both


@pytest.mark.parametrize(("reg", "name"), ENTRIES)
def test_meta_device_shape_inference_or_refusal_by_name(reg, name):
    batch = universal_batch("meta")
    if (reg, name) in GROUPS_ON_META:
        with value_checks(False), pytest.raises(ValueError, match="meta device"):
            _call(reg, name, batch)
    else:
        with value_checks(False):
            out = _tensors(_call(reg, name, batch))
        assert all(t.is_meta for t in out if t.ndim > 0)
    # with the value checks on: either no value is read at all, or the refusal names an argument
    if reg in NO_VALUE_CHECKS or (reg, name) in NO_VALUE_CHECKS_ENTRIES:
        with value_checks(True):
            _call(reg, name, batch)
    else:
        with value_checks(True), pytest.raises(ValueError, match=r"^\w+: is on the meta device"):
            _call(reg, name, batch)


def _hyper_params(reg, name):
    entry = REGISTRIES[reg].entry(name)
    for p in inspect.signature(entry.fn).parameters.values():
        if p.kind != p.KEYWORD_ONLY or p.name in entry.in_keys or p.name == "dtype":
            continue
        default = REQUIRED.get((reg, name), {}).get(p.name, p.default)
        if isinstance(default, bool):
            continue
        yield p.name, (["not-a-choice"] if isinstance(default, str) else ["x", float("nan")])


@pytest.mark.parametrize(("reg", "name"), ENTRIES)
def test_bad_hyper_parameters_raise_a_value_error_naming_them(reg, name):
    """The type is checked before the value: ``eps="x"`` names ``eps`` (not a TypeError from a
    comparison), NaN names the argument (not ``cannot convert float NaN to integer``)."""
    for param, bads in _hyper_params(reg, name):
        for bad in bads:
            with pytest.raises(ValueError, match=rf"^{param}:"):
                _call(reg, name, universal_batch(), **{param: bad})


@pytest.mark.parametrize(("reg", "name"), ENTRIES)
def test_empty_responses_t0_return_empty_results_or_a_documented_error(reg, name):
    batch = universal_batch(length=0)
    try:
        out = _call(reg, name, batch)
    except ValueError as e:  # only the whitening of REINFORCE++ needs a selected token
        assert name.startswith("reinforce++") and "mask: selects no elements" in str(e)
        return
    for t in _tensors(out):
        assert t.ndim < 2 or t.shape == (B, 0)


# --------------------------------------------------------------------------- primitives without a registry entry

# name -> (function, {argument: batch key}, keyword hyper-parameters): swept as the entries are
PLAIN = {
    "chunk_index": (chunk_index, {"chunk_ids": "step_ids", "mask": "response_mask"}, {}),
    "chunk_log_ratio": (
        chunk_log_ratio,
        {
            "logprobs": "logprobs",
            "old_logprobs": "old_logprobs",
            "mask": "response_mask",
            "chunk_ids": "step_ids",
        },
        {},
    ),
    "chunk_clip_mask": (
        chunk_clip_mask,
        {"chunk_log_ratio": "values", "advantages": "rewards", "mask": "response_mask"},
        {},
    ),
    "chunk_mask": (
        chunk_mask,
        {"chunk_log_ratio": "values", "mask": "response_mask"},
        {"low": 0.5, "high": 2.0},
    ),
    "explained_variance": (
        explained_variance,
        {"pred": "values", "target": "returns", "mask": "response_mask"},
        {},
    ),
    "token_level_rewards": (
        token_level_rewards,
        {"scores": "rewards", "mask": "response_mask", "kl": "kl"},
        {"kl_coef": 0.1},
    ),
    "bradley_terry": (
        bradley_terry,
        {"chosen_rewards": "rewards", "rejected_rewards": "greedy_rewards", "margin": "sample_weights"},
        {},
    ),
}
# no value checks at all: they run on meta with the checks on too
PLAIN_NO_VALUE_CHECKS = {
    "chunk_index",
    "chunk_log_ratio",
    "chunk_clip_mask",
    "chunk_mask",
    "explained_variance",
}
# outputs whose size depends on the values (the number of chunks): only the first output's
# shape is the same on meta
PLAIN_DATA_DEPENDENT = {"chunk_index"}


def _plain(name, batch):
    fn, args, kw = PLAIN[name]
    return fn(**{a: batch[k] for a, k in args.items()}, **kw)


@pytest.mark.parametrize("name", list(PLAIN))
def test_plain_primitives_infer_their_shapes_on_meta(name):
    """On ``meta`` inside ``value_checks(False)``: meta outputs of the shapes and dtypes of the
    CPU ones. With the checks on: the same, or (a value check) a refusal naming an argument."""
    want = _tensors(_plain(name, universal_batch()))
    with value_checks(False):
        got = _tensors(_plain(name, universal_batch("meta")))
    assert len(got) == len(want)
    if name in PLAIN_DATA_DEPENDENT:
        got, want = got[:1], want[:1]
    for g, w in zip(got, want):
        assert g.is_meta and g.shape == w.shape and g.dtype == w.dtype, (g, w)
    if name in PLAIN_NO_VALUE_CHECKS:
        with value_checks(True):
            assert all(t.is_meta for t in _tensors(_plain(name, universal_batch("meta"))))
    else:
        with value_checks(True), pytest.raises(ValueError, match=r"^\w+: is on the meta device"):
            _plain(name, universal_batch("meta"))


@pytest.mark.parametrize("name", list(PLAIN))
def test_plain_primitives_name_a_tensor_on_another_device(name):
    _, args, _ = PLAIN[name]
    base = universal_batch()
    for arg, key in args.items():
        batch = {**base, key: base[key].to("meta")}
        with value_checks(False), pytest.raises(ValueError, match="device") as err:
            _plain(name, batch)
        assert arg in str(err.value), str(err.value)


@pytest.mark.parametrize("name", list(PLAIN))
def test_plain_primitives_on_empty_responses(name):
    out = _tensors(_plain(name, universal_batch(length=0)))
    assert out and all(t.ndim < 2 or t.shape == (B, 0) for t in out)

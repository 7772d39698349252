"""The public strategies generate valid input, including the edge cases they promise."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.keys import SPECS
from rollkit.testing import batches, float_tensors, group_ids, masks
from rollkit.validation import check_batch


@given(batches())
def test_batches_are_valid(b):
    check_batch(b, list(b))
    m = b["response_mask"]
    assert set(b) <= set(SPECS)
    assert torch.all(b["advantages"][~m] == 0)
    assert torch.all(b["old_logprobs"] <= 0) and torch.all(b["logprobs"] <= 0)
    assert torch.all((b["old_logprobs"] - b["logprobs"]).abs() <= 2.0 + 1e-5)
    for k in ("logprobs", "rewards", "values"):
        assert torch.isfinite(b[k]).all()


@settings(max_examples=200)
@given(st.data())
def test_masks_cover_edge_cases(data):
    B = data.draw(st.integers(1, 6))
    T = data.draw(st.integers(1, 8))
    m = data.draw(masks(B, T, allow_empty_rows=False))
    assert m.dtype == torch.bool and m.shape == (B, T)
    assert m.any(dim=1).all(), "allow_empty_rows=False must keep every row non-empty"


def test_strategies_reach_singletons_empty_rows_and_holes():
    seen = {"singleton": False, "empty_row": False, "hole": False, "unsorted": False}

    @settings(max_examples=300, derandomize=True)
    @given(st.data())
    def probe(data):
        gids = data.draw(group_ids(6))
        counts = torch.unique(gids, return_counts=True)[1]
        seen["singleton"] |= bool((counts == 1).any())
        seen["unsorted"] |= bool((gids[1:] < gids[:-1]).any())
        m = data.draw(masks(4, 6))
        seen["empty_row"] |= bool((~m.any(dim=1)).any())
        # a hole: a False followed later by a True in the same row
        seen["hole"] |= bool(((~m[:, :-1]) & m[:, 1:]).any())

    probe()
    assert all(seen.values()), seen


@given(st.data())
def test_min_group_size(data):
    gids = data.draw(group_ids(9, min_group_size=3))
    counts = torch.unique(gids, return_counts=True)[1]
    assert (counts >= 3).all()


def test_min_group_size_larger_than_the_batch_raises_naming_the_argument():
    import pytest

    @given(st.data())
    def draw(data):
        data.draw(group_ids(2, min_group_size=3))

    with pytest.raises(ValueError, match="min_group_size: 3 is larger than the batch"):
        draw()


@given(batches(garbage_padding=True))
def test_garbage_padding_puts_non_finite_values_only_under_the_mask(b):
    m = b["response_mask"]
    for key in (
        "logprobs",
        "old_logprobs",
        "behavior_logprobs",
        "ref_logprobs",
        "values",
        "advantages",
        "token_rewards",
    ):
        x = b[key]
        assert torch.isfinite(x[m]).all(), key
        assert not torch.isfinite(x[~m]).any(), key
    for key in ("rewards", "group_ids", "policy_version"):
        assert torch.isfinite(b[key].double()).all()
    check_batch(
        {
            k: torch.where(m, v, torch.zeros((), dtype=v.dtype))
            if v.shape == m.shape and v.is_floating_point()
            else v
            for k, v in b.items()
        },
        list(b),
    )


def test_garbage_padding_reaches_nan_and_both_infinities():
    seen = set()

    @settings(max_examples=200, derandomize=True)
    @given(st.data())
    def probe(data):
        m = data.draw(masks(3, 4))
        x = data.draw(float_tensors((3, 4), mask=m, garbage_padding=True))
        assert torch.isfinite(x[m]).all()
        for v in x[~m].tolist():
            seen.add("nan" if v != v else ("+inf" if v > 0 else "-inf"))

    probe()
    assert seen == {"nan", "+inf", "-inf"}
    import pytest

    with pytest.raises(ValueError, match="mask: garbage_padding=True needs a bool mask"):

        @given(float_tensors((2,), garbage_padding=True))
        def bad(x):
            pass

        bad()


# --------------------------------------------------------------------------- opt-in edges (issue 14)


def test_opt_in_parameters_reach_the_edges():
    from rollkit.testing import rewards

    seen = set()

    @settings(max_examples=300, derandomize=True)
    @given(st.data())
    def probe(data):
        b = data.draw(batches(min_len=0, min_batch=0, huge=True))
        B, T = b["response_mask"].shape
        check_batch(b, list(b))
        seen.add("T=0") if T == 0 else None
        seen.add("B=0") if B == 0 else None
        mags = torch.cat([b["rewards"].abs(), b["advantages"].abs().reshape(-1)])
        assert torch.isfinite(mags).all()
        if (mags >= 1e30).any():
            seen.add("huge")
        if ((mags > 0) & (mags <= 1e-29)).any():
            seen.add("tiny")
        r = data.draw(rewards(3, extreme=True))
        if (r.abs() >= 1e6).any():
            seen.add("extreme")  # extreme=True used to be clipped to +-100 for rewards

    probe()
    assert seen == {"T=0", "B=0", "huge", "tiny", "extreme"}, seen


@given(batches(nonfinite=("advantages", "old_logprobs", "rewards")))
def test_nonfinite_puts_values_only_at_valid_positions_of_the_chosen_keys(b):
    m = b["response_mask"]
    for key in ("advantages", "old_logprobs"):
        x = b[key]
        assert torch.isfinite(x[~m]).all(), key  # padding untouched
        assert (~torch.isfinite(x[m])).any() == bool(m.any()), key
    assert not torch.isfinite(b["rewards"]).all()
    for key in ("logprobs", "values", "token_rewards", "ref_logprobs"):
        assert torch.isfinite(b[key]).all(), key


def test_nonfinite_reaches_nan_and_both_infinities_and_unknown_keys_raise():
    import pytest

    seen = set()

    @settings(max_examples=100, derandomize=True)
    @given(float_tensors((4,), nonfinite=True))
    def probe(x):
        assert not torch.isfinite(x).all()
        for v in x[~torch.isfinite(x)].tolist():
            seen.add("nan" if v != v else ("+inf" if v > 0 else "-inf"))

    probe()
    assert seen == {"nan", "+inf", "-inf"}

    @given(batches(nonfinite=("group_ids",)))
    def bad(b):
        pass

    with pytest.raises(ValueError, match="nonfinite: 'group_ids' is not a float key"):
        bad()


@given(batches(device="meta"))
def test_device_moves_every_tensor(b):
    assert all(v.is_meta for v in b.values())

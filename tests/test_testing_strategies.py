"""The public strategies generate valid input, including the edge cases they promise."""

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkit.keys import SPECS
from rollkit.testing import batches, float_tensors, group_ids, masks, shapes
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


# --------------------------------------------------------------------------- invalid input (issue 31)


def test_int_tensors_reach_every_integer_dtype_and_its_extremes():
    from rollkit.testing import INTEGER_DTYPES, int_tensors

    seen = set()

    @settings(max_examples=300, derandomize=True)
    @given(st.data())
    def probe(data):
        x = data.draw(int_tensors((4,), dtype=None, extremes=True))
        assert not x.is_floating_point() and x.dtype != torch.bool
        info = torch.iinfo(x.dtype)
        seen.add(x.dtype)
        if (x == info.max).any():
            seen.add("max")
        if (x == info.min).any():
            seen.add("min")

    probe()
    assert seen == {*INTEGER_DTYPES, "max", "min"}, seen


def test_huge_reaches_the_float32_overflow_band():
    """``huge=True`` draws between 1.8e19 (float32 squares overflow) and float32's largest."""
    seen = set()
    f32_max = float(torch.finfo(torch.float32).max)

    @settings(max_examples=200, derandomize=True)
    @given(float_tensors((6,), min_value=-f32_max, max_value=f32_max, huge=True))
    def probe(x):
        assert torch.isfinite(x).all()
        a = x.abs()
        if ((a > 1.8e19) & (a < 2.6e19)).any():
            seen.add("k2 window")  # d^2 overflows, 0.5 d^2 does not
        if (a == f32_max).any():
            seen.add("max")
        if ((a > 1e30) & (a < 1e37)).any():
            seen.add("between")

    probe()
    assert seen == {"k2 window", "max", "between"}, seen


@given(st.data())
def test_dims_are_valid_and_invalid_dims_are_not(data):
    import pytest

    from rollkit.testing import dims, invalid_dims
    from rollkit.validation import check_dim

    ndim = data.draw(st.integers(1, 4))
    dim = data.draw(dims(ndim))
    norm = check_dim("dim", dim, ndim)
    x = torch.zeros((2,) * ndim)
    want = x.sum() if dim is None else x.sum(dim=dim)
    assert want.ndim == (0 if norm is None else ndim - len(norm))
    with pytest.raises((ValueError, TypeError), match=r"^dim: "):
        check_dim("dim", data.draw(invalid_dims(ndim)), ndim)


@given(st.data())
def test_invalid_masks_are_invalid(data):
    import pytest

    from rollkit.testing import invalid_masks
    from rollkit.validation import check_mask

    B, T = data.draw(shapes(max_batch=4, max_len=4))
    with pytest.raises((ValueError, TypeError), match=r"^mask: "):
        check_mask("mask", data.draw(invalid_masks((B, T))), torch.zeros(B, T), "x")


def test_invalid_masks_reach_every_kind():
    from rollkit.testing import invalid_masks

    seen = set()

    @settings(max_examples=200, derandomize=True)
    @given(invalid_masks((3, 4)))
    def probe(m):
        if not isinstance(m, torch.Tensor):
            seen.add("non-tensor" if m is not None else "None")
        elif m.dtype != torch.bool:
            seen.add("dtype")
        elif m.ndim != 2:
            seen.add("more dims" if m.ndim > 2 else "fewer dims")
        else:
            seen.add("size")

    probe()
    assert seen == {"non-tensor", "None", "dtype", "more dims", "fewer dims", "size"}, seen


# --------------------------------------------------------------------------- agentic layouts


@given(st.data())
def test_chunk_ids_are_valid_turn_ids(data):
    from rollkit.testing import chunk_ids

    B, T = data.draw(shapes(max_batch=5, max_len=8))
    m = data.draw(masks(B, T))
    interleaved = data.draw(st.booleans())
    k = data.draw(st.sampled_from([None, 1, 2]))
    ids = data.draw(chunk_ids(m, max_chunks=k, interleaved=interleaved))
    assert ids.dtype == torch.int64 and ids.shape == (B, T)
    for i in range(B):
        valid = ids[i][m[i]]
        if k is not None:
            assert len(valid.unique()) <= k
        if not interleaved and len(valid) > 1:  # turns: non-decreasing along the row (stride > 0)
            assert (valid[1:] >= valid[:-1]).all()


def test_chunk_ids_reach_holes_shared_ids_garbage_and_interleaving():
    from rollkit.testing import chunk_ids

    seen = set()

    @settings(max_examples=200, derandomize=True)
    @given(st.data())
    def probe(data):
        m = data.draw(masks(3, 6))
        interleaved = data.draw(st.booleans())
        ids = data.draw(chunk_ids(m, interleaved=interleaved))
        for i in range(3):
            cols = m[i].nonzero().flatten().tolist()
            v = ids[i].tolist()
            if len({v[c] for c in cols}) > 1:
                seen.add("several turns")
            # a turn spanning a masked position: equal ids on both sides of a hole
            for a, b in itertools.pairwise(cols):
                if b > a + 1 and v[a] == v[b]:
                    seen.add("turn across a hole")
            # a chunk that is not contiguous among the valid tokens: id x, then y, then x
            seq = [v[c] for c in cols]
            if any(seq[j] != seq[j + 1] and seq[j] in seq[j + 2 :] for j in range(len(seq) - 1)):
                seen.add("interleaved")
        shared = set(ids[0][m[0]].tolist()) & set(ids[1][m[1]].tolist())
        if shared:
            seen.add("id in two rows")
        if (ids[~m] < 0).any() or (ids[~m].abs() >= 2**40).any():
            seen.add("garbage")

    probe()
    assert seen == {"several turns", "turn across a hole", "interleaved", "id in two rows", "garbage"}, seen


@given(st.data())
def test_step_batches_are_valid_step_layouts(data):
    from rollkit.testing import step_batches

    gaps = data.draw(st.booleans())
    b = data.draw(step_batches(min_traj=0, gaps=gaps, extreme=data.draw(st.booleans())))
    check_batch(b, list(b))
    n = b["step_rewards"].shape[0]
    assert set(b) == {"step_rewards", "traj_ids", "step_index", "group_ids", "state_ids"}
    assert torch.isfinite(b["step_rewards"]).all()
    pairs = list(zip(b["traj_ids"].tolist(), b["step_index"].tolist()))
    assert len(set(pairs)) == n and all(s >= 0 for _, s in pairs)
    for t in b["traj_ids"].unique():
        sel = b["traj_ids"] == t
        assert len(b["group_ids"][sel].unique()) == 1  # one task group per episode
        steps = sorted(b["step_index"][sel].tolist())
        assert steps[0] == 0
        if not gaps:
            assert steps == list(range(len(steps)))


def test_step_batches_reach_the_edges():
    from rollkit.testing import step_batches

    seen = set()

    @settings(max_examples=200, derandomize=True)
    @given(step_batches(min_traj=0, gaps=True))
    def probe(b):
        n = b["step_rewards"].shape[0]
        if n == 0:
            seen.add("N=0")
            return
        steps = b["step_index"]
        for t in b["traj_ids"].unique():
            s = sorted(steps[b["traj_ids"] == t].tolist())
            if any(y - x > 1 for x, y in itertools.pairwise(s)):
                seen.add("gap")
        order = b["traj_ids"].tolist()
        if any(x != y for x, y in zip(order, sorted(order))):
            seen.add("shuffled")
        _, counts = torch.unique(b["group_ids"], return_counts=True)
        if len(counts) > 1:
            seen.add("several groups")
        key = b["group_ids"] * 1000 + b["state_ids"]
        traj_of = {}
        for k, t in zip(key.tolist(), b["traj_ids"].tolist()):
            traj_of.setdefault(k, set()).add(t)
        if any(len(v) > 1 for v in traj_of.values()):
            seen.add("shared anchor state")

    probe()
    assert seen == {"N=0", "gap", "shuffled", "several groups", "shared anchor state"}, seen

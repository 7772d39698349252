"""Public hypothesis strategies that generate valid rollkit batches, for property tests.

Use them in your own tests of loss math::

    from hypothesis import given
    from rollkit.testing import batches

    @given(batches())
    def test_my_loss_is_finite(b):
        out = my_loss(b["logprobs"], b["old_logprobs"], b["advantages"], b["response_mask"])
        assert torch.isfinite(out).all()

By default everything generated is *valid* input (bool masks, finite floats under the mask,
int group ids, CPU tensors, ``T >= 1``); ragged masks (including fully masked rows and
interior holes, as in multi-turn) and arbitrary group ids (any order, any sizes, singletons)
are always drawn. Opt-in parameters reach the edges:

=======================  ===================================================================
parameter                draws
=======================  ===================================================================
``extreme=True``         magnitudes up to ``1e6`` and down to ``1e-6`` (rewards, advantages)
``huge=True``            magnitudes from ``1.8e19`` (where float32 squares overflow) up to
                         float32's largest, ``3.4e38``, and down to ``1e-30``, for rewards and
                         advantages
``garbage_padding=True`` NaN / ``+-inf`` at the masked-out positions of the ``[B, T]`` float
                         keys (valid input: rollkit ignores what lies under a False mask)
``nonfinite=...``        NaN / ``+-inf`` at *valid* positions (invalid input: for tests of
                         the documented error or propagation), at least one per chosen key
``min_len=0``            ``T = 0`` (empty responses); ``min_batch=0``: ``B = 0``
``device=...``           every tensor on that device (``"meta"`` for shape inference,
                         ``"cuda"``)
=======================  ===================================================================

Strategies for the multi-turn (agentic) layouts:

==========================  ================================================================
strategy                    draws
==========================  ================================================================
``chunk_ids(mask)``         ``[B, T]`` interaction-chunk (turn) ids of the valid tokens of a
                            mask, for IPA's chunk primitives (:mod:`rollkit.losses.ipa`):
                            turns of any length, spanning masked holes, arbitrary ids (the
                            same id in several rows), garbage ids under the mask;
                            ``interleaved=True``: non-contiguous chunks
``step_batches()``          the step layout of :mod:`rollkit.advantages.agentic` (one row per
                            turn): ``step_rewards``, ``traj_ids``, ``step_index``,
                            ``group_ids`` (constant per episode), ``state_ids``; ragged
                            episodes in a shuffled order, arbitrary ids, optional gaps
==========================  ================================================================

Strategies for *invalid* input, to test that a primitive rejects it by name (a ``ValueError``
or ``TypeError`` whose message starts with the argument's name) instead of crashing inside
torch or answering silently:

=========================  =================================================================
strategy                   draws
=========================  =================================================================
``int_tensors(shape)``     integer tensors (``dtype=`` one of :data:`INTEGER_DTYPES`;
                           ``extremes=True`` adds the dtype's smallest and largest values)
``integer_dtypes()``       ``torch.int8`` ... ``torch.int64``, ``torch.uint8``
``dims(ndim)``             valid ``dim`` arguments: ``None``, an int, a tuple of distinct ints
``invalid_dims(ndim)``     out-of-range ints, repeated dims, empty tuples, floats, strings,
                           bools
``invalid_masks(shape)``   masks of another shape (a dimension more or less, a size off),
                           of a non-bool dtype, or not tensors (``None``, lists, numpy
                           arrays, numbers)
``non_tensors()``          ``None``, lists, numbers, strings, numpy arrays
=========================  =================================================================

:func:`check_float64_agreement` runs a function on float32 tensors and on their float64 copies
and compares every output (:func:`assert_float64_close`: never NaN where float64 gives a
number, ``+-inf`` only where the float64 value does not fit float32): the test that finite input
of any magnitude (``huge=True``) gives the float64 result.

Requires the ``hypothesis`` package (the ``dev`` extra); importing this module without it
raises a clear error.
"""

from __future__ import annotations

try:
    from hypothesis import assume
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - exercised only without the dev extra
    raise ImportError(
        "rollkit.testing needs hypothesis: pip install 'rollkit-rl[dev]' (or pip install hypothesis)"
    ) from e

from collections.abc import Sequence

import torch

__all__ = [
    "INTEGER_DTYPES",
    "assert_float64_close",
    "batches",
    "check_float64_agreement",
    "chunk_ids",
    "dims",
    "float_tensors",
    "group_ids",
    "int_tensors",
    "integer_dtypes",
    "invalid_dims",
    "invalid_masks",
    "logprob_tensors",
    "masks",
    "non_tensors",
    "rewards",
    "shapes",
    "step_batches",
]


@st.composite
def shapes(draw, *, min_batch: int = 1, max_batch: int = 8, min_len: int = 1, max_len: int = 12):
    """``(B, T)`` with ``min_batch <= B <= max_batch`` and ``min_len <= T <= max_len``."""
    return (
        draw(st.integers(min_batch, max_batch)),
        draw(st.integers(min_len, max_len)),
    )


@st.composite
def masks(
    draw,
    batch: int,
    length: int,
    *,
    holes: bool = True,
    allow_empty_rows: bool = True,
    min_tokens: int = 1,
):
    """A ``[batch, length]`` bool response mask, right-padded with ragged lengths.

    ``holes=True`` also clears interior positions (environment / tool tokens in multi-turn).
    Unless ``allow_empty_rows``, every row keeps at least one token (rows of ``length = 0``
    have none to keep). At least ``min_tokens`` tokens are selected in the whole mask (``0``
    allows an all-False mask; pass ``0`` with ``length = 0`` or ``batch = 0``).
    """
    lo = 0 if allow_empty_rows and length > 0 else min(1, length)
    lens = draw(st.lists(st.integers(lo, length), min_size=batch, max_size=batch))
    m = torch.arange(length).unsqueeze(0) < torch.tensor(lens, dtype=torch.int64).unsqueeze(1)
    if holes and length > 1:
        flat = draw(st.lists(st.booleans(), min_size=batch * length, max_size=batch * length))
        hole = torch.tensor(flat, dtype=torch.bool).reshape(batch, length)
        # keep the first token of each row so that a non-empty row stays non-empty
        hole[:, 0] = False
        m = m & ~hole
    if int(m.sum()) < min_tokens:
        assume(batch * length >= min_tokens)
        m.view(-1)[:min_tokens] = True
    return m


@st.composite
def group_ids(draw, batch: int, *, max_groups: int | None = None, min_group_size: int = 1):
    """``[batch]`` int64 group ids in arbitrary order with arbitrary (possibly singleton) sizes.

    Ids are arbitrary non-negative integers (not ``0..G-1``), shuffled. ``min_group_size > 1``
    forces every group to have at least that many members (groups are then merged); it
    raises ``ValueError`` when ``0 < batch < min_group_size`` (no such grouping exists).
    """
    if 0 < batch < min_group_size:
        raise ValueError(
            f"min_group_size: {min_group_size} is larger than the batch ({batch}); no grouping has "
            f"groups of at least {min_group_size} members"
        )
    max_groups = max(max_groups or batch, 1)
    labels = draw(st.lists(st.integers(0, max_groups - 1), min_size=batch, max_size=batch))
    if min_group_size > 1:
        k = max(1, batch // min_group_size)
        labels = [lab % k for lab in labels]
        counts = {lab: labels.count(lab) for lab in set(labels)}
        small = [lab for lab, c in counts.items() if c < min_group_size]
        if small:
            target = max(counts, key=counts.get)
            labels = [target if lab in small else lab for lab in labels]
    offset = draw(st.integers(0, 1000))
    stride = draw(st.sampled_from([1, 3, 17]))
    return torch.tensor([offset + stride * lab for lab in labels], dtype=torch.int64)


_EXTREME = (1e6, -1e6, 1e3, -1e3, 1e-6, -1e-6, 0.0)
_F32_MAX = float(torch.finfo(torch.float32).max)
# float32-representable; squares overflow float32 above ~1.8e19 (0.5 * d^2 above ~2.6e19),
# differences of opposite-signed values above ~1.7e38, and 1e-30 squared underflows
_HUGE = (
    _F32_MAX,
    -_F32_MAX,
    3e38,
    -3e38,
    1e38,
    -1e38,
    3e30,
    -3e30,
    1e30,
    -1e30,
    1e20,
    -1e20,
    2.5e19,
    -2.5e19,
    2e19,
    -2e19,
    1e-30,
    -1e-30,
    0.0,
)
_NONFINITE = (float("nan"), float("inf"), float("-inf"))


def _f32(v: float) -> float:
    """``v`` rounded to float32 (what ``torch.tensor(v, dtype=torch.float32)`` holds)."""
    return float(torch.tensor(v, dtype=torch.float32))


def _f32_inward(low: float, high: float) -> tuple[float, float]:
    """The float32 values nearest to ``[low, high]`` inside it (hypothesis needs bounds that
    float32 represents exactly, e.g. ``1e30`` is not)."""
    lo, hi = torch.tensor([low, high], dtype=torch.float32)
    if float(lo) < low:
        lo = torch.nextafter(lo, torch.tensor(float("inf")))
    if float(hi) > high:
        hi = torch.nextafter(hi, torch.tensor(float("-inf")))
    return float(lo), float(hi)


def _floats(low: float, high: float):
    # No subnormals: their arithmetic is platform-dependent (GPUs and many CPU builds flush them
    # to zero), and squaring one underflows, so no rollkit statistic can promise anything there.
    low, high = _f32_inward(low, high)
    return st.floats(low, high, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32)


@st.composite
def float_tensors(
    draw,
    shape: tuple[int, ...],
    *,
    min_value: float = -10.0,
    max_value: float = 10.0,
    extreme: bool = False,
    huge: bool = False,
    dtype: torch.dtype = torch.float32,
    mask: torch.Tensor | None = None,
    garbage_padding: bool = False,
    nonfinite: bool = False,
    device: torch.device | str | None = None,
):
    """A finite float tensor of ``shape``. ``extreme=True`` also draws magnitudes up to 1e6
    and tiny values near 1e-6, ``huge=True`` magnitudes from ``2e19`` (float32 squares
    overflow above ``1.8e19``) up to float32's largest finite value (``3.4e38``) and down to
    ``1e-30``; both are clipped to ``[min_value, max_value]`` (widen those to reach them, e.g.
    ``min_value=-3.4e38, max_value=3.4e38``).

    ``garbage_padding=True`` (needs a bool ``mask`` of ``shape``) replaces every entry where
    ``mask`` is False by a drawn NaN, ``+inf`` or ``-inf``; the selected entries stay finite.
    ``nonfinite=True`` puts a drawn NaN / ``+inf`` / ``-inf`` at one or more *selected*
    entries (where ``mask`` is True, or anywhere without a mask; none if nothing is selected):
    invalid input, for tests of errors and NaN propagation. ``device`` moves the result there
    (``"meta"`` keeps only the shape).
    """
    n = 1
    for s in shape:
        n *= s
    elems = _floats(min_value, max_value)
    special = [
        v
        for v in (*(_EXTREME if extreme else ()), *(_HUGE if huge else ()))
        if min_value <= _f32(v) <= max_value
    ]
    if special:
        elems = st.one_of(elems, st.sampled_from(special))
    values = draw(st.lists(elems, min_size=n, max_size=n))
    out = torch.tensor(values, dtype=dtype).reshape(shape)
    if garbage_padding or nonfinite:
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != tuple(shape)):
            raise ValueError(f"mask: expected a bool mask of shape {list(shape)}")
    if garbage_padding:
        if mask is None:
            raise ValueError(f"mask: garbage_padding=True needs a bool mask of shape {list(shape)}")
        out = _garbage_under(draw, out, mask)
    if nonfinite:
        out = _nonfinite_at(draw, out, torch.ones(shape, dtype=torch.bool) if mask is None else mask)
    return out if device is None else out.to(device)


_GARBAGE = (float("nan"), float("inf"), float("-inf"))


def _nonfinite_at(draw, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with a drawn NaN / +inf / -inf at one or more positions where ``mask`` is True
    (``x`` itself if there is none)."""
    where = mask.reshape(-1).nonzero().reshape(-1).tolist()
    if not where:
        return x
    picked = draw(st.lists(st.sampled_from(where), min_size=1, max_size=len(where), unique=True))
    bad = draw(st.lists(st.sampled_from(_NONFINITE), min_size=len(picked), max_size=len(picked)))
    out = x.clone()
    out.view(-1)[torch.tensor(picked, dtype=torch.int64)] = torch.tensor(bad, dtype=x.dtype)
    return out


def _garbage_under(draw, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with a drawn NaN / +inf / -inf at every position where ``mask`` is False."""
    n_bad = int((~mask).sum())
    if n_bad == 0:
        return x
    bad = draw(st.lists(st.sampled_from(_GARBAGE), min_size=n_bad, max_size=n_bad))
    out = x.clone()
    out[~mask] = torch.tensor(bad, dtype=x.dtype)
    return out


def _bound(extreme: bool, huge: bool, default: float) -> float:
    """The magnitude bound of rewards / advantages: wide enough for the opted-in values."""
    return float(torch.finfo(torch.float32).max) if huge else (1e6 if extreme else default)


def rewards(
    batch: int,
    *,
    binary: bool = False,
    extreme: bool = False,
    huge: bool = False,
    nonfinite: bool = False,
    device: torch.device | str | None = None,
):
    """``[batch]`` sequence rewards: 0/1 accuracies (``binary``) or finite floats in
    ``[-100, 100]``; ``extreme=True`` widens the range to ``1e6`` (and draws ``1e6``, ``1e-6``,
    ...), ``huge=True`` to float32's (drawing ``2e19``, ``1e30``, ``1e38``, ``3.4e38``,
    ``1e-30``, ...).
    ``nonfinite=True`` puts NaN / ``+-inf`` in at least one entry (when ``batch > 0``)."""
    if binary:
        out = st.lists(st.sampled_from([0.0, 1.0]), min_size=batch, max_size=batch).map(
            lambda v: torch.tensor(v, dtype=torch.float32)
        )
        if nonfinite:
            raise ValueError("nonfinite: binary rewards are 0/1; draw float rewards (binary=False)")
        return out if device is None else out.map(lambda t: t.to(device))
    bound = _bound(extreme, huge, 100.0)
    return float_tensors(
        (batch,),
        min_value=-bound,
        max_value=bound,
        extreme=extreme,
        huge=huge,
        nonfinite=nonfinite,
        device=device,
    )


def logprob_tensors(
    shape: tuple[int, ...],
    *,
    min_value: float = -20.0,
    nonfinite: bool = False,
    device: torch.device | str | None = None,
):
    """Log-probabilities: finite values in ``[min_value, 0]`` (``nonfinite=True``: NaN /
    ``+-inf`` at one or more entries)."""
    return float_tensors(shape, min_value=min_value, max_value=0.0, nonfinite=nonfinite, device=device)


@st.composite
def batches(
    draw,
    *,
    min_batch: int = 1,
    max_batch: int = 8,
    max_len: int = 12,
    holes: bool = True,
    allow_empty_rows: bool = True,
    binary_rewards: bool = False,
    max_log_ratio: float = 2.0,
    extreme: bool = False,
    garbage_padding: bool = False,
    min_len: int = 1,
    huge: bool = False,
    nonfinite: bool | Sequence[str] = False,
    device: torch.device | str | None = None,
):
    """A dict with every standard key of :mod:`rollkit.keys` (see its table for shapes).

    ``old_logprobs``, ``behavior_logprobs`` and ``ref_logprobs`` differ from ``logprobs`` by at
    most ``max_log_ratio`` per token (so ratios are in ``[e^-r, e^r]``) and stay ``<= 0``.
    ``advantages`` are token-level, zero outside the mask. Tensors have no ``requires_grad``;
    set it on ``logprobs`` where a test needs the gradient.

    ``extreme=True`` draws ``advantages`` and ``rewards`` with magnitudes up to 1e6 and down
    to 1e-6, ``huge=True`` up to float32's largest (``3.4e38``) and down to 1e-30 (the
    log-probabilities are unaffected). ``garbage_padding=True`` puts NaN / ``+inf`` / ``-inf`` at every masked-out
    position of the ``[B, T]`` float keys (``logprobs``, ``old_logprobs``,
    ``behavior_logprobs``, ``ref_logprobs``, ``values``, ``advantages``, ``token_rewards``), so
    that a property test catches any mask leak in value or gradient.

    ``nonfinite`` (``True`` for all the float keys, or a sequence of key names) puts NaN /
    ``+-inf`` at one or more *valid* positions of each chosen key (``rewards``: any entry),
    whenever the mask has a valid position: invalid input, to test the documented error or
    propagation. Find them with ``~torch.isfinite(b[key]) & b["response_mask"]``.
    ``min_len=0`` (``min_batch=0``) allows ``T = 0`` (``B = 0``). ``device`` moves every tensor
    there (``"meta"``: shapes only).
    """
    B, T = draw(shapes(min_batch=min_batch, max_batch=max_batch, min_len=min_len, max_len=max_len))
    mask = draw(masks(B, T, holes=holes, allow_empty_rows=allow_empty_rows, min_tokens=min(1, B * T)))
    lp = draw(logprob_tensors((B, T)))

    def near(x):
        d = draw(float_tensors((B, T), min_value=-max_log_ratio, max_value=max_log_ratio))
        return (x + d).clamp(max=0.0)

    bound = _bound(extreme, huge, 5.0)
    adv_seq = draw(float_tensors((B,), min_value=-bound, max_value=bound, extreme=extreme, huge=huge))
    out = {
        "response_mask": mask,
        "logprobs": lp,
        "old_logprobs": near(lp),
        "behavior_logprobs": near(lp),
        "ref_logprobs": near(lp),
        "values": draw(float_tensors((B, T), min_value=-5.0, max_value=5.0)),
        "advantages": torch.where(mask, adv_seq[:, None].expand(B, T), torch.zeros(())),
        "rewards": draw(rewards(B, binary=binary_rewards, extreme=extreme, huge=huge)),
        "token_rewards": draw(float_tensors((B, T), min_value=-1.0, max_value=1.0)) * mask,
        "group_ids": draw(group_ids(B)),
        "policy_version": torch.tensor(
            draw(st.lists(st.integers(0, 10), min_size=B, max_size=B)), dtype=torch.int64
        ),
    }
    if garbage_padding:
        for key in _TOKEN_FLOAT_KEYS:
            out[key] = _garbage_under(draw, out[key], mask)
    chosen = (*_TOKEN_FLOAT_KEYS, "rewards") if nonfinite is True else tuple(nonfinite or ())
    for key in chosen:
        if key not in _TOKEN_FLOAT_KEYS and key != "rewards":
            raise ValueError(
                f"nonfinite: {key!r} is not a float key; choose from {[*_TOKEN_FLOAT_KEYS, 'rewards']}"
            )
        valid = torch.ones(B, dtype=torch.bool) if key == "rewards" else mask
        out[key] = _nonfinite_at(draw, out[key], valid)
    if device is not None:
        out = {k: v.to(device) for k, v in out.items()}
    return out


_TOKEN_FLOAT_KEYS = (
    "logprobs",
    "old_logprobs",
    "behavior_logprobs",
    "ref_logprobs",
    "values",
    "advantages",
    "token_rewards",
)


# --------------------------------------------------------------------------- agentic layouts

_GARBAGE_IDS = (-1, 0, 3, 2**40, -(2**40))


@st.composite
def chunk_ids(draw, mask: torch.Tensor, *, max_chunks: int | None = None, interleaved: bool = False):
    """``[B, T]`` int64 interaction-chunk ids for the bool ``[B, T]`` ``mask``, as IPA's
    chunk primitives take them (``TrajectoryBatch.step_ids``: the turn of each action token).

    On each row the valid tokens are cut into turns at drawn positions (a new turn may start
    at any valid token, so a turn may span masked positions: tool and environment tokens) and
    the turns are numbered by a drawn offset and stride per row, so the ids are arbitrary
    (not ``0..C-1``, possibly negative) and the same id occurs in several rows (each row's own
    chunk). ``max_chunks`` bounds the turns of a row. ``interleaved=True`` instead draws each
    valid token's turn among ``max_chunks`` (default 3) values: chunks that are not contiguous,
    in any order. Where ``mask`` is False the ids are garbage (``-1``, ``0``, ``+-2**40``,
    ...), which rollkit ignores: valid input.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=10, database=None)
    ... @given(chunk_ids(torch.tensor([[True, True, False, True], [False, True, True, True]])))
    ... def test(ids):
    ...     assert ids.shape == (2, 4) and ids.dtype == torch.int64
    >>> test()
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.ndim != 2:
        raise ValueError("mask: expected a [B, T] bool tensor")
    if max_chunks is not None and max_chunks < 1:
        raise ValueError(f"max_chunks: expected >= 1, got {max_chunks}")
    b, t = mask.shape
    n = b * t
    if interleaved:
        k = 3 if max_chunks is None else max_chunks
        turn = _int_list(draw, st.integers(0, k - 1), n)
    else:
        starts = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool)
        turn = (starts.reshape(b, t) & mask).to(torch.int64).cumsum(-1).reshape(-1)
        if max_chunks is not None:
            turn = turn.clamp(max=max_chunks - 1)
    offset = _int_list(draw, st.integers(-5, 20), b).unsqueeze(-1)
    stride = _int_list(draw, st.sampled_from([1, 2, 7]), b).unsqueeze(-1)
    junk = _int_list(draw, st.sampled_from(_GARBAGE_IDS), n).reshape(b, t)
    return torch.where(mask, offset + stride * turn.reshape(b, t), junk)


def _int_list(draw, elems, n: int) -> torch.Tensor:
    """``[n]`` int64 tensor of drawn ``elems``."""
    return torch.tensor(draw(st.lists(elems, min_size=n, max_size=n)), dtype=torch.int64).reshape(n)


@st.composite
def step_batches(
    draw,
    *,
    min_traj: int = 1,
    max_traj: int = 7,
    max_len: int = 5,
    n_states: int = 3,
    max_groups: int = 3,
    gaps: bool = False,
    binary_rewards: bool | None = None,
    extreme: bool = False,
    huge: bool = False,
    device: torch.device | str | None = None,
):
    """A step-wise agent batch (one row per turn), the layout of
    :mod:`rollkit.advantages.agentic` and :func:`rollkit.advantages.ipa_advantages`: a dict of
    ``[N]`` tensors ``step_rewards`` (float), ``traj_ids``, ``step_index``, ``group_ids`` and
    ``state_ids`` (int64).

    ``min_traj..max_traj`` episodes (``min_traj=0`` allows ``N = 0``) of ``1..max_len`` steps
    each, with arbitrary distinct episode ids, assigned to task groups by :func:`group_ids`
    (at most ``max_groups``; the group is constant over an episode, singletons included);
    states from an alphabet of ``n_states`` (so that steps of several episodes share a state,
    GiGPO's anchors); the rows shuffled. ``step_index`` counts ``0, 1, 2, ...`` per episode,
    or with ``gaps=True`` skips turns (steps ``1`` or ``2`` apart). Rewards are drawn by
    :func:`rewards` (0/1 when ``binary_rewards``; drawn either way when ``None``;
    ``extreme`` / ``huge`` as there). ``device`` moves every tensor there.

    >>> from hypothesis import given, settings
    >>> from rollkit.advantages import discounted_return_advantages
    >>> @settings(max_examples=10, database=None)
    ... @given(step_batches(gaps=True))
    ... def test(b):
    ...     adv = discounted_return_advantages(b["step_rewards"], b["traj_ids"], b["step_index"], b["group_ids"])
    ...     assert adv.shape == b["step_rewards"].shape
    >>> test()
    """
    num_traj = draw(st.integers(min_traj, max_traj))
    traj_group = draw(group_ids(num_traj, max_groups=max_groups)).tolist()
    lengths = draw(st.lists(st.integers(1, max_len), min_size=num_traj, max_size=num_traj))
    traj_label = draw(st.lists(st.integers(-50, 50), min_size=num_traj, max_size=num_traj, unique=True))
    rows = []  # (traj, step, group)
    for j in range(num_traj):
        step = 0
        for _ in range(lengths[j]):
            rows.append((traj_label[j], step, traj_group[j]))
            step += draw(st.integers(1, 2)) if gaps else 1
    n = len(rows)
    order = draw(st.permutations(range(n)))
    rows = [rows[i] for i in order]
    states = draw(st.lists(st.integers(0, n_states - 1), min_size=n, max_size=n))
    binary = draw(st.booleans()) if binary_rewards is None else binary_rewards
    r = draw(rewards(n, binary=binary, extreme=extreme and not binary, huge=huge and not binary))

    def ints(values):
        return torch.tensor(values, dtype=torch.int64).reshape(-1)

    out = {
        "step_rewards": r,
        "traj_ids": ints([row[0] for row in rows]),
        "step_index": ints([row[1] for row in rows]),
        "group_ids": ints([row[2] for row in rows]),
        "state_ids": ints(states),
    }
    return out if device is None else {k: v.to(device) for k, v in out.items()}


# --------------------------------------------------------------------------- invalid input

#: The integer dtypes :func:`int_tensors` and :func:`integer_dtypes` draw from.
INTEGER_DTYPES: tuple[torch.dtype, ...] = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def integer_dtypes():
    """One of :data:`INTEGER_DTYPES`."""
    return st.sampled_from(INTEGER_DTYPES)


@st.composite
def int_tensors(
    draw,
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype | None = torch.int64,
    min_value: int | None = None,
    max_value: int | None = None,
    extremes: bool = False,
    device: torch.device | str | None = None,
):
    """An integer tensor of ``shape`` and ``dtype`` (``None``: drawn from
    :data:`INTEGER_DTYPES`), with values in ``[min_value, max_value]`` (default ``[-100,
    100]`` clipped to the dtype's range). ``extremes=True`` also draws the dtype's smallest
    and largest values (``torch.iinfo(dtype).min`` / ``.max``), where a fill value of
    ``+-inf``, a sum or a negation overflows. For tests that a primitive taking floats rejects
    integers by name, or that one taking integers handles their whole range."""
    if dtype is None:
        dtype = draw(integer_dtypes())
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"dtype: expected an integer dtype, got {dtype}")
    info = torch.iinfo(dtype)
    lo = max(info.min, -100 if min_value is None else int(min_value))
    hi = min(info.max, 100 if max_value is None else int(max_value))
    if lo > hi:
        raise ValueError(f"min_value, max_value: empty range [{lo}, {hi}] for {dtype}")
    elems = st.integers(lo, hi)
    if extremes:
        elems = st.one_of(elems, st.sampled_from([info.min, info.max, info.min + 1, info.max - 1]))
    n = 1
    for s in shape:
        n *= s
    values = draw(st.lists(elems, min_size=n, max_size=n))
    out = torch.tensor(values, dtype=dtype).reshape(shape)
    return out if device is None else out.to(device)


@st.composite
def dims(draw, ndim: int, *, allow_none: bool = True, allow_tuple: bool = True):
    """A valid reduction ``dim`` argument for a tensor of ``ndim`` dimensions (``ndim >= 1``):
    ``None`` (when ``allow_none``), an int in ``[-ndim, ndim)`` or (when ``allow_tuple``) a
    non-empty tuple of distinct dimensions, each written as a positive or a negative index."""
    if ndim < 1:
        raise ValueError(f"ndim: expected >= 1, got {ndim}")
    kinds = ["int", *(["none"] if allow_none else []), *(["tuple"] if allow_tuple else [])]
    kind = draw(st.sampled_from(kinds))
    if kind == "none":
        return None
    if kind == "int":
        return draw(st.integers(-ndim, ndim - 1))
    chosen = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
    signs = draw(st.lists(st.booleans(), min_size=len(chosen), max_size=len(chosen)))
    return tuple(d - ndim if neg else d for d, neg in zip(chosen, signs))


@st.composite
def invalid_dims(draw, ndim: int):
    """A ``dim`` argument no reduction over a tensor of ``ndim`` dimensions should accept:
    an int outside ``[-max(ndim, 1), max(ndim, 1))`` (alone or in a tuple), a dimension
    repeated in a tuple (also as ``d`` and ``d - ndim``), an empty tuple (torch reads ``()`` as
    "every dimension", numpy as "none"), or a value of the wrong type (a float, a string, a
    bool, a tensor)."""
    n = max(ndim, 1)
    out_of_range = st.one_of(st.integers(n, n + 64), st.integers(-n - 64, -n - 1))
    kind = draw(st.sampled_from(["int", "tuple_oob", "repeat", "empty", "type"]))
    if kind == "int":
        return draw(out_of_range)
    if kind == "tuple_oob":
        valid = draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True))
        bad = draw(out_of_range)
        pos = draw(st.integers(0, len(valid)))
        return (*valid[:pos], bad, *valid[pos:])
    if kind == "repeat":
        d = draw(st.integers(0, n - 1))
        return (d, draw(st.sampled_from([d, d - n])))
    if kind == "empty":
        return ()
    return draw(st.sampled_from([1.0, 0.5, "0", True, False, torch.tensor(0), [0.0]]))


@st.composite
def invalid_masks(draw, shape: tuple[int, ...]):
    """Something that is not a valid bool mask of ``shape``: a bool tensor with a dimension
    more or less or a size off by ``1..3``, a tensor of ``shape`` with a non-bool dtype
    (float 0/1, int 0/1, uint8), or not a tensor at all (``None``, a nested list, a numpy
    array, a number). A mask with a dimension of size 1 more, or one fewer, would broadcast
    silently in ``torch.where``: a primitive must refuse it, not broadcast it."""
    kind = draw(st.sampled_from(["more_dims", "fewer_dims", "size_off", "dtype", "non_tensor"]))
    if kind == "more_dims":
        extra = draw(st.integers(1, 3))
        pos = draw(st.integers(0, len(shape)))
        return torch.ones((*shape[:pos], extra, *shape[pos:]), dtype=torch.bool)
    if kind == "fewer_dims" and len(shape) > 0:
        pos = draw(st.integers(0, len(shape) - 1))
        return torch.ones(shape[:pos] + shape[pos + 1 :], dtype=torch.bool)
    if kind in ("size_off", "fewer_dims") and len(shape) > 0:
        pos = draw(st.integers(0, len(shape) - 1))
        delta = draw(st.sampled_from([-3, -2, -1, 1, 2, 3]))
        size = shape[pos] + delta
        if size < 0:
            size = shape[pos] + 1
        return torch.ones((*shape[:pos], size, *shape[pos + 1 :]), dtype=torch.bool)
    if kind == "dtype":
        dtype = draw(st.sampled_from([torch.float32, torch.int64, torch.uint8, torch.int32, torch.float64]))
        return torch.ones(shape, dtype=dtype)
    return draw(non_tensors(shape))


def non_tensors(shape: tuple[int, ...] = (2,)):
    """A value that is not a ``torch.Tensor``: ``None``, a (nested) list of ``shape``, a numpy
    array of ``shape``, a Python number, a string."""
    import numpy as np

    def nested(value):
        out = value
        for s in reversed(shape):
            out = [out] * s
        return out

    return st.sampled_from(
        [
            None,
            nested(True),
            nested(1.0),
            np.ones(shape, dtype=bool),
            np.ones(shape, dtype=np.float32),
            1.0,
            3,
            "mask",
        ]
    )


# --------------------------------------------------------------------------- float64 agreement

_F32_MAX_T = float(torch.finfo(torch.float32).max)
_F32_TINY = float(torch.finfo(torch.float32).tiny)


def assert_float64_close(
    got: torch.Tensor, ref: torch.Tensor, *, rtol: float = 1e-4, atol: float | torch.Tensor = 0.0
) -> None:
    """Raise ``AssertionError`` unless the float32 ``got`` is the float64 ``ref`` rounded: never
    NaN where ``ref`` is a number; ``+-inf`` of ``ref``'s sign where ``|ref|`` is beyond
    float32's range (and the right sign within ``1e-5`` of it); elsewhere within ``rtol *
    |ref| + atol`` (``atol`` a number or a tensor of ``ref``'s shape; results below float32's
    smallest normal number are compared to within twice it). The check of the issue-31
    property tests: finite input of any magnitude gives the float64 result, ``inf`` only
    where that result does not fit."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if got.shape != ref.shape:
        raise AssertionError(f"shape {list(got.shape)} vs float64 {list(ref.shape)}")
    defined = ~torch.isnan(ref)
    if torch.isnan(got[defined]).any():
        raise AssertionError(f"NaN where float64 gives a number:\n{got}\n{ref}")
    over = defined & (ref.abs() > _F32_MAX_T * (1 + 1e-5))
    if not (torch.isinf(got[over]) & (torch.sign(got[over]) == torch.sign(ref[over]))).all():
        raise AssertionError(f"not +-inf where float64 is beyond float32's range:\n{got}\n{ref}")
    edge = defined & (ref.abs() >= _F32_MAX_T * (1 - 1e-5)) & ~over
    if not (torch.sign(got[edge]) == torch.sign(ref[edge])).all():
        raise AssertionError(f"wrong sign at float32's largest values:\n{got}\n{ref}")
    inside = defined & ~over & ~edge
    atol_t = torch.as_tensor(atol, dtype=torch.float64).cpu().expand_as(ref)
    bad = inside & ~((got - ref).abs() <= rtol * ref.abs() + atol_t + 2 * _F32_TINY)
    if bad.any():
        raise AssertionError(
            f"float32 {got[bad].tolist()} vs float64 {ref[bad].tolist()} (atol {atol_t[bad].tolist()})"
        )


def _outputs(out) -> dict[str, torch.Tensor]:
    """A result by name: a tensor (``"result"``), a ``(tensor, metrics)`` pair (``"result"``,
    ``"metrics['kl']"``, ...) or a ``LossOutput`` (``"loss"``, ``"metrics[...]"``)."""
    if isinstance(out, torch.Tensor):
        return {"result": out}
    if hasattr(out, "loss") and hasattr(out, "metrics"):
        return {"loss": out.loss, **{f"metrics[{k!r}]": v for k, v in out.metrics.items()}}
    tensor, metrics = out
    return {"result": tensor, **{f"metrics[{k!r}]": v for k, v in metrics.items()}}


def check_float64_agreement(
    fn,
    args: Sequence[torch.Tensor],
    *,
    rtol: float,
    atol: float | torch.Tensor = 0.0,
    metrics: bool = True,
    metric_atol: float | None = None,
    skip: Sequence[str] = (),
) -> None:
    """Call ``fn(*args)`` on the float32 tensors ``args`` and on their float64 copies (other
    tensors, masks and indices, unchanged) and compare every output with
    :func:`assert_float64_close`: a tensor, a ``LossOutput``'s loss and each metric, or a
    ``(tensor, metrics)`` pair. The error names the output (``metrics['kl']: ...``).

    A loss whose float64 value is beyond float32's range is checked to be ``inf``, and the
    metrics are then not compared (a mean of float32 values of which one is ``inf`` cannot be
    the float64 mean); ``metrics=False`` compares the first output only. ``metric_atol`` (the
    metrics' ``atol``, default ``atol``) and ``skip`` (output names not compared, e.g.
    ``"metrics['vf_clipfrac']"``, a count of strict comparisons that float32 may round to
    ties) tune the rest.

    >>> import torch
    >>> check_float64_agreement(lambda x: x.square(), [torch.tensor([1e19, 2e19])], rtol=1e-6)
    """
    got = _outputs(fn(*args))
    want = _outputs(fn(*[a.double() if a.is_floating_point() else a for a in args]))
    first = next(iter(want))
    if not metrics or (want[first].detach().abs() > _F32_MAX_T).any():
        want = {first: want[first]}
    for key, ref in want.items():
        if key in skip:
            continue
        tol = atol if key == first or metric_atol is None else metric_atol
        try:
            assert_float64_close(got[key], ref, rtol=rtol, atol=tol)
        except AssertionError as e:
            raise AssertionError(f"{key}: {e}") from None

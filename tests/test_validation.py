import pytest
import torch

from rollkit.validation import (
    check_batch,
    check_choice,
    check_finite,
    check_group_ids,
    check_in_range,
    check_mask,
    check_ndim,
    check_nonempty,
    check_positive,
    check_same_shape,
    check_shape,
    value_checks,
)


def test_messages_name_the_argument_and_problem():
    with pytest.raises(
        ValueError, match=r"^advantages: shape \[2, 3\] does not match logprobs shape \[2, 4\]$"
    ):
        check_same_shape("advantages", torch.zeros(2, 3), "logprobs", torch.zeros(2, 4))
    with pytest.raises(
        ValueError, match=r"^response_mask: expected a torch.bool mask, got dtype torch.float32"
    ):
        check_mask("response_mask", torch.ones(2))
    with pytest.raises(ValueError, match=r"^values: expected shape \[\*, 3\], got \[2, 4\]$"):
        check_shape("values", torch.zeros(2, 4), (None, 3))
    with pytest.raises(ValueError, match=r"^x: expected 2 dimensions, got shape \(3,\)$"):
        check_ndim("x", torch.zeros(3), 2)
    with pytest.raises(ValueError, match=r"^x: expected a torch.Tensor, got list$"):
        check_ndim("x", [1.0], 1)


def test_check_finite_reports_counts_and_first_index():
    x = torch.tensor([1.0, float("nan"), float("inf"), 2.0, float("-inf")])
    with pytest.raises(
        ValueError, match=r"rewards: contains 1 NaN and 2 inf values \(first at index \(1,\)\)"
    ):
        check_finite("rewards", x)
    with value_checks(False):
        check_finite("rewards", x)  # skipped
    check_finite("rewards", torch.ones(3))
    check_finite("ids", torch.tensor([1, 2]))  # integers are always finite


def test_value_checks_context_restores_state():
    from rollkit.validation import value_checks_enabled

    assert value_checks_enabled()
    with pytest.raises(RuntimeError):
        with value_checks(False):
            assert not value_checks_enabled()
            raise RuntimeError
    assert value_checks_enabled()


def test_nonempty_group_ids_scalars():
    with pytest.raises(ValueError, match="response_mask: mask selects no elements"):
        check_nonempty("response_mask", torch.zeros(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="group_ids: has 3 entries but the batch has 2 samples"):
        check_group_ids("group_ids", torch.tensor([0, 1, 2]), 2)
    with pytest.raises(ValueError, match="group_ids: expected an integer tensor"):
        check_group_ids("group_ids", torch.tensor([True]))
    with pytest.raises(ValueError, match=r"clip_low: must be >= 0, got -0.1"):
        check_positive("clip_low", -0.1, allow_zero=True)
    with pytest.raises(ValueError, match=r"eps: must be > 0, got nan"):
        check_positive("eps", float("nan"))
    with pytest.raises(ValueError, match=r"gamma: must be in \[0.0, 1.0\], got 1.5"):
        check_in_range("gamma", 1.5, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"mode: must be one of \['a', 'b'\], got 'c'"):
        check_choice("mode", "c", ["a", "b"])


def test_check_batch_cross_key_consistency():
    B, T = 3, 4
    good = {
        "response_mask": torch.ones(B, T, dtype=torch.bool),
        "logprobs": torch.zeros(B, T),
        "rewards": torch.zeros(B),
        "group_ids": torch.zeros(B, dtype=torch.long),
    }
    check_batch(good, list(good))
    with pytest.raises(ValueError, match="batch: missing key 'values'"):
        check_batch(good, ["values"])
    bad = dict(good, rewards=torch.zeros(B + 1))
    with pytest.raises(ValueError, match=r"rewards: dimension B=4 does not match response_mask \(B=3\)"):
        check_batch(bad, list(bad))
    bad = dict(good, logprobs=torch.zeros(B, T + 1))
    with pytest.raises(ValueError, match=r"logprobs: dimension T=5 does not match response_mask"):
        check_batch(bad, list(bad))
    bad = dict(good, group_ids=torch.zeros(B))
    with pytest.raises(ValueError, match="group_ids: expected an integer tensor"):
        check_batch(bad, list(bad))
    bad = dict(good, response_mask=torch.ones(B, T))
    with pytest.raises(ValueError, match=r"response_mask: expected a torch\.bool mask"):
        check_batch(bad, list(bad))


def test_checks_never_modify_input():
    x = torch.tensor([1.0, float("nan")])
    before = x.clone()
    with pytest.raises(ValueError):
        check_finite("x", x)
    assert torch.equal(x.isnan(), before.isnan()) and x[0] == before[0]


def test_scalar_int_and_int_tensor_checks():
    from rollkit.validation import check_int, check_int_tensor, check_scalar

    assert check_scalar("low", 2) == 2.0 and isinstance(check_scalar("low", 2), float)
    assert check_scalar("high", float("inf")) == float("inf")  # one-sided bounds are allowed
    with pytest.raises(ValueError, match=r"^low: must not be NaN$"):
        check_scalar("low", float("nan"))
    with pytest.raises(ValueError, match=r"^low: expected a number, got bool$"):
        check_scalar("low", True)
    with pytest.raises(ValueError, match=r"^low: expected a number, got Tensor$"):
        check_scalar("low", torch.tensor(1.0))
    assert check_int("max_length", 7) == 7
    with pytest.raises(ValueError, match=r"^max_length: expected an int, got float$"):
        check_int("max_length", 7.0)
    with pytest.raises(ValueError, match=r"^max_length: expected an int, got bool$"):
        check_int("max_length", False)
    with pytest.raises(ValueError, match=r"^max_length: expected an int, got Tensor$"):
        check_int("max_length", torch.tensor(3))
    check_int_tensor("lengths", torch.tensor([1, 2], dtype=torch.int32))
    for bad in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([1j])):
        with pytest.raises(ValueError, match=r"^lengths: expected an integer tensor, got dtype"):
            check_int_tensor("lengths", bad)
    with pytest.raises(ValueError, match=r"^lengths: expected a torch.Tensor, got list$"):
        check_int_tensor("lengths", [1, 2])


def test_check_discount():
    from rollkit.validation import check_discount

    assert check_discount("gamma", 1) == 1.0 and check_discount("lam", 0.0) == 0.0
    assert check_discount("gamma", 0.95) == 0.95
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"^gamma: must be in \[0.0, 1.0\]"):
            check_discount("gamma", bad)
    for bad in (True, "0.9", torch.tensor(0.9), None):
        with pytest.raises(ValueError, match=r"^gamma: expected a float in \[0, 1\], got"):
            check_discount("gamma", bad)


def test_check_finite_under_mask():
    from rollkit.validation import check_finite_under_mask

    x = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])
    check_finite_under_mask("values", x, torch.tensor([[True, False], [False, True]]))  # padding ignored
    with pytest.raises(
        ValueError, match=r"^values: contains 0 NaN and 1 inf values \(first at index \(1, 0\)\)$"
    ):
        check_finite_under_mask("values", x, torch.tensor([[True, False], [True, True]]))
    with value_checks(False):
        check_finite_under_mask("values", x, torch.ones(2, 2, dtype=torch.bool))  # skipped
    with pytest.raises(ValueError, match=r"^mask: expected a torch.bool mask"):
        check_finite_under_mask("values", x, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"^mask: shape \[2\] does not match values shape \[2, 2\]$"):
        check_finite_under_mask("values", x, torch.ones(2, dtype=torch.bool))


def test_value_checks_is_per_thread():
    """``value_checks(False)`` in one thread must not switch the checks off in another."""
    import threading

    from rollkit.validation import value_checks_enabled

    inside, release = threading.Event(), threading.Event()
    seen = {}

    def worker():
        with value_checks(False):
            seen["worker"] = value_checks_enabled()
            inside.set()
            release.wait(5)

    t = threading.Thread(target=worker)
    t.start()
    assert inside.wait(5)
    try:
        seen["main"] = value_checks_enabled()
        with pytest.raises(ValueError, match="rewards: contains 1 NaN"):
            check_finite("rewards", torch.tensor([float("nan")]))
    finally:
        release.set()
        t.join()
    assert seen == {"worker": False, "main": True}


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_group_ids_rejects_complex(dtype):
    from rollkit.validation import check_group_ids

    with pytest.raises(ValueError, match="group_ids: expected an integer tensor"):
        check_group_ids("group_ids", torch.zeros(3, dtype=dtype))


# --------------------------------------------------------------------------- reliability (issue 14)


@pytest.mark.parametrize("bad", ["x", None, [1.0], True, torch.tensor(1.0)])
def test_scalar_checks_check_the_type_before_comparing(bad):
    from rollkit.validation import check_positive_int, check_real

    kind = type(bad).__name__
    with pytest.raises(ValueError, match=rf"^eps: expected a number, got {kind}$"):
        check_positive("eps", bad, allow_zero=True)
    with pytest.raises(ValueError, match=rf"^clip_low: expected a number, got {kind}$"):
        check_in_range("clip_low", bad, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"^alpha: expected a number"):
        check_real("alpha", bad)
    with pytest.raises(ValueError, match=r"^norm_length: expected an? (int|number)"):
        check_positive_int("norm_length", bad)


def test_check_positive_int_accepts_integral_numbers_only():
    import numpy as np

    from rollkit.validation import check_positive_int

    assert check_positive_int("n", 4096) == 4096
    assert check_positive_int("n", 4096.0) == 4096
    assert check_positive_int("n", np.int64(3)) == 3
    assert check_positive_int("n", 0, allow_zero=True) == 0
    for bad, match in (
        (float("nan"), "must be an integer, got nan"),
        (float("inf"), "must be an integer"),
        (2.5, "must be an integer, got 2.5"),
        (0, "must be > 0, got 0"),
        (-1.0, "must be > 0"),
    ):
        with pytest.raises(ValueError, match=rf"^n: {match}"):
            check_positive_int("n", bad)


def test_same_shape_and_mask_checks_compare_devices():
    cpu, meta = torch.zeros(2, 3), torch.zeros(2, 3, device="meta")
    with pytest.raises(ValueError, match=r"^old_logprobs: is on device meta but logprobs is on cpu$"):
        check_same_shape("old_logprobs", meta, "logprobs", cpu)
    with pytest.raises(ValueError, match=r"^mask: is on device meta but logprobs is on cpu$"):
        check_mask("mask", torch.ones(2, 3, dtype=torch.bool, device="meta"), cpu, "logprobs")


def test_value_checks_refuse_meta_by_name_and_are_skipped_when_off():
    from rollkit.validation import check_finite_under_mask, values_readable

    x = torch.zeros(3, device="meta")
    with pytest.raises(ValueError, match=r"^rewards: is on the meta device, whose values cannot be checked"):
        check_finite("rewards", x)
    with pytest.raises(ValueError, match=r"^response_mask: is on the meta device"):
        check_nonempty("response_mask", torch.ones(3, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match=r"^values: is on the meta device"):
        check_finite_under_mask("values", x, torch.ones(3, dtype=torch.bool, device="meta"))
    with value_checks(False):
        check_finite("rewards", x)
        check_nonempty("response_mask", torch.ones(3, dtype=torch.bool, device="meta"))
        assert not values_readable("rewards", x)
    assert values_readable("rewards", torch.zeros(3))


# --------------------------------------------------------------------------- issue 31


def test_type_errors_are_both_value_and_type_errors():
    from rollkit.validation import InvalidTypeError, check_float, check_int, check_real, check_tensor

    cases = [
        (check_tensor, ("mask", [True]), r"^mask: expected a torch\.Tensor, got list$"),
        (
            check_float,
            ("x", torch.tensor([1])),
            r"^x: expected a floating-point tensor, got dtype torch\.int64$",
        ),
        (check_mask, ("mask", torch.ones(2)), r"^mask: expected a torch\.bool mask"),
        (check_real, ("coef", "x"), r"^coef: expected a number, got str$"),
        (check_int, ("n", 1.0), r"^n: expected an int, got float$"),
    ]
    for fn, args, msg in cases:
        for exc in (ValueError, TypeError, InvalidTypeError):
            with pytest.raises(exc, match=msg):
                fn(*args)


def test_check_dim_normalises_and_names_the_problem():
    from rollkit.validation import InvalidTypeError, check_dim

    assert check_dim("dim", None, 3) is None
    assert check_dim("dim", -1, 3) == (2,)
    assert check_dim("dim", (2, -3), 3) == (0, 2)
    assert check_dim("dim", [1], 2) == (1,)
    assert check_dim("dim", 0, 0) == (0,) and check_dim("dim", -1, 0) == (0,)  # torch: 0-dim
    with pytest.raises(
        ValueError,
        match=r"^dim: 3 is out of range for x with 3 dimension\(s\) \(expected an int in \[-3, 2\]\)$",
    ):
        check_dim("dim", 3, 3)
    with pytest.raises(ValueError, match=r"^dim: -4 is out of range for logprobs with 3"):
        check_dim("dim", (0, -4), 3, tensor_name="logprobs")
    with pytest.raises(ValueError, match=r"^dim: dimension 0 appears more than once in \(0, -3\)$"):
        check_dim("dim", (0, -3), 3)
    with pytest.raises(ValueError, match=r"^dim: an empty tuple is ambiguous"):
        check_dim("dim", (), 3)
    for bad in (1.0, "0", True, torch.tensor(0), (0, 1.5)):
        with pytest.raises(InvalidTypeError, match=r"^dim: expected an int or a tuple of ints, got "):
            check_dim("dim", bad, 3)


def test_check_real_tensor():
    from rollkit.validation import check_real_tensor

    for ok in (torch.ones(2), torch.ones(2, dtype=torch.int8), torch.ones(2, dtype=torch.float16)):
        assert check_real_tensor("x", ok) is ok
    for bad, msg in (
        (torch.ones(2, dtype=torch.bool), "torch.bool"),
        (torch.ones(2, dtype=torch.complex64), "torch.complex64"),
        ([1.0], "got list"),
    ):
        with pytest.raises(TypeError, match=rf"^x: expected a .*{msg}"):
            check_real_tensor("x", bad)

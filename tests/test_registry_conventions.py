"""verl's registry conventions, which a ported verl test suite checks: registering the same
function again under its name is a no-op, a different function under a taken name is refused,
and an ``enum.Enum`` member stands for its value (when registering and when looking up)."""

import enum

import pytest

from rollkit.registry import POLICY_LOSSES, Registry, UnknownNameError, check_kwargs


class Estimator(enum.Enum):
    DOUBLE = "double"
    TRIPLE = "triple"


class StrEstimator(str, enum.Enum):  # verl's AdvantageEstimator is a str Enum
    HALF = "half"


def double(x):
    return 2 * x


def triple(x):
    return 3 * x


def test_registering_the_same_function_again_is_a_no_op():
    reg = Registry("widget")
    assert reg.register("double", double, aliases=["twice"], in_keys={"x": "rewards"}) is double
    assert reg.register("double", double, aliases=["twice"], in_keys={"x": "rewards"}) is double
    reg.register("double", in_keys={"x": "rewards"})(double)  # the decorator form too
    reg.register("double", double, aliases=["x2"], in_keys={"x": "rewards"})  # a new alias is added
    assert reg.names() == ["double"] and len(reg) == 1
    assert reg.get("double") is reg.get("twice") is reg.get("x2") is double
    assert reg.entry("x2").in_keys == {"x": "rewards"}


def test_a_different_function_under_a_taken_name_is_still_refused():
    reg = Registry("widget")
    reg.register("double", double, aliases=["twice"])
    with pytest.raises(ValueError) as e:
        reg.register("double", triple)
    assert str(e.value) == (
        "name: 'double' is already registered as a widget (to double); register triple under another name"
    )
    with pytest.raises(ValueError, match=r"^name: 'twice' is already registered as a widget \(to double\)"):
        reg.register("triple", triple, aliases=["twice"])
    assert "triple" not in reg and reg.get("double") is double  # all or nothing; the first one stays

    def make():
        def double(x):  # the same name, another object (a reloaded module's function)
            return 2 * x

        return double

    with pytest.raises(ValueError, match=r"\(to another function named double\)"):
        reg.register("double", make())
    with pytest.raises(ValueError, match=r"'double' is already registered .* with in_keys \{\}"):
        reg.register("double", double, in_keys={"x": "rewards"})  # same function, other metadata


def test_an_enum_member_registers_under_its_value():
    reg = Registry("widget")
    reg.register(Estimator.DOUBLE, double)

    @reg.register(StrEstimator.HALF, aliases=[Estimator.TRIPLE])
    def half(x):
        return x / 2

    assert reg.names() == ["double", "half"]
    assert reg.get("double") is reg.get(Estimator.DOUBLE) is double
    assert reg.entry(StrEstimator.HALF).name == "half" and reg.get(Estimator.TRIPLE) is half
    assert Estimator.DOUBLE in reg and "triple" in reg
    reg.register(Estimator.DOUBLE, double)  # the same function again, by member: a no-op
    with pytest.raises(ValueError, match="'double' is already registered"):
        reg.register(Estimator.DOUBLE, triple)
    with pytest.raises(ValueError, match=r"^name: expected a non-empty str"):
        reg.register(3, triple)


def test_unknown_enum_member_lists_the_known_names():
    reg = Registry("widget")
    reg.register("double", double)
    with pytest.raises(UnknownNameError, match=r"^name: unknown widget 'triple'; known: double$"):
        reg.get(Estimator.TRIPLE)


def test_the_global_registries_take_a_builtin_again():
    e = POLICY_LOSSES.entry("ppo")
    POLICY_LOSSES.register("ppo", e.fn, in_keys=e.in_keys, out_keys=e.out_keys)  # a no-op
    assert POLICY_LOSSES.entry("ppo") is e


def test_check_kwargs_names_the_field_the_key_and_the_accepted_keys():
    def my_loss(logprobs, weights=None, *, clip_low=0.2, clip_high=0.2): ...

    check_kwargs(my_loss, {"clip_high": 0.3, "weights": None})  # an optional positional passes by keyword
    with pytest.raises(ValueError) as e:
        check_kwargs(my_loss, {"clip_hihg": 0.3}, field="cfg.loss_kwargs", name="mine", kind="policy loss")
    assert str(e.value) == (
        "cfg.loss_kwargs: mine does not take 'clip_hihg' (unknown key for the policy loss my_loss; "
        "accepted: clip_high, clip_low, logprobs, weights)"
    )
    with pytest.raises(ValueError, match=r"^kwargs: my_loss does not take 'logprobs' \(read from the batch"):
        check_kwargs(my_loss, {"logprobs": 1.0}, supplied=["logprobs"])
    check_kwargs(lambda x, **kw: x, {"anything": 1})  # **kwargs takes any key
    with pytest.raises(ValueError, match=r"^kwargs: expected a mapping"):
        check_kwargs(my_loss, [("clip_high", 0.3)])

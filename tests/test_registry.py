import pytest

from rollkit.registry import REGISTRIES, Registry


def test_register_get_alias_and_metadata():
    reg = Registry("widget")

    @reg.register("double", aliases=["twice"], in_keys={"x": "rewards"}, out_keys=["advantages"])
    def double(x):
        """Double it.

        More text."""
        return 2 * x

    assert reg.get("double") is double
    assert reg.get("twice") is double
    e = reg.entry("twice")
    assert e.name == "double" and e.in_keys == {"x": "rewards"} and tuple(e.out_keys) == ("advantages",)
    assert e.doc == "Double it."
    assert "twice" in reg and "double" in reg and reg.names() == ["double"] and len(reg) == 1
    reg.register("plain", lambda x: x)
    assert sorted(reg) == ["double", "plain"]


def test_unknown_name_lists_known_ones():
    reg = Registry("widget")
    reg.register("a", lambda: 1)
    reg.register("b", lambda: 2)
    with pytest.raises(KeyError, match="unknown widget 'c'; known: a, b"):
        reg.get("c")


def test_duplicate_names_rejected():
    reg = Registry("widget")
    reg.register("a", lambda: 1, aliases=["x"])
    with pytest.raises(ValueError, match="'a' is already registered"):
        reg.register("a", lambda: 2)
    with pytest.raises(ValueError, match="'x' is already registered"):
        reg.register("b", lambda: 2, aliases=["x"])


def test_global_registries_are_populated_and_documented():
    for kind, reg in REGISTRIES.items():
        assert len(reg) > 0, f"{kind} registry is empty"
        for name in reg.names():
            entry = reg.entry(name)
            assert callable(entry.fn), name
            assert entry.doc, f"{kind} {name!r} has no docstring"
            assert entry.out_keys, f"{kind} {name!r} declares no out_keys"

import pytest

from rollkit.registry import REGISTRIES, Entry, Registry, tensor_args


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
            assert not entry.missing_in_keys(), f"{kind} {name!r}: tensor arguments without in_keys"


def test_entry_tensor_args_and_missing_in_keys():
    def f(logprobs, mask, weights=None, *, is_weights=None, eps: float = 0.1):
        return logprobs

    e = Entry("f", f, {"logprobs": "logprobs", "is_weights": "is_weights"})
    # positional parameters, plus the keyword-only ones that in_keys maps; eps is a hyper-parameter
    assert e.tensor_args() == {"logprobs": True, "mask": True, "weights": False, "is_weights": False}
    assert e.tensor_args() == tensor_args(f, keyed=["logprobs", "is_weights"])
    assert e.missing_in_keys() == ["mask"]  # optional ones (weights) may stay unmapped
    assert Entry("g", lambda: 0).missing_in_keys() == []


def test_register_rejects_unknown_in_keys_but_accepts_var_keyword():
    reg = Registry("widget")
    with pytest.raises(ValueError, match=r"in_keys: \['y'\] are not parameters of widget 'f'"):
        reg.register("f", lambda x: x, in_keys={"x": "rewards", "y": "values"})
    assert "f" not in reg
    reg.register("g", lambda **kw: kw, in_keys={"y": "values"})  # **kwargs: any name may be passed
    assert reg.entry("g").in_keys == {"y": "values"}


def test_loss_term_registries_are_registered_with_metadata():
    expected = {
        "regularizer": {"kl": ["kl_loss"], "entropy": ["entropy_loss"]},
        "value_loss": {"clipped": ["value_loss"]},
        "is_correction": {"importance_weights": ["is_weights", "is_metrics"]},
        "aggregation": {"token-mean": ["loss_objective"]},
    }
    for kind, entries in expected.items():
        for name, out_keys in entries.items():
            entry = REGISTRIES[kind].entry(name)
            assert list(entry.out_keys) == out_keys, (kind, name)
            assert entry.missing_in_keys() == [], (kind, name)
    assert REGISTRIES["policy_loss"].entry("ppo").in_keys["is_weights"] == "is_weights"
    assert REGISTRIES["aggregation"].entry("seq-mean-token-sum").in_keys["weights"] == "sample_weights"
    assert REGISTRIES["is_correction"].entry("rollout-is").in_keys["logprobs"] == "old_logprobs"


def test_failed_import_is_not_cached_as_an_empty_registry():
    reg = Registry("widget", ["rollkit_no_such_module_for_tests"])
    with pytest.raises(ModuleNotFoundError):
        reg.names()
    with pytest.raises(ModuleNotFoundError):  # the second call imports again, and fails again
        reg.get("anything")
    with pytest.raises(ModuleNotFoundError):
        "x" in reg  # noqa: B015


def test_registry_loads_after_a_transient_import_failure(monkeypatch):
    import importlib

    reg = Registry("widget", ["rollkit.losses"])
    real = importlib.import_module
    calls = []

    def flaky(name, *a, **k):
        calls.append(name)
        if len(calls) == 1:
            raise ImportError("transient")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", flaky)
    with pytest.raises(ImportError):
        reg.names()
    reg.register("w", lambda: 1)
    assert reg.names() == ["w"] and len(calls) == 2


def test_unknown_name_is_a_one_line_value_error_that_is_still_a_key_error():
    from rollkit.registry import POLICY_LOSSES, UnknownNameError

    reg = Registry("widget")
    reg.register("a", lambda: 1, aliases=["x"])
    reg.register("b", lambda: 2)
    for bad in ("c", 3, None):
        with pytest.raises(ValueError) as err:
            reg.entry(bad)
        assert isinstance(err.value, KeyError) and isinstance(err.value, UnknownNameError)
        # KeyError's str() would quote the message: it is the plain one-line text
        assert str(err.value) == f"name: unknown widget {bad!r}; known: a, b"
        assert "\n" not in str(err.value)
    with pytest.raises(KeyError):  # callers written against KeyError keep working
        POLICY_LOSSES.get("nope")
    with pytest.raises(ValueError, match=r"^name: unknown policy loss 'nope'; known: .*\bppo\b"):
        POLICY_LOSSES.get("nope")

"""QueueScheduler's dispatch: each request to the least-loaded engine (ties to the lowest index),
counting what the same call already gave, exactly as the naive O(requests x engines) rule.

The engines are a test double (``RecordingEngine``: a load and the requests it was given), as
only the scheduler's choice is under test."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from trainers.loops.queue import QueueScheduler


class RecordingEngine:
    """Test double: ``num_running`` is fixed; ``add`` records what it was given."""

    def __init__(self, load: int) -> None:
        self.num_running, self.got = load, []

    def add(self, reqs) -> None:
        self.got.append(list(reqs))


def naive(loads: list[int], n: int) -> list[int]:
    pending, out = [0] * len(loads), []
    for _ in range(n):
        cur = [x + p for x, p in zip(loads, pending)]
        k = cur.index(min(cur))
        pending[k] += 1
        out.append(k)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=12), st.integers(0, 40))
def test_dispatch_is_the_naive_least_loaded_rule(loads, n):
    engines = [RecordingEngine(x) for x in loads]
    QueueScheduler._dispatch(SimpleNamespace(engines=engines), list(range(n)), together=False)
    choice = naive(loads, n)
    for k, e in enumerate(engines):
        expected = [i for i, c in enumerate(choice) if c == k]
        assert e.got == ([expected] if expected else [])


def test_together_goes_to_one_least_loaded_engine():
    engines = [RecordingEngine(x) for x in (3, 1, 1, 2)]
    QueueScheduler._dispatch(SimpleNamespace(engines=engines), ["a", "b", "c"], together=True)
    assert [e.got for e in engines] == [[], [["a", "b", "c"]], [], []]

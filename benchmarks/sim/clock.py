"""The virtual clock every simulated component reads (seconds, a float that only moves forward)."""

from __future__ import annotations

__all__ = ["VirtualClock"]


class VirtualClock:
    """Simulated time. ``clock()`` reads it (a drop-in for ``time.monotonic``).

    >>> c = VirtualClock()
    >>> c.advance_to(2.5); c()
    2.5
    >>> c.advance_to(1.0); c.now   # never backwards
    2.5
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        """Move to ``t`` (no-op when ``t`` is in the past)."""
        if t > self.now:
            self.now = float(t)

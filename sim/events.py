"""The virtual clock: an event heap run in time order (ties in the order they were scheduled).

Nothing here reads a real clock; a callback scheduled at ``t`` runs with ``sim.now == t``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Timer:
    """A scheduled callback; ``cancel()`` makes it a no-op (it stays in the heap until its time)."""

    time: float
    fn: Callable[..., object]
    args: tuple
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Simulation:
    now: float = 0.0
    events_run: int = 0
    _heap: list[tuple[float, int, Timer]] = field(default_factory=list)
    _order: itertools.count = field(default_factory=itertools.count)

    def at(self, time: float, fn: Callable[..., object], *args) -> Timer:
        """Run ``fn(*args)`` at virtual ``time`` (not in the past)."""
        if time < self.now:
            raise ValueError(f"cannot schedule at {time} before now ({self.now})")
        timer = Timer(time, fn, args)
        heapq.heappush(self._heap, (time, next(self._order), timer))
        return timer

    def after(self, delay: float, fn: Callable[..., object], *args) -> Timer:
        return self.at(self.now + max(0.0, delay), fn, *args)

    def run(self, until: float) -> None:
        """Run every event due at or before ``until``, then leave the clock at ``until``."""
        heap, pop, run = self._heap, heapq.heappop, 0  # locals: this loop is the simulator's hot path
        while heap and heap[0][0] <= until:
            time, _, timer = pop(heap)
            if timer.cancelled:
                continue
            self.now = time
            run += 1
            timer.fn(*timer.args)
        self.events_run += run
        self.now = max(self.now, until)

    def pending(self) -> int:
        return sum(1 for _, _, t in self._heap if not t.cancelled)

"""Waiting for a condition instead of a wall-clock amount (import as `waiting`).

Tests here run beside other work on shared 2-core machines. A test waits for the state it needs
and asserts on it; the timeout only turns a hang into a failure, it is never the thing measured,
so it is generous and the same everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import trio

HANG_GUARD_S = 120.0  # far above any honest wait on a busy machine; only a hang reaches it
POLL_S = 0.05
T = TypeVar("T")


async def wait_for(predicate: Callable[[], T], timeout: float = HANG_GUARD_S, what: str = "") -> T:
    """``predicate()``'s first true value; fails after ``timeout`` seconds saying ``what``."""
    try:
        with trio.fail_after(timeout):
            while not (value := predicate()):
                await trio.sleep(POLL_S)
            return value
    except trio.TooSlowError:
        raise AssertionError(f"not reached within {timeout:.0f} s: {what or predicate}") from None


def wait_until(predicate: Callable[[], T], timeout: float = HANG_GUARD_S, what: str = "", poll: float = 0.1) -> T:
    """:func:`wait_for` for synchronous tests (processes, threads)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:.0f} s: {what or predicate}")
        time.sleep(poll)
    return value

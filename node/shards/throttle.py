"""A token bucket for the optional upload cap (pure: time passed in)."""

from __future__ import annotations


class TokenBucket:
    """``rate`` bytes per second with bursts up to ``burst`` bytes; rate 0 means unlimited."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now

    def delay(self, nbytes: int, now: float) -> float:
        """Take ``nbytes`` and return how long to wait before sending them (0 = go now)."""
        if self.rate <= 0:
            return 0.0
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= nbytes
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

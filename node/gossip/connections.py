"""Connection manager: keep between ``low`` and ``high`` connections. Pure: decisions, no sockets.

Below ``low`` it dials a random sample of live members it is not connected to, preferring roles it
has fewest connections to (a node meshed only with relays learns little about trainers' load, and a
partition along roles would cut the loop). Members that failed to dial wait ``backoff`` seconds.
Above ``high`` it prunes the most-represented roles first, never a protected peer (bootstrap
peers, and the trainers/validators of the run, whom the loop needs).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ConnectionPlan:
    dial: list[str]
    prune: list[str]


@dataclass
class ConnectionManager:
    low: int
    high: int
    backoff: float
    rng: random.Random = field(default_factory=random.Random)
    _failed_at: dict[str, float] = field(default_factory=dict)

    def on_dial_failed(self, peer_id: str, now: float) -> None:
        self._failed_at[peer_id] = now

    def on_connected(self, peer_id: str) -> None:
        self._failed_at.pop(peer_id, None)

    def plan(
        self,
        connected: set[str],
        alive: dict[str, str],  # peer id -> role, live members
        protected: set[str],
        now: float,
    ) -> ConnectionPlan:
        n = len(connected)
        if n < self.low:
            candidates = [
                p
                for p in alive
                if p not in connected and now - self._failed_at.get(p, -1e18) >= self.backoff
            ]
            return ConnectionPlan(self._diverse_sample(candidates, alive, connected, self.low - n), [])
        if n > self.high:
            return ConnectionPlan([], self._prune(connected, alive, protected, n - self.high))
        return ConnectionPlan([], [])

    def _diverse_sample(self, candidates: list[str], roles: dict[str, str], connected: set[str], k: int) -> list[str]:
        have = Counter(roles.get(p, "?") for p in connected)
        self.rng.shuffle(candidates)
        chosen: list[str] = []
        pool = list(candidates)
        while pool and len(chosen) < k:
            best = min(pool, key=lambda p: have[roles.get(p, "?")])  # stable after shuffle: random ties
            pool.remove(best)
            chosen.append(best)
            have[roles.get(best, "?")] += 1
        return chosen

    def _prune(self, connected: set[str], roles: dict[str, str], protected: set[str], k: int) -> list[str]:
        have = Counter(roles.get(p, "?") for p in connected)
        pool = [p for p in connected if p not in protected]
        self.rng.shuffle(pool)
        out: list[str] = []
        while pool and len(out) < k:
            worst = max(pool, key=lambda p: have[roles.get(p, "?")])
            pool.remove(worst)
            out.append(worst)
            have[roles.get(worst, "?")] -= 1
        return out

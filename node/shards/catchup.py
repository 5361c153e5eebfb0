"""Catching up on a checkpoint whose announcement never arrived: ask for the newest manifest.

How this works
--------------
Announcements travel by gossip only (node/shards/announce.py), and gossip can lose them: in issue
45's hour-long soak the trainer, restarted gracefully, published v130-v137 and for about two
minutes no node heard v134-v137, although the trainer held nine connected peers; the workers
paused generation as too old and the trainer starved. A worker learns the trainer moved on without
any announcement (its acks carry the trainer's step), so the shards service is told what it wants
(:meth:`CatchUp.want`). When no version that new has been announced or is held one re-announcement
period after that, it asks one connected peer (a trainer first) for its newest manifest with
``NewestRequest(above)``; the reply is verified exactly as an announced manifest is (signed by a
trainer of the run, node/shards/manifest.py) and treated as an announcement of its version.

A validator needs more: a batch names the version it was made on, and the newest manifest does not
help it judge a batch of an older one it never heard of (the newest being known, such a want was
simply forgotten, and the batch handed back ``unjudged`` until a re-announcement that never comes
for a superseded version). So a want may name its version exactly (``want(v, now, exact=True)``):
it is met only when ``v`` itself is announced or held, and asked for by number,
``NewestRequest(above, version=v)``. The wants are served oldest first, one request a period in all.

Both sides are bounded:

* the asking side (:class:`CatchUp`) sends at most one request per period, to one peer at a time,
  moving to the next candidate after a peer failed, had nothing newer or had only a version older
  than the one wanted; it keeps at most :data:`MAX_EXACT_WANTS` versions wanted by number and gives
  one up after :data:`EXACT_ASKS` requests no peer answered (a later batch of it wants it again);
* the serving side (:class:`AnswerBudget`) answers a peer at most once per ``peer_interval`` and all
  peers together at most ``total`` times per ``window``, refusing the rest (``busy``, never a
  fault: an honest restarted node may ask again early). A refusal costs one small frame.

Pure: times are arguments (seconds on the caller's monotonic clock).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Collection

MAX_REMEMBERED_PEERS = 1024  # peers whose last answer time the serving side keeps
MAX_EXACT_WANTS = 16  # versions wanted by number at once (the oldest is dropped past this)
EXACT_ASKS = 4  # requests for one version by number before it is given up
NEWEST = -1  # what_to_ask's answer when the request is for the newest version


class CatchUp:
    """The asking side: when to ask, for what, and whom (rotating over the candidates on failure)."""

    def __init__(self, period: float) -> None:
        self.period = period  # seconds without an announcement before asking, and between requests
        self.wanted: int | None = None  # a version at least this new exists (the caller heard so)
        self.since = 0.0  # when the current want began
        self.exact: collections.OrderedDict[int, list[float]] = collections.OrderedDict()  # version -> [since, asks]
        self.asked_at = -math.inf
        self.turn = 0  # which candidate is asked next
        self.requests = 0  # requests made (status, tests)

    def want(self, version: int, now: float, exact: bool = False) -> None:
        """A version ``version`` or newer exists (``exact``: ``version`` itself is needed); the wait
        for it began ``now`` unless it began earlier."""
        if exact:
            if version not in self.exact:
                self.exact[version] = [now, 0]
                while len(self.exact) > MAX_EXACT_WANTS:
                    self.exact.popitem(last=False)
            return
        if self.wanted is None:
            self.since = now
        self.wanted = version if self.wanted is None else max(self.wanted, version)

    def _forget_met(self, known: int | None, present: Collection[int]) -> None:
        if self.wanted is not None and known is not None and known >= self.wanted:
            self.wanted = None
        for version in [v for v in self.exact if v in present]:
            del self.exact[version]

    def _oldest_want(self) -> tuple[float, int] | None:
        """(since, version) of the want waiting longest (version :data:`NEWEST` for the newest)."""
        waits = [(since, v) for v, (since, _asks) in self.exact.items()]
        if self.wanted is not None:
            waits.append((self.since, NEWEST))
        return min(waits, default=None)

    def due_at(self, known: int | None, now: float, present: Collection[int] = ()) -> float | None:
        """When to ask, given the newest version announced or held (``known``) and every version
        announced or held (``present``): None when nothing is wanted any more (a want met is forgotten)."""
        self._forget_met(known, present)
        oldest = self._oldest_want()
        if oldest is None:
            return None
        return max(oldest[0] + self.period, self.asked_at + self.period, now)

    def what_to_ask(self) -> int:
        """The version to ask for by number now, or :data:`NEWEST` (the want waiting longest first)."""
        oldest = self._oldest_want()
        return NEWEST if oldest is None else oldest[1]

    def pick(self, candidates: list[str], now: float) -> str | None:
        """The peer to ask now (None if there is none); counts as the request of this period."""
        self.asked_at = now
        if not candidates:
            return None
        self.requests += 1
        return candidates[self.turn % len(candidates)]

    def answered(self, version: int | None, asked: int = NEWEST) -> None:
        """The peer asked (for ``asked``: a version by number, or :data:`NEWEST`) answered with
        ``version`` (None: nothing newer, not held, a refusal or no answer). Short of the wanted
        version the next request goes to the next candidate: a relay answering each period with a
        real manifest one version newer than ours would otherwise be asked again and again, walking
        us one version a period (review of issue 45). A version asked by number and not had
        :data:`EXACT_ASKS` times is given up."""
        if asked != NEWEST:
            if version == asked:
                self.exact.pop(asked, None)
                return
            self.turn += 1
            if asked in self.exact:
                self.exact[asked][1] += 1
                if self.exact[asked][1] >= EXACT_ASKS:
                    del self.exact[asked]
            return
        if version is None or (self.wanted is not None and version < self.wanted):
            self.turn += 1

    def status(self) -> dict:
        return {"wanted": self.wanted, "wanted_exact": list(self.exact), "requests": self.requests}


class AnswerBudget:
    """The serving side's refusal budget for ``NewestRequest`` (each answer reads a manifest)."""

    def __init__(self, peer_interval: float, total: int, window: float) -> None:
        self.peer_interval = peer_interval  # seconds between two answers to one peer
        self.total = total  # answers to all peers together per window
        self.window = window
        self._last: collections.OrderedDict[str, float] = collections.OrderedDict()  # peer -> last answer
        self._recent: collections.deque[float] = collections.deque()  # times of answers in the window
        self.refused = 0

    def admit(self, peer: str, now: float) -> bool:
        """Whether to answer ``peer`` now (then counted as answered)."""
        while self._recent and self._recent[0] <= now - self.window:
            self._recent.popleft()
        last = self._last.get(peer)
        if (last is not None and now - last < self.peer_interval) or len(self._recent) >= self.total:
            self.refused += 1
            return False
        self._last.pop(peer, None)
        self._last[peer] = now
        while len(self._last) > MAX_REMEMBERED_PEERS:
            self._last.popitem(last=False)
        self._recent.append(now)
        return True

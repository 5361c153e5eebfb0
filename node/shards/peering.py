"""Which peers a download opens transfer sessions to, and which session it ends to make room.

Pure: the download (client.py) passes in the peers it could use, the sessions it holds, what it
knows of each peer, and the service's random source; these functions return the choices. Moved out
of :class:`node.shards.client.Download` so that the simulator (sim/shards.py, issue 46) drives the
same choices on a thousand simulated peers.

Why this order: with more connected peers than ``max_peers``, the first ones in py-libp2p's order
got every session: at N = 24 most downloaders had none with the seed, whose every piece then went to
the 3-5 that did. The announcer (the trainer, for a fresh version) comes first, then the peers
downloading this version from us, the rest in a random order so that downloaders spread over
different peers.

Why make room: sessions carry blocks one way, so a node's upload works only for the peers that
chose it: drawn at random, a few downloaders at N = 24 were chosen by 1-5 others and sent 10-25 MiB
where the rest sent 25-35. When every slot is taken and a peer downloading from us waits for one,
the session to a peer that does not download from us ends, so that sessions pair up: every node is
a source of as many peers as it downloads from, and it knows what they hold (have suppression).
Kept: the announcer and peers holding every piece, which upload to whoever asks; of the rest, the
one with the fewest requests in flight. One per rescan; the pairs only grow, so this settles.

Why dial for a download: sessions run only on direct connections (host.direct_peers), and a NAT'd
node's are only those it opened itself; its inbound connections are relay circuits, which carry
no checkpoint bytes. Its membership dials (the ConnectionManager counts circuits as connections)
left it a median of 3 direct peers against 7 for a public node, some only 1, in simulation
(bench/sim_shards.py, N = 100, 30 % of slow nodes NAT'd), and the last NAT'd node finished 1.5x
later than the last public one. A download short of ``max_peers`` direct peers dials public
members (members with a direct address whose record does not say they are private) up to that
many, at random so that downloaders spread over them: what a peer can upload is not known before
it has served us.

Why a book of dials (:class:`DialBook`), shared by the node's downloads: a member record costs its
author a key pair and a signature, and may claim ``public`` with an address that leads nowhere or
to a black hole that never answers, which costs us a dial slot for ``DIAL_TIMEOUT``. Dialled at
random and again every 30 s whatever came of it, a crowd of such records held every dial slot and
an honest member was one draw in the crowd at each of them; one whose connection membership pruned
was lost in the crowd again (review of issue 46). So: a member whose dial failed is dialled again
only after a back-off that doubles at each failure (20 fakes: at most 6 dials each in an hour, where
each was dialled every 30 s a slot was free, 44 times); members with evidence that the record is
honest, a connection we hold to them over a relay circuit or a direct connection we held, are
dialled first, their dials not held up by the speculative ones;
and members known by their record alone are drawn at random, at most ``SPECULATIVE_SLOTS`` dials of
them in flight. Against fakes we cannot tell from honest records nothing does better than a draw
without replacement, which the back-off makes of the crowd.

Why a snapshot of the member ids: the candidates for a speculative dial are drawn from a list of the
member ids refreshed every ``MEMBERS_REFRESH`` seconds, looking at ``SPECULATIVE_LOOKS`` of them per
rescan: a rescan that looked at every member's record cost O(N) a second per download short of
peers (issue 46: 10,000 records a second at N = 10,000).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from enum import Enum

DIAL_AGAIN_AFTER = 30.0  # seconds before a member is dialled again for a download; doubles at each failed dial
MAX_DIAL_BACKOFF = 3600.0  # seconds: the longest a failed member waits before it is dialled again
SPECULATIVE_SLOTS = 2  # dials in flight at once of members known by their record alone
SPECULATIVE_LOOKS = 16  # member ids looked at per rescan for speculative dials
MEMBERS_REFRESH = 10.0  # seconds between snapshots of the member ids
MAX_DIAL_BOOK = 4096  # members the dial book remembers (the least recently changed is forgotten first)
MAX_REACHED = 128  # members remembered as reached, dialled first when a download is short of peers


def sessions_to_open(
    peers: Iterable[str],
    sessions: Collection[str],
    source: str | None,
    served: Collection[str],
    max_peers: int,
    may_dial: Callable[[str], bool],
    rng: random.Random,
) -> tuple[list[str], bool]:
    """Peers to open a session to now (``sessions``: those held or being opened), and whether a
    peer downloading from us (``served``) waits for a slot, so that one should be freed."""
    order = list(peers)
    rng.shuffle(order)
    order.sort(key=lambda p: (p != source, p not in served))  # stable: the shuffle stands behind
    opened: list[str] = []
    for peer in order:
        if peer in sessions or not may_dial(peer):
            continue
        if len(sessions) + len(opened) >= max_peers:
            return opened, peer in served
        opened.append(peer)
    return opened, False


def session_to_end(
    sessions: Iterable[str],
    source: str | None,
    served: Collection[str],
    holds_all: Callable[[str], bool],
    in_flight: Callable[[str], int],
) -> str | None:
    """The open session to end to make room: one-way (not a peer downloading from us), neither the
    announcer nor a peer holding every piece; of those, the one with the fewest requests in flight."""
    one_way = [p for p in sessions if p != source and p not in served and not holds_all(p)]
    return min(one_way, key=in_flight) if one_way else None


def direct_addrs(
    peer: str,
    addrs_of: Callable[[str], list[str]],
    reachability_of: Callable[[str], str],
) -> list[str]:
    """The addresses of a member's record a download may dial directly: those that do not run
    through a relay, none for a member whose record says it is ``private`` whatever it lists:
    records advertise every transport address, a NAT'd node's private one too, which leads nowhere
    from outside its network. ``unknown`` (dial-back has not answered yet) is tried."""
    if reachability_of(peer) == "private":
        return []
    return [a for a in addrs_of(peer) if "/p2p-circuit" not in a]


class DialState(Enum):
    """What the book holds of a member: (not known) -> DIALLING -> REACHED or FAILED -> DIALLING
    once its back-off ends; a direct connection makes a member not known or FAILED one REACHED."""

    DIALLING = "dialling"  # a dial is in flight
    REACHED = "reached"  # the last dial succeeded, or we held a direct connection to it
    FAILED = "failed"  # the last dial failed: not dialled again before its back-off ends


@dataclass
class Dialled:
    state: DialState
    at: float  # when it entered the state (when the dial began, for DIALLING)
    backoff: float  # seconds after a dial before the member is dialled again; doubles at each failure
    speculative: bool = False  # DIALLING: known by its record alone


class DialBook:
    """The node's dials of public members for its downloads, shared by all of them (the module
    docstring says why). Pure: the download passes in the time, what it holds and membership's
    view; :meth:`to_dial` returns the dials to make, and the download reports each one's end with
    :meth:`on_result`. Bounded: ``MAX_DIAL_BOOK`` members, ``MAX_REACHED`` of them as reached."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.entries: OrderedDict[str, Dialled] = OrderedDict()  # least recently changed first
        self.reached: OrderedDict[str, None] = OrderedDict()  # most recently reached last
        self.dialling: set[str] = set()
        self.member_ids: list[str] = []  # snapshot of membership's members
        self.members_at = -math.inf  # when it was taken

    def _set(self, peer: str, entry: Dialled) -> None:
        self.entries[peer] = entry
        self.entries.move_to_end(peer)
        while len(self.entries) > MAX_DIAL_BOOK:
            old, gone = self.entries.popitem(last=False)
            if gone.state is DialState.DIALLING:  # only with every entry in flight: keep it counted
                self.entries[old] = gone
                break
        if entry.state is DialState.REACHED:
            self.reached[peer] = None
            self.reached.move_to_end(peer)
            while len(self.reached) > MAX_REACHED:
                self.reached.popitem(last=False)

    def may_dial(self, peer: str, now: float) -> bool:
        """Not in flight, and its last dial (if any) is ``backoff`` seconds old."""
        e = self.entries.get(peer)
        return e is None or (e.state is not DialState.DIALLING and now - e.at >= e.backoff)

    def on_dial(self, peer: str, now: float, speculative: bool) -> None:
        e = self.entries.get(peer)
        if e is not None and e.state is DialState.DIALLING:
            raise AssertionError(f"{peer} is dialled already")
        backoff = e.backoff if e is not None else DIAL_AGAIN_AFTER
        self._set(peer, Dialled(DialState.DIALLING, now, backoff, speculative))
        self.dialling.add(peer)

    def on_result(self, peer: str, ok: bool | None, now: float) -> None:
        """The dial of ``peer`` ended: reached, failed (its back-off doubles), or abandoned (None:
        the download ended first; the back-off stays, the member proved nothing either way)."""
        e = self.entries.get(peer)
        if e is None or e.state is not DialState.DIALLING:
            raise AssertionError(f"{peer} was not being dialled")
        self.dialling.discard(peer)
        if ok:
            self._set(peer, Dialled(DialState.REACHED, e.at, DIAL_AGAIN_AFTER))
        elif ok is None:
            self._set(peer, Dialled(DialState.FAILED, e.at, e.backoff))
        else:  # the back-off counts from the dial, as before: a black hole's timeout is not added
            self._set(peer, Dialled(DialState.FAILED, e.at, min(2 * e.backoff, MAX_DIAL_BACKOFF)))
            self.reached.pop(peer, None)

    def note_direct(self, peers: Iterable[str], now: float) -> None:
        """We hold a direct connection to ``peers``: they exist and answer, on an address that
        worked (evidence for a later dial)."""
        for peer in peers:
            e = self.entries.get(peer)
            if e is None or e.state is DialState.FAILED:
                self._set(peer, Dialled(DialState.REACHED, now, DIAL_AGAIN_AFTER))
            elif e.state is DialState.REACHED:
                self.reached.move_to_end(peer)

    def in_flight(self, speculative: bool) -> int:
        """Dials in flight of members known by their record alone (``speculative``), or of the others."""
        return sum(1 for p in self.dialling if self.entries[p].speculative == speculative)

    def to_dial(
        self,
        now: float,
        direct: Collection[str],
        connected: Iterable[str],
        members: Callable[[], Iterable[str]],
        addrs: Callable[[str], list[str]],
        may_dial: Callable[[str], bool],
        want: int,
        rng: random.Random,
    ) -> list[tuple[str, list[str]]]:
        """The members to dial now, with the addresses to dial, so that the download holds ``want``
        direct peers (``direct``: those it holds). First those with evidence: ``connected`` (peers
        we hold a connection to, a relay circuit for one) not direct, then members reached before,
        latest first; then members drawn at random from a snapshot of ``members()`` (refreshed
        every ``MEMBERS_REFRESH`` s), ``SPECULATIVE_LOOKS`` looked at. ``addrs(peer)``: the direct
        addresses of its record ([] when it is not a public member); ``may_dial``: not banned."""
        held = set(direct)
        out: list[tuple[str, list[str]]] = []

        def take(peers: Iterable[str], room: int, speculative: bool) -> int:
            """Dial up to ``room`` of ``peers``; returns the room left."""
            for peer in peers:
                if room <= 0:
                    break
                if peer == self.me or peer in held or not self.may_dial(peer, now) or not may_dial(peer):
                    continue
                if a := addrs(peer):
                    self.on_dial(peer, now, speculative)
                    out.append((peer, a))
                    room -= 1
            return room

        # Speculative dials in flight are not counted here: a crowd of dead records holds up no
        # dial of a member with evidence.
        room = take([*connected, *reversed(self.reached)], want - len(held) - self.in_flight(False), False)
        speculative = self.in_flight(True)
        room = min(room, SPECULATIVE_SLOTS) - speculative
        if room <= 0:
            return out
        if now - self.members_at >= MEMBERS_REFRESH:
            self.member_ids, self.members_at = list(members()), now
        ids = self.member_ids
        take((ids[i] for i in rng.sample(range(len(ids)), min(SPECULATIVE_LOOKS, len(ids)))), room, True)
        return out

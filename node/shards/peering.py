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
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable


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


def direct_peers_to_dial(
    direct: Collection[str],
    public: Iterable[str],
    want: int,
    rng: random.Random,
) -> list[str]:
    """Public members to dial so that a download holds ``want`` direct peers (see the module
    docstring): none when it has that many, else as many of ``public`` not already direct, at random."""
    held = set(direct)
    pool = sorted({p for p in public if p not in held})  # sorted: the caller's order does not matter
    rng.shuffle(pool)
    return pool[:max(0, want - len(held))]


def public_members(
    members: Iterable[str],
    addrs_of: Callable[[str], list[str]],
    reachability_of: Callable[[str], str],
    me: str,
) -> dict[str, list[str]]:
    """Members other than ``me`` that a download may dial directly: peer id -> the addresses of its
    record that do not run through a relay. A member whose record says it is ``private`` is left
    out whatever it lists: records advertise every transport address, a NAT'd node's private one
    too, which leads nowhere from outside its network. ``unknown`` (dial-back has not answered
    yet) is tried."""
    out: dict[str, list[str]] = {}
    for peer in members:
        if peer == me or reachability_of(peer) == "private":
            continue
        direct = [a for a in addrs_of(peer) if "/p2p-circuit" not in a]
        if direct:
            out[peer] = direct
    return out

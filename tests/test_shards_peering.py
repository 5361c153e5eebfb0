"""Which peers a download opens sessions to, and which it ends to make room (node/shards/peering.py)."""

from __future__ import annotations

import random

from node.shards.peering import direct_peers_to_dial, public_members, session_to_end, sessions_to_open

PEERS = [f"p{i}" for i in range(12)]


def test_the_announcer_comes_first_then_peers_downloading_from_us_then_the_rest_at_random():
    served = {"p3", "p7"}
    firsts = set()
    for seed in range(20):
        opened, waiting = sessions_to_open(PEERS, set(), "p9", served, 4, lambda p: True, random.Random(seed))
        assert opened[0] == "p9" and set(opened[1:3]) == served and not waiting
        firsts.add(opened[3])
    assert len(firsts) > 3  # the fourth slot goes to different peers in different downloads


def test_held_sessions_and_peers_not_to_dial_are_skipped_and_slots_are_never_exceeded():
    held = {"p0", "p1"}
    opened, _ = sessions_to_open(PEERS, held, None, set(), 5, lambda p: p != "p2", random.Random(1))
    assert len(opened) == 3 and not set(opened) & (held | {"p2"})


def test_a_peer_downloading_from_us_that_finds_every_slot_taken_asks_for_room_another_does_not():
    held = {"p0", "p1"}
    assert sessions_to_open(PEERS, held, None, {"p5"}, 2, lambda p: True, random.Random(0)) == ([], True)
    assert sessions_to_open(PEERS, held, None, set(), 2, lambda p: True, random.Random(0)) == ([], False)
    assert sessions_to_open(PEERS, held, None, {"p0"}, 2, lambda p: True, random.Random(0)) == ([], False)


def test_room_is_made_by_ending_a_one_way_session_with_the_fewest_requests_in_flight():
    in_flight = {"src": 0, "seed": 0, "mutual": 0, "a": 5, "b": 2, "c": 9}.get
    holds_all = {"seed"}.__contains__
    sessions = ["src", "seed", "mutual", "a", "b", "c"]
    assert session_to_end(sessions, "src", {"mutual"}, holds_all, in_flight) == "b"
    assert session_to_end(["src", "seed", "mutual"], "src", {"mutual"}, holds_all, in_flight) is None


def test_a_download_short_of_direct_peers_dials_public_members_until_it_has_max_peers():
    """Found by simulation (bench/sim_shards.py, N = 100, issue 46): a NAT'd node's only direct
    peers are the public ones it dialled for membership (a median of 3 against 7 for public nodes,
    some just 1), since its inbound connections are relay circuits, which carry no checkpoint
    bytes; the last NAT'd node finished 1.5x later than the last public one."""
    public = [f"pub{i}" for i in range(10)]
    chosen = set()
    for seed in range(20):
        dial = direct_peers_to_dial(["pub0", "pub1"], public + ["pub0"], 5, random.Random(seed))
        assert len(dial) == 3 and len(set(dial)) == 3 and not {"pub0", "pub1"} & set(dial)
        chosen |= set(dial)
    assert len(chosen) > 5  # different downloaders spread over different public peers
    assert direct_peers_to_dial(public[:5], public, 5, random.Random(0)) == []  # enough already
    assert direct_peers_to_dial([], ["pub3"], 5, random.Random(0)) == ["pub3"]  # as many as there are


def test_public_members_are_those_with_a_direct_address_that_do_not_say_they_are_private():
    """A NAT'd member's record lists its private listen address beside its relayed ones (records
    advertise every transport address): dialled, that address leads nowhere on the internet, so a
    member whose record says it is private is not public, whatever its addresses. One whose
    reachability is not known yet (dial-back has not answered) is tried."""
    records = {
        "pub": ("public", ["/ip4/10.78.0.2/tcp/4001"]),
        "new": ("unknown", ["/ip4/10.78.0.3/tcp/4001"]),
        "nat": ("private", ["/ip4/192.168.1.2/tcp/4001", "/ip4/10.78.0.1/tcp/4001/p2p/R/p2p-circuit"]),
        "circuit-only": ("unknown", ["/ip4/10.78.0.1/tcp/4001/p2p/R/p2p-circuit"]),
        "me": ("public", ["/ip4/10.78.0.9/tcp/4001"]),
    }
    found = public_members(records, lambda p: records[p][1], lambda p: records[p][0], me="me")
    assert found == {"pub": ["/ip4/10.78.0.2/tcp/4001"], "new": ["/ip4/10.78.0.3/tcp/4001"]}

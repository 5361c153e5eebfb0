"""Which peers a download opens sessions to, and which it ends to make room (node/shards/peering.py)."""

from __future__ import annotations

import random

import pytest

from node.shards.peering import (
    DIAL_AGAIN_AFTER,
    MAX_DIAL_BACKOFF,
    MAX_DIAL_BOOK,
    MAX_REACHED,
    SPECULATIVE_SLOTS,
    DialBook,
    DialState,
    direct_addrs,
    session_to_end,
    sessions_to_open,
)

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
    bytes; the last NAT'd node finished 1.5x later than the last public one. Members known by
    their record alone are drawn at random, SPECULATIVE_SLOTS dials of them in flight."""
    public = [f"pub{i}" for i in range(10)]
    chosen = set()
    for seed in range(20):
        dial = to_dial(DialBook("me"), 0.0, ["pub0", "pub1"], public, want=5, seed=seed)
        assert len(dial) == min(3, SPECULATIVE_SLOTS) == len(set(dial)) and not {"pub0", "pub1"} & set(dial)
        chosen |= set(dial)
    assert len(chosen) > 5  # different downloaders spread over different public peers
    assert to_dial(DialBook("me"), 0.0, public[:5], public, want=5) == []  # enough already
    assert to_dial(DialBook("me"), 0.0, [], ["pub3"], want=5) == ["pub3"]  # as many as there are


def test_the_direct_addresses_of_a_member_are_none_when_its_record_says_it_is_private():
    """A NAT'd member's record lists its private listen address beside its relayed ones (records
    advertise every transport address): dialled, that address leads nowhere on the internet, so a
    member whose record says it is private is not public, whatever its addresses. One whose
    reachability is not known yet (dial-back has not answered) is tried."""
    records = {
        "pub": ("public", ["/ip4/10.78.0.2/tcp/4001"]),
        "new": ("unknown", ["/ip4/10.78.0.3/tcp/4001"]),
        "nat": ("private", ["/ip4/192.168.1.2/tcp/4001", "/ip4/10.78.0.1/tcp/4001/p2p/R/p2p-circuit"]),
        "circuit-only": ("unknown", ["/ip4/10.78.0.1/tcp/4001/p2p/R/p2p-circuit"]),
    }
    found = {p: direct_addrs(p, lambda p: records[p][1], lambda p: records[p][0]) for p in records}
    assert found == {"pub": ["/ip4/10.78.0.2/tcp/4001"], "new": ["/ip4/10.78.0.3/tcp/4001"], "nat": [],
                     "circuit-only": []}


def to_dial(book: DialBook, now: float, direct: list[str], members: list[str], *, connected: list[str] = (),
            want: int = 4, seed: int = 0) -> list[str]:
    return [p for p, _ in book.to_dial(now, direct, connected, lambda: members, lambda p: [f"/ip4/10.0.0.1/tcp/1/{p}"],
                                       lambda p: True, want, random.Random(seed))]


def test_the_dial_book_refuses_illegal_transitions_and_never_dials_us_or_a_member_in_flight():
    book = DialBook("me")
    assert to_dial(book, 0.0, [], ["me"]) == []
    book.on_dial("a", 0.0, speculative=True)
    with pytest.raises(AssertionError):
        book.on_dial("a", 1.0, speculative=True)  # one dial at a time
    assert not book.may_dial("a", 100.0)
    book.on_result("a", False, 10.0)
    with pytest.raises(AssertionError):
        book.on_result("a", True, 11.0)  # no dial in flight
    assert book.entries["a"].state is DialState.FAILED
    assert not book.may_dial("a", 2 * DIAL_AGAIN_AFTER - 1) and book.may_dial("a", 2 * DIAL_AGAIN_AFTER)


def test_a_members_back_off_doubles_up_to_its_cap_and_a_success_resets_it():
    book, t, waits = DialBook("me"), 0.0, []
    for _ in range(12):
        book.on_dial("a", t, speculative=True)
        book.on_result("a", False, t + 10)
        wait = next(w for w in range(0, 10_000) if book.may_dial("a", t + w))
        waits.append(wait)
        t += wait
    assert waits[:4] == [60, 120, 240, 480] and max(waits) == MAX_DIAL_BACKOFF
    book.on_dial("a", t, speculative=True)
    book.on_result("a", True, t + 1)
    assert book.may_dial("a", t + DIAL_AGAIN_AFTER) and list(book.reached) == ["a"]
    book.on_dial("a", t + 40, speculative=True)
    book.on_result("a", None, t + 41)  # abandoned: the download ended first
    assert book.entries["a"].backoff == DIAL_AGAIN_AFTER and list(book.reached) == ["a"]


def test_members_with_evidence_come_first_and_speculative_dials_do_not_hold_them_up():
    """A peer we hold a circuit to, then members reached before (latest first), then members
    known by their record alone, at most SPECULATIVE_SLOTS of those in flight; the speculative
    dials in flight are not counted against the room of the others."""
    book = DialBook("me")
    book.note_direct(["old", "new"], 0.0)  # held before: their addresses worked
    crowd = [f"f{i}" for i in range(50)]
    first = to_dial(book, 40.0, ["origin"], crowd, want=3)
    assert first[:2] == ["new", "old"] and len(first) == 2  # room for 2
    assert len(book.dialling) == 2
    later = to_dial(book, 41.0, ["origin"], crowd, connected=["circ"], want=8)
    assert later[0] == "circ" and len(later) == 1 + SPECULATIVE_SLOTS
    assert set(later[1:]) <= set(crowd)
    assert to_dial(book, 42.0, ["origin"], crowd, want=8) == []  # the speculative slots are full
    assert to_dial(book, 42.0, ["origin"], crowd, connected=["circ2"], want=8) == ["circ2"]


def test_the_dial_book_is_bounded():
    book = DialBook("me")
    for i in range(MAX_DIAL_BOOK + 100):
        book.on_dial(f"p{i}", float(i), speculative=True)
        book.on_result(f"p{i}", True, float(i))
    assert len(book.entries) == MAX_DIAL_BOOK and len(book.reached) == MAX_REACHED
    assert next(reversed(book.reached)) == f"p{MAX_DIAL_BOOK + 99}"

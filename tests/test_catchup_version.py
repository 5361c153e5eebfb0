"""Catch-up by version number (node/shards/catchup.py): a want that names its version is met only by
that version, asked for oldest want first, bounded, and on the wire only when set (issue 45: a
validator's batch of a version older than the newest it knew stayed ``unjudged``; the real-host case
is in tests/test_validator_catchup.py)."""

from __future__ import annotations

from node.shards.catchup import EXACT_ASKS, MAX_EXACT_WANTS, NEWEST, CatchUp
from node.shards.protocol import NewestRequest
from node.wire import decode, encode

# -- the pure parts ------------------------------------------------------------------------------


def test_an_exact_want_is_not_met_by_a_newer_version() -> None:
    c = CatchUp(period=10.0)
    c.want(3, 0.0, exact=True)
    assert c.due_at(5, 0.0, present={5}) == 10.0  # v5 known: v3 is still wanted
    assert c.what_to_ask() == 3
    assert c.due_at(5, 10.0, present={3, 5}) is None  # v3 announced: met, forgotten


def test_wants_are_asked_oldest_first_one_request_a_period() -> None:
    c = CatchUp(period=10.0)
    c.want(9, 0.0)  # the newest (a worker's): waited on since 0
    c.want(4, 2.0, exact=True)
    assert c.what_to_ask() == NEWEST
    assert c.pick(["t"], 10.0) == "t"
    c.answered(9, NEWEST)
    assert c.due_at(9, 10.0, present={9}) == 20.0 and c.what_to_ask() == 4
    c.answered(None, c.what_to_ask())  # no one had v4: the next candidate next time
    assert c.turn == 1 and 4 in c.exact


def test_an_exact_want_no_one_answers_is_given_up_and_the_wants_are_bounded() -> None:
    c = CatchUp(period=1.0)
    c.want(2, 0.0, exact=True)
    for _ in range(EXACT_ASKS):
        c.answered(None, 2)
    assert c.due_at(None, 0.0) is None  # given up; a later batch of v2 wants it again
    for v in range(MAX_EXACT_WANTS + 3):
        c.want(v, float(v), exact=True)
    assert list(c.exact) == list(range(3, MAX_EXACT_WANTS + 3))  # the oldest wants dropped


def test_a_request_for_the_newest_is_the_bytes_an_older_node_sends() -> None:
    """The version field goes on the wire only when set: an older node reads a request for the
    newest as before (its decoder refuses unknown fields), and a newer one reads an older request."""
    plain = encode(NewestRequest(above=4))
    assert b"version" not in plain and decode(plain) == NewestRequest(above=4, version=NEWEST)
    assert decode(encode(NewestRequest(above=4, version=2))) == NewestRequest(above=4, version=2)


# -- on the wire, beside older nodes --------------------------------------------------------------


async def test_a_request_by_version_never_reaches_a_node_that_only_speaks_the_older_protocol() -> None:
    """An older node's decoder refuses a NewestRequest carrying ``version`` (unknown-field) and
    reports the asker as a garbage sender (node/shards/service.py handle_stream: garbage_strikes in
    garbage_window ban it), so a validator asking older trainers for versions by number was banned by
    them. A request by version goes on a protocol older nodes do not speak: refused at negotiation,
    before any frame (review of 9008564: the older protocol's handler received the field)."""
    import trio

    from node.identity import Identity
    from node.net.host import open_swarm_host
    from node.shards.announce import call_newest
    from node.shards.protocol import PROTOCOL
    from node.wire import read_frame

    frames: list[bytes] = []

    async def older_node(stream) -> None:  # what a node before 9008564 serves, by protocol
        data = await read_frame(stream)
        if data is not None:
            frames.append(data)
        await stream.close()

    loopback = ["/ip4/127.0.0.1/tcp/0"]
    async with open_swarm_host(Identity.generate(), loopback) as home, \
            open_swarm_host(Identity.generate(), loopback) as older:
        older.set_handler(PROTOCOL, older_node)
        await home.connect(older.listen_addrs()[0])
        try:
            with trio.fail_after(30):
                await call_newest(home, older.peer_id, 5, "run", [older.peer_id], version=2)
        except trio.TooSlowError:
            raise
        except Exception:  # noqa: BLE001 - refused at negotiation: the asker moves to the next candidate
            pass
        assert frames == []
        await call_newest(home, older.peer_id, 5, "run", [older.peer_id])  # the newest: still asked there
        assert len(frames) == 1 and b"version" not in frames[0]

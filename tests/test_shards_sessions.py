"""Session-level choices of the shards protocol, on fakes (no network): when Haves go out, and
which peers a download opens sessions to."""

from __future__ import annotations

import random
from types import SimpleNamespace

import trio
import trio.testing

from node.shards.client import Download
from node.shards.peering import DIAL_AGAIN_AFTER, SPECULATIVE_SLOTS, DialBook
from node.shards.protocol import MAX_SHARDS_FRAME, Data, Have, Reject, Request
from node.shards.server import HAVE_DELAY, SEND_BATCH, ServerSession, Uploads
from node.shards.testing import StaticMembers
from node.shards.throttle import TokenBucket
from node.wire import _LEN, decode


def frames_in(data: bytes) -> list:
    out = []
    while data:
        (n,) = _LEN.unpack(data[:_LEN.size])
        out.append(decode(data[_LEN.size:_LEN.size + n], MAX_SHARDS_FRAME))
        data = data[_LEN.size + n:]
    return out


async def test_lone_haves_go_out_together_within_the_delay(autojump_clock):
    """At N peers every verified piece is a Have to each; alone, each is a Yamux frame, a Noise
    message and a wake-up at the receiver. Haves with no block to ride with wait up to HAVE_DELAY
    for company, and none waits longer."""
    writes: list[tuple[float, bytes]] = []

    class Stream:
        async def write(self, data: bytes) -> None:
            writes.append((trio.current_time(), data))

    vs = SimpleNamespace(signed=SimpleNamespace(root=b"r" * 32), verified=set())
    uploads = Uploads(1, TokenBucket(0, 0, 0), SimpleNamespace(inc=lambda n: None))
    sess = ServerSession(SimpleNamespace(), Stream(), "peer", vs, uploads)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sess._serve_queue)
        t0 = trio.current_time()
        sess.push_have(1)
        sess.push_have(2)
        await trio.sleep(HAVE_DELAY / 2)
        sess.push_have(3)
        await trio.sleep(HAVE_DELAY)  # past the first Have's deadline
        sess.push_have(4)
        await trio.sleep(5 * HAVE_DELAY)
        nursery.cancel_scope.cancel()
    assert [round(t - t0, 6) for t, _ in writes] == [HAVE_DELAY, round(2.5 * HAVE_DELAY, 6)]
    assert [[m.piece for m in frames_in(d)] for _, d in writes] == [[1, 2, 3], [4]]
    assert all(isinstance(m, Have) for _, d in writes for m in frames_in(d))


async def test_queued_blocks_go_out_together_up_to_the_batch():
    """A block alone ends in a Noise message of a few bytes; the blocks a peer has queued go out in
    one write, up to SEND_BATCH bytes of them, in the order asked, a refusal among them in its place."""
    writes: list[bytes] = []
    block = 128 * 1024

    class Stream:
        async def write(self, data: bytes) -> None:
            writes.append(data)

    vs = SimpleNamespace(signed=SimpleNamespace(root=b"r" * 32), verified={0, 1},
                         read_block=lambda piece, offset, length: bytes([piece]) * length)
    served = []
    uploads = Uploads(1, TokenBucket(0, 0, 0), SimpleNamespace(inc=served.append))
    sess = ServerSession(SimpleNamespace(), Stream(), "peer", vs, uploads)
    asked = [Request(piece=p, offset=o, length=block) for p in (0, 1) for o in (0, block, 2 * block)]
    asked.insert(2, Request(piece=7, offset=0, length=block))  # not held
    sess.queue.extend(asked)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sess._serve_queue)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    per_write = [frames_in(w) for w in writes]
    assert [len(f) for f in per_write] == [SEND_BATCH // block + 1, 2]  # the refusal is no block
    got = [m for f in per_write for m in f]
    assert [(m.piece, m.offset) for m in got] == [(r.piece, r.offset) for r in asked]
    assert isinstance(got[2], Reject) and all(isinstance(m, Data) for i, m in enumerate(got) if i != 2)
    assert served == [block] * 6


def fake_download(peers: list[str], announcer: str, *, max_peers: int, rng_seed: int = 0,
                  served: set[str] = frozenset(), public: dict[str, list[str]] | None = None,
                  banned: set[str] = frozenset(), banned_elsewhere: set[str] = frozenset()) -> Download:
    """A Download with everything but its choice of peers faked: ``served`` download from us,
    ``public`` are the members with a direct address; ``started`` lists the sessions it began,
    ``dials`` the members it dialled, ``ended`` the sessions it ended."""
    dl = object.__new__(Download)
    dl.owner = SimpleNamespace(
        host=SimpleNamespace(direct_peers=lambda: list(peers), connected_peers=lambda: list(peers)),
        cfg=SimpleNamespace(max_peers=max_peers), rng=random.Random(rng_seed),
        announced={7: (b"r" * 32, announcer)}, is_banned=lambda peer, now: peer in banned,
        banned_anywhere=lambda peer, now: peer in banned or peer in banned_elsewhere,
        downloaders_of=lambda root: set(served), dials=DialBook("me"),
        members=StaticMembers({p: ("public", a) for p, a in (public or {}).items()}))
    dl.vs = SimpleNamespace(version=7, signed=SimpleNamespace(root=b"r" * 32))
    dl.picker = SimpleNamespace(holds_all=lambda peer: False, in_flight=lambda peer: 0)
    dl.sessions, dl.refused, dl.backoff, dl.dialled = {}, {}, {}, set()
    dl.started, dl.dials, dl.ended = [], [], []
    dl._nursery = SimpleNamespace(
        start_soon=lambda fn, peer, *args: dl.dials.append((peer, *args)) if fn == dl._dial else dl.started.append(peer))
    dl._end_session = dl.ended.append
    return dl


def test_a_download_opens_a_session_to_the_announcer_and_spreads_over_the_rest():
    """With more connected peers than max_peers the first ones in py-libp2p's order got every
    session: at N = 24 most downloaders had none with the seed. The announcer comes first; the
    rest are drawn at random, so downloaders do not all pick the same peers."""
    peers = [f"p{i:02d}" for i in range(30)]
    seed = peers[-1]  # last in the host's order
    downloads = [fake_download(peers, seed, max_peers=4, rng_seed=k) for k in range(8)]
    for dl in downloads:
        dl._connect_new(0.0)
    chosen = [set(dl.sessions) for dl in downloads]
    assert all(len(c) == 4 and seed in c for c in chosen)
    assert len(set().union(*chosen) - {seed}) > 3, "every download picked the same peers"
    assert all(sorted(dl.started) == sorted(dl.sessions) for dl in downloads)


def test_a_download_short_of_direct_peers_dials_public_members_and_backs_off_from_failed_ones():
    """Sessions run only on direct connections, and a NAT'd node's are only those it opened: in
    simulation its membership dials left it a median of 3 direct peers against 7 for a public node
    (node/shards/peering.py). Short of ``max_peers``, a download dials public members (banned ones
    not), at most SPECULATIVE_SLOTS of those known by their record alone at once; one whose dial
    failed is dialled again after DIAL_AGAIN_AFTER, doubled at each failure."""
    public = {f"m{i}": [f"/ip4/10.0.0.{i}/tcp/4001"] for i in range(6)} | {"origin": ["/ip4/10.0.0.99/tcp/4001"]}
    dl = fake_download(["origin"], "origin", max_peers=4, public=public, banned={"m0"})
    book = dl.owner.dials

    def fail_all(now: float) -> list[str]:
        tried = [peer for peer, _ in dl.dials]
        for peer in list(book.dialling):
            book.on_result(peer, False, now)
        return tried

    dl._connect_new(0.0)
    first = [peer for peer, _ in dl.dials]
    assert len(first) == SPECULATIVE_SLOTS and not {"origin", "m0"} & set(first)
    assert all(addrs == public[peer] for peer, addrs in dl.dials)
    assert dl.started == ["origin"]
    dl._connect_new(1.0)  # both dials still in flight: no more
    assert len(dl.dials) == SPECULATIVE_SLOTS
    fail_all(1.5)
    for t in range(2, 20):  # the others, not those that failed
        dl._connect_new(float(t))
        fail_all(t + 0.5)
    assert sorted(p for p, _ in dl.dials) == sorted(set(public) - {"origin", "m0"})
    dl.dials.clear()
    dl._connect_new(DIAL_AGAIN_AFTER + 0.5)
    assert dl.dials == [], "a failed member waits twice DIAL_AGAIN_AFTER after its first failure"
    for t in range(2, 40):
        dl._connect_new(2 * DIAL_AGAIN_AFTER + t)
        fail_all(2 * DIAL_AGAIN_AFTER + t + 0.5)
    assert sorted(p for p, _ in dl.dials) == sorted(set(public) - {"origin", "m0"})  # once each: then 120 s


def test_a_download_dials_no_member_another_part_of_the_node_banned():
    """A peer banned by the muxer, the stream budgets, membership or a ledger penalty is not one a
    download may dial: before it dials, shards met only peers on connections that already existed."""
    public = {"m0": ["/ip4/10.0.0.1/tcp/4001"], "m1": ["/ip4/10.0.0.2/tcp/4001"]}
    dl = fake_download(["origin"], "origin", max_peers=4, public=public, banned_elsewhere={"m0"})
    dl._connect_new(0.0)
    assert [peer for peer, _ in dl.dials] == ["m1"]


def test_a_download_with_max_peers_direct_peers_dials_nobody():
    peers = [f"p{i}" for i in range(4)]
    dl = fake_download(peers, "p0", max_peers=4, public={"m": ["/ip4/10.0.0.1/tcp/4001"]})
    dl._connect_new(0.0)
    assert dl.dials == [] and sorted(dl.started) == peers


def test_peers_downloading_from_us_are_chosen_after_the_announcer():
    """Sessions carry blocks one way: drawn at random, a few downloaders at N = 24 were chosen by
    1-5 others and their upload idled. Peers that download from us come first, so sessions pair up."""
    peers = [f"p{i:02d}" for i in range(30)]
    served = {"p03", "p17", "p22"}
    for k in range(8):
        dl = fake_download(peers, "p29", max_peers=4, rng_seed=k, served=served)
        dl._connect_new(0.0)
        assert set(dl.sessions) == served | {"p29"}
        assert dl.ended == []


def test_a_peer_downloading_from_us_takes_the_slot_of_one_that_does_not():
    """All slots taken, a peer downloading from us waits: the session to a one-way peer with the
    fewest requests in flight ends (one per rescan), never the announcer's or a complete peer's."""
    peers = ["seed", "full", "busy", "idle", "mutual", "new"]
    dl = fake_download(peers, "seed", max_peers=5, served={"mutual"})
    for p in peers[:5]:
        dl.sessions[p] = object()
    in_flight = {"seed": 0, "full": 0, "busy": 3, "idle": 1, "mutual": 0}
    dl.picker = SimpleNamespace(holds_all=lambda peer: peer == "full", in_flight=in_flight.get)
    dl._connect_new(0.0)
    assert dl.ended == [], "nobody waits: the one peer downloading from us has its session"
    dl.owner.downloaders_of = lambda root: {"mutual", "new"}
    dl._connect_new(0.0)
    assert dl.ended == ["idle"] and dl.started == []
    del dl.sessions["idle"]  # its session ends
    dl._connect_new(1.0)
    assert dl.started == ["new"]
    dl.owner.downloaders_of = lambda root: {"mutual", "new", "idle", "busy"}
    dl._connect_new(2.0)  # "idle" waits, but every session is kept or pairs already
    assert dl.ended == ["idle"] and dl.started == ["new"]

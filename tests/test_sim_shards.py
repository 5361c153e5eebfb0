"""The checkpoint swarm simulator (sim/shards.py): the real picker, super-seeder and peering choices
on the simulated network, against Kumar & Ross's bound (issue 46 item 3)."""

from __future__ import annotations

import pytest

from node.shards.peering import DialState
from sim.shards import ORIGIN, Distribution, Links, Topology, kumar_ross

MiB = 1 << 20


def test_the_bound_is_whichever_of_seed_upload_slowest_download_and_total_upload_binds():
    assert kumar_ross(100, 1, [10, 10], [1e9, 1e9]) == 100  # the seed's upload
    assert kumar_ross(100, 100, [10, 10], [4, 1e9]) == 25  # the slowest download
    assert kumar_ross(100, 20, [10, 10, 10], [1e9] * 3) == pytest.approx(300 / 50)  # everyone's upload


def test_every_downloader_gets_every_piece_no_sooner_than_the_bound_allows_and_not_much_later():
    topo = Topology(8, Links.namespaces(10.0), seed=2)
    full = Distribution(topo, 4 * MiB)
    t = full.run(limit=120.0)
    assert t is not None
    assert all(len(h.verified) == full.num_pieces for h in full.holders.values())
    assert full.bound() <= t <= 1.5 * full.bound()


def test_checkpoint_bytes_never_cross_a_relay_circuit():
    topo = Topology(40, Links(nat=0.5), seed=3)
    e = topo.net.endpoints
    natted = [p for p in topo.peers if e[p].nat]
    assert natted
    for p in natted:  # a NAT'd node's direct peers are public nodes it dialled
        assert not [q for q in topo.direct[p] if e[q].nat]
    assert len(topo.stranded) < len(natted) / 4  # those with none dial public nodes for the download
    full = Distribution(topo, 2 * MiB)
    assert full.run(limit=300.0) is not None
    assert sum(e[p].relayed_bytes for p in topo.peers) == 0


@pytest.mark.parametrize("super_seed", [True, False])
def test_a_super_seeding_origin_uploads_about_one_copy_an_ordinary_seed_many(super_seed):
    topo = Topology(12, Links.namespaces(10.0), seed=4)
    full = Distribution(topo, 4 * MiB, super_seed=super_seed, hand_over=False)
    assert full.run(limit=120.0) is not None
    copies = topo.net.endpoints[ORIGIN].sent_bytes / (4 * MiB)
    assert copies < 1.3 if super_seed else copies > 2


def test_an_origin_faster_than_its_downloaders_keeps_uploading_once_one_copy_is_out():
    """The super-seeder turns ordinary seed once every piece is held by a downloader
    (node/shards/superseed.py SeedMode): kept super-seeding to the end, a 1 Gbit/s origin idled."""
    times, copies = {}, {}
    for hand_over in (False, True):
        topo = Topology(30, Links(nat=0.3), seed=5)
        full = Distribution(topo, 16 * MiB, hand_over=hand_over)
        times[hand_over] = full.run(limit=300.0)
        copies[hand_over] = topo.net.endpoints[ORIGIN].sent_bytes / (16 * MiB)
    assert copies[False] < 1.3 < 2 < copies[True]
    assert times[True] < 0.95 * times[False]


def test_nat_d_downloaders_dial_public_peers_until_they_hold_max_peers_direct_ones():
    """The node's DialBook (peering.py): without the dials, NAT'd nodes held a median of 3 direct
    peers and those holding only relay circuits got nothing (bench/sim_shards.py, issue 46)."""
    topo = Topology(40, Links(nat=0.5), seed=3)
    e = topo.net.endpoints
    assert topo.stranded  # some start with relay circuits only
    full = Distribution(topo, 4 * MiB)
    assert full.run(limit=300.0) is not None
    assert all(len(h.verified) == full.num_pieces for h in full.holders.values())  # the stranded too
    assert all(len(topo.direct[p]) >= full.cfg.max_peers for p in topo.peers if e[p].nat)
    assert sum(e[p].relayed_bytes for p in topo.peers) == 0


def test_downloads_dial_as_the_node_s_dial_book_chooses_members_with_a_relay_circuit_first():
    """The simulator drives client.py's choice of dials, not a copy (issue 46): one DialBook per
    node, fed the simulated connections. A NAT'd node holding a relay circuit to a public member
    dials it first; records saying ``private`` are never dialled; no dial is left in flight."""
    topo = Topology(40, Links(nat=0.5), seed=3)
    e = topo.net.endpoints
    room = {p: topo.cfg.max_peers - len(topo.direct[p]) for p in topo.peers}
    circuits = {p: {q for q, relay in topo.net.links[p].items() if relay is not None and not e[q].nat}
                for p in topo.peers if e[p].nat}
    first = {p: c for p, c in circuits.items() if c and len(c) <= room[p]}
    assert first  # not vacuous
    full = Distribution(topo, 4 * MiB)
    assert full.run(limit=300.0) is not None
    for p, c in first.items():
        assert c <= set(topo.direct[p])
        assert all(topo.dials[p].entries[q].state is DialState.REACHED for q in c)
    assert not [p for p in topo.peers for q in topo.direct[p] if e[p].nat and e[q].nat]
    assert not any(book.dialling for book in topo.dials.values())

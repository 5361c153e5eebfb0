"""The stand-ins of node/trainer/testing.py against the real services (issue 44 item 8).

FakeLedger, FakeMembership and FakeShards replace the ledger, membership and shards services in the
trainer, validator and sybil tests. Each set of checks below is what those callers rely on, written
once and run against the fake AND the real service (trio's ``check_two_way_stream`` is the model):
a fake that drifts from the real thing fails here, not silently in the tests that trust it.

:func:`test_each_fake_has_every_member_of_the_apis_it_stands_for` checks each fake has every member of the
APIs it stands for (a member added to an API shows up here); where a fake is looser than the real
service, a ``test_fake_*`` below says how.
"""

from __future__ import annotations

import dataclasses
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from node.gossip.api import MembershipAPI
from node.gossip.membership import MemberTable
from node.gossip.records import MAX_VERSIONS
from node.gossip.service import Membership
from node.identity import Identity
from node.ledger.api import LedgerAPI, LedgerError
from node.ledger.entries import TOTAL_FIELDS, Penalty, Verdict
from node.shards.api import ShardsAPI
from node.shards.testing import ReceiptLog, open_shards_node, same_files, write_checkpoint
from node.trainer.testing import FakeLedger, FakeMembership, FakeShards
from node.web import LedgerTotals
from test_ledger_sync import TRAINER, WORKER, open_ledger_node, rollouts
from test_membership import record

KINDS = ["fake", "real"]
KEEP = 3  # [shards] keep_versions of both shards services here
STRANGER = Identity.from_seed(b"\x07" * 32).peer_id  # a peer no entry names


def api_members(protocol: type) -> set[str]:
    """The methods and attributes a ``typing.Protocol`` declares."""
    return {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))


def test_each_fake_has_every_member_of_the_apis_it_stands_for():
    pairs = [(FakeLedger, LedgerAPI), (FakeLedger, LedgerTotals), (FakeMembership, MembershipAPI), (FakeShards, ShardsAPI)]
    lacking = {f"{fake.__name__} as {api.__name__}": sorted(m for m in api_members(api) if not hasattr(fake(), m))
               for fake, api in pairs}
    assert lacking == {name: [] for name in lacking}


# ----------------------------------------------------------------------------------------- ledger


@asynccontextmanager
async def open_ledger(kind: str, tmp_path):
    """A ledger whose own entries a trainer (TRAINER) may author."""
    if kind == "fake":
        yield FakeLedger(peer_id=TRAINER.peer_id)
        return
    if kind == "receipt-log":
        yield ReceiptLog()
        return
    async with open_ledger_node(tmp_path, "t", TRAINER) as node:
        yield node.ledger


@pytest.mark.parametrize("kind", KINDS)
async def test_ledger_a_penalty_with_a_ban_bans_that_peer_only(kind, tmp_path):
    async with open_ledger(kind, tmp_path) as ledger:
        assert ledger.ban_of(WORKER.peer_id) is None
        await ledger.append(Penalty(peer=WORKER.peer_id, reason="slow", points=3))
        assert ledger.ban_of(WORKER.peer_id) is None  # points alone ban nobody
        await ledger.append(Penalty(peer=WORKER.peer_id, reason="forged", points=3, ban_seconds=3600))
        assert ledger.ban_of(WORKER.peer_id) is not None
        assert ledger.ban_of(TRAINER.peer_id) is None


@pytest.mark.parametrize("kind", KINDS)
async def test_ledger_accepted_samples_add_up_the_batches_trained(kind, tmp_path):
    async with open_ledger(kind, tmp_path) as ledger:
        assert ledger.accepted_samples(WORKER.peer_id) == 0
        await ledger.append(rollouts(5))
        judged = rollouts(3)
        await ledger.append(judged)
        await ledger.append(judged)  # one batch judged twice counts once
        await ledger.append(dataclasses.replace(rollouts(7), accepted=False, reason="bad"))  # refused: no history
        assert ledger.accepted_samples(WORKER.peer_id) == 8
        assert ledger.accepted_samples(TRAINER.peer_id) == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_ledger_totals_add_up_each_entrys_credits_and_count_its_author(kind, tmp_path):
    """What the web page's /ledger.json shows (node/web.py LedgerTotals)."""
    async with open_ledger(kind, tmp_path) as ledger:
        assert ledger.totals() == {}
        judged = rollouts(3)
        for body in [rollouts(5), judged, judged, dataclasses.replace(rollouts(7), accepted=False, reason="bad"),
                     dataclasses.replace(judged, samples=4, tokens=10),  # one batch counted at its largest claim
                     Penalty(peer=WORKER.peer_id, reason="forged", points=3, ban_seconds=3600)]:
            await ledger.append(body)
        zero = dict.fromkeys(TOTAL_FIELDS, 0)
        worker = {**zero, "rollouts_accepted": 9, "rollouts_rejected": 7, "tokens": 80, "penalties": 3, "bans": 1}
        assert ledger.totals() == {TRAINER.peer_id: {**zero, "entries": 6}, WORKER.peer_id: worker}
        assert ledger.totals(WORKER.peer_id) == {WORKER.peer_id: worker}
        assert ledger.totals(STRANGER) == {STRANGER: zero}  # asked for: a row, even empty


# The shards tests hand their service node/shards/testing.py's ReceiptLog as its ledger (it only
# calls note_received): it must refuse what the real ledger refuses.
RECEIPT_KINDS = KINDS + ["receipt-log"]


@pytest.mark.parametrize("kind", RECEIPT_KINDS)
async def test_ledger_note_received_takes_verified_bytes_and_refuses_a_receipt_that_could_never_be_valid(kind, tmp_path):
    async with open_ledger(kind, tmp_path) as ledger:
        ledger.note_received(TRAINER.peer_id, b"m" * 32, 4096)
        ledger.note_received(TRAINER.peer_id, b"m" * 32, 4096, pieces=2)
        for bad in [("not-a-peer", b"m" * 32, 1), (TRAINER.peer_id, b"m" * 31, 1), (TRAINER.peer_id, b"m" * 32, -1)]:
            with pytest.raises(ValueError):
                ledger.note_received(*bad)


async def test_fake_ledger_takes_entries_the_real_one_refuses_this_role(tmp_path):
    """FakeLedger is looser here, and says so: it has no role, so it appends any kind of entry where
    the real one refuses what this node may not author (a trainer's verdict)."""
    verdict = Verdict(worker=WORKER.peer_id, step=1, batch_hash=bytes(32), ok=True)
    async with open_ledger("real", tmp_path) as real:
        with pytest.raises(LedgerError):
            await real.append(verdict)
    fake = FakeLedger()
    await fake.append(verdict)
    assert fake.entries == [verdict]


# ------------------------------------------------------------------------------------- membership


def open_membership(kind: str):
    if kind == "fake":
        return FakeMembership()
    table = MemberTable("me")
    return Membership(None, table.config, table, record("me", 5))


def join(membership, peer: str, role: str, addrs: list[str]) -> None:
    """``peer`` becomes an alive member (the real one hears its record)."""
    if isinstance(membership, FakeMembership):
        membership.alive[peer] = role
        membership.addrs[peer] = list(addrs)
    else:
        membership.table.on_record(dataclasses.replace(record(peer, 1, role), addrs=list(addrs)), now=0)


@pytest.mark.parametrize("kind", KINDS)
def test_membership_lists_members_and_their_addresses(kind):
    m = open_membership(kind)
    assert m.members() == {}
    join(m, "a", "trainer", ["/ip4/127.0.0.1/tcp/4001"])
    join(m, "b", "inference", ["/ip4/127.0.0.1/tcp/4002", "/ip4/127.0.0.1/tcp/4003"])
    got = m.members()
    assert got == {"a": "trainer", "b": "inference"}
    got.clear()  # the caller's copy
    assert m.members() == {"a": "trainer", "b": "inference"}
    assert m.addrs_of("b") == ["/ip4/127.0.0.1/tcp/4002", "/ip4/127.0.0.1/tcp/4003"]
    assert m.addrs_of("stranger") == []


def advertised(membership) -> dict:
    """Our record's fields, as the membership holds them."""
    return membership.record if isinstance(membership, FakeMembership) else dataclasses.asdict(membership.record)


@pytest.mark.parametrize("kind", KINDS)
def test_membership_update_changes_our_record(kind):
    m = open_membership(kind)
    m.update(checkpoints=[1, 2], load=2.0)
    m.update(capacity=5.0)
    got = advertised(m)
    assert (got["checkpoints"], got["load"], got["capacity"]) == ([1, 2], 2.0, 5.0)


def test_fake_membership_keeps_what_the_real_record_trims_or_refuses():
    """FakeMembership is looser here, and says so: it may not import the record's bounds
    (node/gossip/records.py is membership's internals to a role module: tests/test_architecture.py),
    and no caller of the fake reads its record back. Tightening the fake shows up here."""
    fake, real = open_membership("fake"), open_membership("real")
    held = list(range(1, 2 * MAX_VERSIONS + 2))
    for m in (fake, real):
        m.update(checkpoints=held)
    assert advertised(real)["checkpoints"] == held[-MAX_VERSIONS:]
    assert advertised(fake)["checkpoints"] == held
    with pytest.raises(TypeError):
        real.update(no_such_field=1)
    fake.update(no_such_field=1)
    assert advertised(fake)["no_such_field"] == 1


# ----------------------------------------------------------------------------------------- shards


@asynccontextmanager
async def open_shards(kind: str, tmp_path):
    """A shards service on which TRAINER publishes."""
    if kind == "fake":
        yield FakeShards(TRAINER.peer_id, keep_versions=KEEP)
        return
    async with open_shards_node(tmp_path / "node", identity=TRAINER, trainers=[TRAINER.peer_id], role="trainer",
                                keep_versions=KEEP) as node:
        yield node.shards


@pytest.mark.parametrize("kind", KINDS)
async def test_shards_publish_holds_announces_and_serves_the_folder(kind, tmp_path):
    async with open_shards(kind, tmp_path) as shards:
        assert shards.versions_held() == [] and shards.path_of(1) is None
        folders = [write_checkpoint(tmp_path / f"v{v}", 4096 + v, seed=v) for v in (1, 2)]
        signed = [await shards.publish(folder, v) for v, folder in zip((1, 2), folders)]
        assert shards.versions_held() == [1, 2]
        for v, folder, s in zip((1, 2), folders, signed):
            assert shards.announced[v] == (s.root, TRAINER.peer_id)
            assert same_files(shards.path_of(v), folder)
            assert s.manifest.total_size == sum(p.stat().st_size for p in folder.iterdir())
        assert signed[0].root != signed[1].root
        assert shards.path_of(3) is None


@pytest.mark.parametrize("kind", KINDS)
async def test_shards_keep_the_newest_versions_oldest_first(kind, tmp_path):
    async with open_shards(kind, tmp_path) as shards:
        assert shards.latest() is None
        folder = write_checkpoint(tmp_path / "model", 4096)
        for v in [2, 1, 3, 4, 5, 5]:  # out of order, and one twice
            await shards.publish(folder, v)
        assert shards.versions_held() == [3, 4, 5] and shards.latest() == 5
        assert shards.path_of(2) is None and shards.path_of(5) is not None


@pytest.mark.parametrize("kind", KINDS)
async def test_shards_waits_return_at_once_when_so_and_else_when_a_publish_makes_it_so(kind, tmp_path):
    async with open_shards(kind, tmp_path) as shards:
        folder = write_checkpoint(tmp_path / "model", 4096)
        await shards.publish(folder, 1)
        got = {}

        async def wait(name, call, version):
            got[name] = await call(version)

        with trio.fail_after(60):
            assert await shards.wait_announced(0) == 1 and await shards.wait_newer(None) == 1
            assert await shards.wait_version(1) == shards.path_of(1)
            async with trio.open_nursery() as nursery:
                for name, call in [("announced", shards.wait_announced), ("newer", shards.wait_newer),
                                   ("version", shards.wait_version)]:
                    nursery.start_soon(wait, name, call, 1 if name != "version" else 2)
                await trio.testing.wait_all_tasks_blocked()
                assert got == {}  # nothing newer than 1 yet
                await shards.publish(folder, 2)
        assert got == {"announced": 2, "newer": 2, "version": shards.path_of(2)}


@pytest.mark.parametrize("kind", KINDS)
async def test_shards_use_no_peers_while_nothing_is_transferred(kind, tmp_path):
    """``peers_in_use`` (what membership's connection manager must not prune) names no peer while
    no download runs: held, published or announced versions hold no connection in use. (A real
    download's peers, and uploads that never count: tests/test_shards_dial.py.)"""
    async with open_shards(kind, tmp_path) as shards:
        assert shards.peers_in_use() == set()
        await shards.publish(write_checkpoint(tmp_path / "model", 4096), 1)
        assert shards.peers_in_use() == set()


@pytest.mark.parametrize("kind", KINDS)
async def test_shards_fetch_notes_the_first_announcement_and_leaves_it_missing(kind, tmp_path):
    """A fetch names the version's root and a peer to ask: that is an announcement (the first one of
    a version stands). Neither service holds it at once (the fake never will)."""
    async with open_shards(kind, tmp_path) as shards:
        signed = await shards.publish(write_checkpoint(tmp_path / "model", 4096), 1)
        shards.fetch(1, b"x" * 32, WORKER.peer_id)  # held: a fetch changes nothing
        shards.fetch(2, b"r" * 32, WORKER.peer_id)
        shards.fetch(2, b"s" * 32, TRAINER.peer_id)
        assert shards.announced[1] == (signed.root, TRAINER.peer_id)
        assert shards.announced[2] == (b"r" * 32, WORKER.peer_id)
        assert shards.path_of(2) is None and shards.versions_held() == [1]
        assert await shards.wait_announced(1) == 2

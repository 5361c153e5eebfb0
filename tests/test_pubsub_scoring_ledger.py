"""The ledger topic's validator refuses (gossipsub REJECT, a score penalty for the forwarder) only what
proves the forwarder at fault; what an honest relay may pass on in good faith is let through and
dropped by the ledger (IGNORE), so scoring never locks an honest relay out (node/net/host.py)."""

from __future__ import annotations

from types import SimpleNamespace

from libp2p.peer.id import ID

from node.config import NodeConfig
from node.context import NodeContext
from node.ledger.config import LedgerConfig
from node.ledger.entries import GENESIS, make_entry
from node.ledger.service import LedgerService
from node.ledger.store import open_ledger_store
from test_ledger_sync import RUN, TRAINER, VALIDATOR, WORKER, rollouts, run_config

NOW_S = 1_000_000.0  # the receiver's clock
RELAY, AUTHOR = ID.from_base58(VALIDATOR.peer_id), ID.from_base58(TRAINER.peer_id)


def gossip(entry) -> SimpleNamespace:
    return SimpleNamespace(data=entry.raw)


async def test_refusals_a_relay_can_forward_in_good_faith_cost_it_nothing_garbage_costs_anyone(tmp_path):
    node = NodeContext(NodeConfig(data_dir=str(tmp_path), run=run_config()), WORKER, host=None, data_dir=tmp_path)
    now_ms = int(NOW_S * 1000)
    first = make_entry(TRAINER, RUN, 1, GENESIS, now_ms - 5000, rollouts(1))
    regressed = make_entry(TRAINER, RUN, 2, first.hash, now_ms - 9000, rollouts(2))  # before its predecessor
    # Ahead of our clock by an hour: the author's clock, or ours, may be the wrong one.
    ahead = make_entry(TRAINER, RUN, 1, GENESIS, now_ms + 3_600_000, rollouts(3))
    other_run = make_entry(TRAINER, "another-run", 2, first.hash, now_ms, rollouts(4))
    with open_ledger_store(tmp_path) as store:
        svc = LedgerService(node, store, LedgerConfig(), wall_clock=lambda: NOW_S)
        assert svc.validate_gossip(RELAY, gossip(ahead)) and svc.validate_gossip(AUTHOR, gossip(ahead))
        report = await svc.ingest([ahead.raw], "test")  # what the receive loop does with it
        assert "future-timestamp" in report.rejected and svc.ledger.head_of(TRAINER.peer_id) == 0

        await svc.ingest([first.raw], "test")
        # A relay that lacks seq 1 saw a gap and forwarded seq 2; only its author is provably at fault.
        assert svc.validate_gossip(RELAY, gossip(regressed))
        assert not svc.validate_gossip(AUTHOR, gossip(regressed))
        report = await svc.ingest([regressed.raw], "test")
        assert "time-regress" in report.rejected and svc.ledger.head_of(TRAINER.peer_id) == 1

        # Provable from the bytes alone: whoever forwards it is at fault.
        assert not svc.validate_gossip(RELAY, gossip(other_run))
        assert not svc.validate_gossip(RELAY, SimpleNamespace(data=b"\x00not an entry"))

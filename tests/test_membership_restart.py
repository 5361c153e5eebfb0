"""A restarted member comes back in every table, not only in those of the peers it synced with (issue 45).

Real nodes over loopback in one trio run. At t=865 s of the hour soak (/work/soak60b) validator-2 was
killed, declared dead by every peer, and restarted: its start record was published before the node
had a gossipsub mesh on the members topic (the bootstrap dial is the membership service's own
work, and the mesh forms a heartbeat after the peers' subscriptions arrive), so it reached nobody. Its join push-pull revived it at the relays it synced with, which do not forward
what an exchange brings; every other peer, the trainer included, held it dead until its next record.
"""

from __future__ import annotations

import trio

from node.gossip.membership import MemberState
from node.gossip.records import DOMAIN_GOODBYE, Goodbye
from node.roles.core import run_node
from node.wire import encode, seal

from swarmtest import node_config, open_nodes
from waiting import wait_for


async def test_a_restarted_member_is_revived_beyond_the_peers_it_synced_with(tmp_path, fast_membership):
    # No refresh and no periodic push-pull within the test: what revives the member must be its
    # start record reaching everyone, not a timer that would heal it minutes later.
    quiet = dict(fast_membership, min_refresh=600.0, max_refresh=600.0, min_sync=600.0)
    relay_cfg, trainer_cfg = (node_config(tmp_path, name, role, membership=quiet)
                              for name, role in (("relay", "relay"), ("trainer", "trainer")))
    async with open_nodes([relay_cfg, trainer_cfg]) as (relay, trainer):
        # The member knows only the relay: its join exchange is with the relay alone. A second relay:
        # its reachability is settled at start, where a validator's dial-back verdict is a change of
        # record, published once it has peers, which would hide what is tested here.
        validator_cfg = node_config(tmp_path, "member", "relay", bootstrap=relay.host.listen_addrs()[:1],
                                    membership=quiet)
        async with trio.open_nursery() as nursery:
            first = await nursery.start(lambda task_status: run_node(validator_cfg, task_status=task_status,
                                                                     handle_signals=False))
            vid = first.peer_id

            def state_at(node) -> MemberState | None:
                return node.membership.table.state_of(vid)

            await wait_for(lambda: state_at(trainer) is MemberState.ALIVE and state_at(relay) is MemberState.ALIVE,
                           what="the validator alive in both tables")
            await wait_for(lambda: first.membership.status()["mesh"] >= 1, what="the validator in a gossip mesh")
            # Its goodbye, sent while it still runs: the one a stopping node sends has 1 s to leave,
            # which a loaded machine can miss, and a member we hold no connection to is never probed.
            bye = Goodbye(run=first.context.run.name, peer_id=vid, seq=first.membership.record.seq)
            await first.host.pubsub.publish(first.topic("members"), encode(seal(first.identity, DOMAIN_GOODBYE, bye)))
            await wait_for(lambda: state_at(trainer) in (MemberState.LEFT, MemberState.DEAD),
                           what="the trainer holds it left or dead")
            nursery.cancel_scope.cancel()
        old_seq = trainer.membership.table.members[vid].record.seq

        # The restart, in the soak's order: the start record is published before the first connection
        # is made (there the bootstrap dial lost the race; here the test makes that connection itself).
        validator_cfg.bootstrap = []
        async with trio.open_nursery() as nursery:
            second = await nursery.start(lambda task_status: run_node(validator_cfg, task_status=task_status,
                                                                      handle_signals=False))
            assert second.peer_id == vid  # the same key, a new incarnation
            # Gossipsub would still offer it (IHAVE) for 3 heartbeats: there the dial took longer.
            members = second.topic("members")
            await wait_for(lambda: not second.host.gossipsub.mcache.window(members),
                           what="the start record out of the gossip window")
            await second.host.connect(relay.host.listen_addrs()[0])
            await wait_for(lambda: state_at(relay) is MemberState.ALIVE, what="the relay revived it (join exchange)")
            await wait_for(lambda: state_at(trainer) is MemberState.ALIVE,
                           what="the trainer revived it (its start record, once it had a mesh)")
            assert trainer.membership.table.members[vid].record.seq > old_seq
            nursery.cancel_scope.cancel()

"""Real `swarm-node` processes on loopback: join via the relay, kill -9, restart with the same key."""

from __future__ import annotations

import signal

import pytest

from node.app.localswarm import LocalSwarm

# Membership timers for the test (probe every 0.5 s, suspicion 3 periods): the configured bound
# for "every node marks a killed node dead" is then a few seconds; we allow a wide margin for a
# loaded 2-core machine. These are correctness bounds, not speed measurements.
RUN_FILE = """\
[run]
name = "proc-test"

[membership]
probe_period = 0.5
probe_timeout = 0.4
indirect_timeout = 0.8
suspicion_mult = 3.0
min_sync = 5.0
"""
JOIN_BOUND = 120.0
DEAD_BOUND = 90.0


def everyone_sees(swarm: LocalSwarm, names, state: str, subject_ids) -> bool:
    for name in names:
        states = swarm.member_states(name)
        if any(states.get(pid) != state for pid in subject_ids):
            return False
    return True


@pytest.mark.slow
def test_six_nodes_join_detect_death_and_restart(tmp_path):
    names = ["relay", "trainer", "validator", "inf-1", "inf-2", "inf-3"]
    # Membership is the same in every role; relays keep the test free of model loading.
    roles = ["relay"] * 6
    with LocalSwarm(tmp_path, log_level="info") as swarm:
        swarm.write_run_file(RUN_FILE)
        for name, role in zip(names, roles):
            swarm.start(name, role)  # all but the relay get only the relay's address
        ids = {name: swarm.node_info(name)["peer_id"] for name in names}

        def all_alive() -> bool:
            return all(
                everyone_sees(swarm, [n], "alive", [ids[m] for m in names if m != n]) for n in names
            )

        swarm.wait_until(all_alive, JOIN_BOUND)

        victim = "inf-2"
        old_id = ids[victim]
        swarm.kill(victim, signal.SIGKILL)
        others = [n for n in names if n != victim]
        swarm.wait_until(lambda: everyone_sees(swarm, others, "dead", [old_id]), DEAD_BOUND)

        swarm.restart(victim)
        assert swarm.node_info(victim)["peer_id"] == old_id  # same data dir, same key
        swarm.wait_until(lambda: everyone_sees(swarm, others, "alive", [old_id]), JOIN_BOUND)
        swarm.wait_until(lambda: everyone_sees(swarm, [victim], "alive", [ids[n] for n in others]), JOIN_BOUND)

        # A clean stop is announced: the others mark the node as left, not dead.
        swarm.kill("inf-3", signal.SIGTERM)
        rest = [n for n in others if n != "inf-3"]
        swarm.wait_until(lambda: everyone_sees(swarm, rest, "left", [ids["inf-3"]]), DEAD_BOUND)
    for proc in swarm.procs.values():
        assert not proc.alive()

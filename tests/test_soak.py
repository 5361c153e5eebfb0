"""bench/soaklib.py, the pure half of the soak benchmark (issue 45): its schedule and its accounting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import soaklib  # noqa: E402
from soaklib import (  # noqa: E402
    AckTally, SpoolRow, account, count_errors, make_schedule, recovery_s, replication_lag, role_of,
    slope_per_hour,
)

NODES = ["relay-1", "relay-2", "trainer", "validator-1", "validator-2",
         "inference-1", "inference-2", "inference-3", "inference-4"]


def test_role_of_reads_the_soaks_node_names():
    assert [role_of(n) for n in ("relay-12", "trainer", "validator-2", "inference-5")] == \
        ["relay", "trainer", "validator", "inference"]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), minutes=st.floats(5, 90))
def test_the_schedule_keeps_its_bounds_for_any_seed(seed, minutes):
    seconds = minutes * 60
    events = make_schedule(seed, seconds, NODES, disk_node="inference-4")
    assert events == make_schedule(seed, seconds, NODES, disk_node="inference-4")  # seeded
    live, busy = set(NODES), {}
    for before, after in zip(events, events[1:]):
        assert soaklib.GAP_S[0] <= after.at - before.at <= soaklib.GAP_S[1]
    for e in events:
        assert e.at >= soaklib.FIRST_EVENT_S and e.at + e.hold <= seconds - soaklib.QUIET_TAIL_S
        hit = e.targets[:1] if e.kind == soaklib.RELAY_REPLACE else e.targets
        if e.kind != soaklib.LATE_JOIN:
            assert set(hit) <= live, (e, live)  # never a node gone for good or not yet there
            assert all(busy.get(n, 0) <= e.at for n in hit), e  # never one under a fault or just after
        if e.kind == soaklib.RELAY_REPLACE:
            live.remove(e.targets[0])
            live.add(e.targets[1])
        elif e.kind == soaklib.LATE_JOIN:
            assert e.targets[0] not in live
            live.add(e.targets[0])
        else:
            busy.update({n: e.at + e.hold + soaklib.SETTLE_S for n in hit})
        if e.kind == soaklib.SILENCE:
            assert role_of(e.targets[0]) == "validator" and e.hold == soaklib.SIGSTOP_S
        if e.kind in (soaklib.PARTITION, soaklib.PARTITION_GROUP):
            assert soaklib.PARTITION_S[0] <= e.hold <= soaklib.PARTITION_S[1]


STARTS = (soaklib.KILL9, soaklib.SIGTERM, soaklib.RELAY_REPLACE, soaklib.LATE_JOIN)  # a node (re)starts


def reachable_relays(events, at: float, but: str) -> list[str]:
    """The relays a node started at ``at`` can join through: live, not ``but``, not cut off then."""
    relays = {n for n in NODES if role_of(n) == "relay"}
    cut: dict[str, float] = {}
    for e in events:
        if e.at >= at:
            break
        if e.kind == soaklib.RELAY_REPLACE:
            relays = (relays - {e.targets[0]}) | {e.targets[1]}
        elif e.kind in (soaklib.PARTITION, soaklib.PARTITION_GROUP):
            cut.update({n: e.at + e.hold for n in e.targets})
    return sorted(r for r in relays if r != but and cut.get(r, 0.0) <= at)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), minutes=st.floats(5, 90))
def test_a_node_is_started_only_while_a_relay_it_can_join_through_is_reachable(seed, minutes):
    """Each start is bootstrapped from the live relays alone. Seed 2's hour replaced relay-6 by
    relay-7 while relay-5, the only other relay, was cut off: relay-7 reached nobody until the heal
    62.5 s later, a recovery time that measured the schedule, not the node."""
    events = make_schedule(seed, minutes * 60, NODES, disk_node="inference-4")
    for e in events:
        if e.kind in STARTS:
            assert reachable_relays(events, e.at, but=e.targets[0]), e


def test_seed_2s_hour_no_longer_replaces_a_relay_while_the_other_is_cut_off():
    events = make_schedule(2, 60 * 60, NODES, disk_node="inference-4")
    assert all(reachable_relays(events, e.at, but=e.targets[0]) for e in events if e.kind in STARTS)


def test_a_half_hour_covers_every_kind_and_kills_every_role():
    events = make_schedule(7, 30 * 60, NODES, disk_node="inference-4")
    assert {e.kind for e in events} == set(soaklib.KINDS)
    assert {role_of(e.targets[0]) for e in events if e.kind == soaklib.KILL9} == set(soaklib.ROLES)


def test_without_namespaces_or_a_tmpfs_there_are_no_partitions_and_no_full_disk():
    kinds = {e.kind for e in make_schedule(3, 60 * 60, NODES, disk_node=None, can_partition=False)}
    assert not kinds & {soaklib.PARTITION, soaklib.PARTITION_GROUP, soaklib.DISK_FULL}
    assert soaklib.KILL9 in kinds and soaklib.HOSTILE in kinds


def test_acks_are_summed_over_a_workers_processes():
    tally = AckTally()
    for pid, counts in ((100, [0, 3, 5]), (200, [1, 2]), (300, [4])):  # a restart counts from 0 again
        for c in counts:
            tally.observe("w", pid, c)
    tally.observe("other", 100, 9)
    assert tally.acked("w") == 5 + 2 + 4 and tally.acked("nobody") == 0


def test_account_finds_a_batch_acked_but_in_no_state_of_the_spool():
    rows = {b"a": SpoolRow("w", "trained", "", True), b"b": SpoolRow("w", "rejected", "expired", True),
            b"c": SpoolRow("w", "rejected", "verdict-failed", True), b"d": SpoolRow("w", "gated", "", True),
            b"e": SpoolRow("w", "rejected", "too-far-ahead", False)}  # refused at intake: never acked
    whole = account({"w": 4}, rows)["w"]
    assert (whole["spooled"], whole["trained"], whole["rejected"], whole["expired"], whole["pending"], whole["lost"]) == \
        (4, 1, 1, 1, 1, 0)
    assert account({"w": 6}, rows)["w"]["lost"] == 2
    assert account({}, rows)["w"]["acked"] == 0  # a worker seen only in the spool is listed too


def test_recovery_counts_from_the_return_and_from_zero_for_a_new_process():
    samples = [(t, pid, n, None) for t, pid, n in
               [(0.0, 1, 5.0), (10.0, 1, 6.0), (20.0, 2, 1.0), (25.0, 2, 1.0), (30.0, 2, 2.0)]]
    assert recovery_s(samples, pid_before=1, back_at=15.0) == 5.0  # new pid: its first ack is progress
    assert recovery_s(samples, pid_before=2, back_at=15.0) == 15.0  # same pid: it must move past 1
    assert recovery_s(samples, pid_before=2, back_at=31.0) is None


def test_recovery_ends_when_the_node_says_it_moved_not_at_the_sample_that_saw_it():
    """Seed 2's hour: inference-5 acked its first batch 26.5 s after its SIGTERM restart by its own
    log, the sample 5 s later saw it, and 31.3 s missed the 30 s goal. The status says how long ago
    the last ack was; that time, kept between the two samples around the move, is the end."""
    samples = [(1220.5, 7, 445.0, 1219.0), (1253.6, 8, 0.0, None), (1258.6, 8, 5.0, 1253.8),
               (1263.7, 8, 8.0, 1262.0)]
    assert recovery_s(samples, pid_before=7, back_at=1227.3) == pytest.approx(1253.8 - 1227.3)
    skewed = [(1253.6, 8, 0.0, None), (1258.6, 8, 5.0, 1240.0)]  # a status clock behind ours
    assert recovery_s(skewed, pid_before=7, back_at=1227.3) == pytest.approx(1253.6 - 1227.3)
    unknown = [(1253.6, 8, 0.0, None), (1258.6, 8, 5.0, None)]  # a relay says no time
    assert recovery_s(unknown, pid_before=7, back_at=1227.3) == pytest.approx(1258.6 - 1227.3)


def test_slope_per_hour_ignores_the_warm_up():
    points = [(t, 100.0 + (50.0 if t < 60 else 0.0) + t / 3600) for t in range(0, 600, 5)]
    assert slope_per_hour(points, warmup_s=60) == pytest.approx(1.0)
    assert slope_per_hour(points[:2], warmup_s=0) is None


def test_errors_and_tracebacks_are_counted_by_kind():
    log = """\
08:00:01.000 INFO trainer node.trainer: step 3
08:00:02.123 ERRO trainer node.trainer.service: spool commit failed after 3 tries (0xdeadbeef)
08:00:03.000 ERRO trainer node.trainer.service: spool commit failed after 4 tries (0x1234abcd)
08:00:03.500 ERRO trainer libp2p.host: Failed to open stream to peer 12D3KooWC3LmXL49VmvtAxKyC7RFRxrNSc12CyRNvTyKueyPqbXu at 10.77.0.2:4001
Traceback (most recent call last):
  File "x.py", line 1, in <module>
    raise OSError(28, "No space left on device")
OSError: [Errno 28] No space left on device
08:00:04.000 WARN trainer node.net: slow
Traceback (most recent call last):
  File "y.py", line 2, in f
08:00:05.000 INFO trainer node.trainer: step 4
  + Exception Group Traceback (most recent call last):
  |   File "z.py", line 3, in g
  | ExceptionGroup: one (1 sub-exception)
  +-+---------------- 1 ----------------
    | Traceback (most recent call last):
    |   File "z.py", line 4, in h
    | KeyError: 'x'
    +------------------------------------
""".splitlines()
    kinds = count_errors(log)
    assert kinds == {"ERROR node.trainer.service: spool commit failed after N tries (<hex>)": 2,
                     "ERROR libp2p.host: Failed to open stream to peer <peer> at <addr>": 1,
                     "traceback OSError": 1, "traceback (cut off)": 1, "traceback ExceptionGroup[KeyError]": 1}


async def test_status_counts_the_trio_tasks_of_the_node():
    import trio
    import trio.testing

    from node.status import trio_tasks

    before = trio_tasks()
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(trio.sleep_forever)
        await trio.testing.wait_all_tasks_blocked()
        assert trio_tasks() == before + 3
        nursery.cancel_scope.cancel()


def test_replication_lag_is_the_age_of_the_oldest_entry_a_replica_misses():
    writer = [(0.0, 1), (10.0, 3), (20.0, 5), (30.0, 5)]
    # Caught up at 5 (holds 1 of 1), then behind since the writer passed 1 at 10 s, then caught up.
    replica = [(5.0, 1), (15.0, 1), (25.0, 3), (35.0, 5)]
    assert replication_lag(writer, replica) == [(5.0, 0.0), (15.0, 5.0), (25.0, 5.0), (35.0, 0.0)]
    # A replica that never moves trails by ever more; one ahead of the writer's last report trails by 0.
    assert [lag for _, lag in replication_lag(writer, [(12.0, 0), (40.0, 0)])] == [12.0, 40.0]
    assert replication_lag(writer, [(11.0, 4)]) == [(11.0, 0.0)]


def test_a_recovery_is_flagged_when_another_fault_on_its_node_or_the_trainer_falls_in_its_window():
    """Issue 45's hour: inference-7's late join (155.2 s) held an 82 s partition of the trainer,
    inference-1's SIGTERM (86.6 s) a trainer kill 39 s in; the table must tell them from protocol waits."""
    from soaklib import overlaps, targets_of

    records = [
        {"event": "t=   100s late-join         inference-7", "kind": "late-join", "node": "inference-7",
         "at": 100.0, "back_at": 100.0, "recovery_s": 155.2},
        # Began before the join and held the trainer cut off into its window.
        {"event": "t=    80s partition         trainer for 82 s", "kind": "partition", "node": "trainer",
         "at": 80.0, "back_at": 162.0, "recovery_s": 12.0},
        {"event": "t=   300s sigterm           inference-1", "kind": "sigterm", "node": "inference-1",
         "at": 300.0, "back_at": 301.0, "recovery_s": 86.6},
        {"event": "t=   340s kill9             trainer", "kind": "kill9", "node": "trainer",
         "at": 340.0, "back_at": 340.5, "recovery_s": 30.0},
        # Another worker's fault in the window is not this recovery's business.
        {"event": "t=   350s kill9             inference-2", "kind": "kill9", "node": "inference-2",
         "at": 350.0, "back_at": 350.5, "recovery_s": 8.0},
        # A fault on the same node after it was back is not in its window.
        {"event": "t=   500s partition         inference-1 for 40 s", "kind": "partition", "node": "inference-1",
         "at": 500.0, "back_at": 540.0, "recovery_s": 5.0},
        {"kind": "kill9", "node": "validator-2", "targets": ["validator-2"], "at": 700.0, "back_at": 700.5,
         "recovery_s": None},  # never back: its window runs to the end, which the trainer's kill is in
        {"kind": "sigterm", "node": "trainer", "targets": ["trainer"], "at": 800.0, "back_at": 805.0,
         "recovery_s": 20.0},
    ]
    assert targets_of(records[1]) == ("trainer",) and targets_of(records[6]) == ("validator-2",)
    flags = overlaps(records, end=900.0)
    assert flags[0] == ["partition trainer t=80"]
    assert flags[2] == ["kill9 trainer t=340"]
    assert flags[4] == ["kill9 trainer t=340"]  # the trainer was not back until 370.5
    assert flags[5] == []
    assert flags[6] == ["sigterm trainer t=800"]
    assert flags[3] == [] and flags[7] == []  # the trainer's own recoveries: no other fault on it then


def test_a_kept_soak_is_reported_again_with_its_overlaps_and_first_sends(tmp_path, capsys):
    import json

    import soak

    report = {
        "seed": 2, "minutes": 10.0, "findings": [], "accounting": {}, "resources": {}, "errors": {}, "reward": [],
        "step_t": [], "trainer_heads": {"trainer": 5}, "trainer_stop_s": 1.0, "digests_agreed_s": 0.0,
        "last_digests": {}, "lag": {"last_back_s": 0.0, "grace_s": 60.0, "replicas": {}},
        "events": [  # as written before targets were kept: read from the description
            {"event": "t=   100s kill9             inference-1", "kind": "kill9", "node": "inference-1", "at": 100.0,
             "back_at": 100.5, "recovery_s": 40.0, "first_sent_s": 6.5},
            {"event": "t=   120s kill9             trainer", "kind": "kill9", "node": "trainer", "at": 120.0,
             "back_at": 120.5, "recovery_s": 15.0},
        ]}
    (tmp_path / "soak.json").write_text(json.dumps(report))
    soak.reprint(tmp_path)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "inference-1" in x)
    assert "40.0" in line and "first sent 6.5 s" in line and "OVERLAP kill9 trainer t=120" in line
    line = next(x for x in out.splitlines() if "kill9" in x and "trainer" in x and "OVERLAP" not in x)
    assert "15.0" in line

"""bench/ledger.py --scale (issue 46 item 4): the sample it measures is a history the real chain rules
accept, the traffic it models follows the demo's run file and the receipt flush rules, and the long
run is the sample's measured per-entry figures scaled linearly."""

from __future__ import annotations

import collections
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import ledger as bench  # noqa: E402  bench/ledger.py

from node.app.demo import TINY_TASK  # noqa: E402
from node.ledger.chain import Ledger, Outcome  # noqa: E402
from node.ledger.entries import MAX_RECEIPT_ITEMS, Receipts, RolloutsJudged, Verdict  # noqa: E402
from node.ledger.store import open_ledger_store  # noqa: E402
from node.config import write_run_record  # noqa: E402


@pytest.mark.parametrize("traffic", bench.PROFILES, ids=lambda t: t.name)
def test_a_sample_is_a_history_the_real_chain_rules_accept_whole(traffic):
    workers = bench.worker_ids(6)
    entries, seconds = bench.make_sample(traffic, workers, 400)
    run = bench.run_config()
    ledger = Ledger(run.name, run.trainers, run.validators, max_skew_ms=0)
    now = max(se.time_ms for se in entries)
    for se in entries:
        decision = ledger.check(se, now)
        assert decision.outcome is Outcome.ACCEPT, (se.kind, decision.reason)
        ledger.apply(decision)
    kinds = collections.Counter(se.kind for se in entries)
    assert set(kinds) == set(traffic.per_minute(6))
    assert abs(len(entries) - 400) <= len(kinds)  # one rounding per kind
    assert 0 < seconds <= 3600
    # each verdict judges a batch the trainer recorded; each batch credits its worker's samples
    batches = {se.body.batch_hash: se.body.worker for se in entries if se.kind == RolloutsJudged.TYPE}
    assert {se.body.batch_hash: se.body.worker for se in entries if se.kind == Verdict.TYPE}.items() <= batches.items()
    per_worker = collections.Counter(batches.values())
    for w in workers:
        assert ledger.accepted_samples(w.peer_id) == per_worker[w.peer_id] * traffic.batch_samples
    for se in entries:
        if se.kind == Receipts.TYPE:
            assert len(se.body.items) == traffic.items_per_receipt <= MAX_RECEIPT_ITEMS
            assert se.author not in {i.peer for i in se.body.items}


def test_a_batch_holds_the_demo_run_files_samples():
    tiny = bench.PROFILES[0]
    assert tiny.batch_samples == 4 * 8  # TINY_TASK: prompts_per_batch = 4, group_size = 8
    doubled = TINY_TASK.replace("prompts_per_batch = 4", "prompts_per_batch = 8")
    assert bench.batch_samples(doubled) == 2 * tiny.batch_samples
    # twice the samples per batch, half the batches for the same samples per step
    assert replace(tiny, batch_samples=64).batches_per_worker_min == pytest.approx(tiny.batches_per_worker_min / 2)


def test_receipts_flush_once_per_interval_or_per_full_entry():
    slow = replace(bench.PROFILES[0], steps_per_min=1.0, sources=3, receipt_interval=30.0)
    assert slow.receipts_per_downloader_min == 1.0  # one checkpoint a minute: one flush with something in it
    assert slow.items_per_receipt == 3
    fast = replace(slow, steps_per_min=10.0)
    assert fast.receipts_per_downloader_min == 2.0  # a flush per 30 s, 15 pairs each
    assert fast.items_per_receipt == 15
    flood = replace(slow, steps_per_min=100.0, sources=4)
    assert flood.receipts_per_downloader_min == 400 / MAX_RECEIPT_ITEMS  # full entries, more than one a flush
    assert flood.items_per_receipt == MAX_RECEIPT_ITEMS


def test_the_long_run_is_the_sample_scaled_linearly():
    traffic = bench.PROFILES[1]
    replica = bench.Replica(db_bytes=0, empty_db_bytes=0, ram_bytes=0, hello_bytes=1300)
    cut = bench.CutCost(closed_bytes=3000, per_batch=3.0, per_version=50.0, batches=40, versions=3, load_s_per_byte=1e-7)
    sample = bench.Sample(entries=1000, seconds=60, wire=600.0, disk=800.0, ram=1500.0, rate=5000.0, replica=replica,
                          cut=cut)
    one = bench.long_run(traffic, 100, sample, days=1, link_mbit=100, period=1000, keep_versions=10, keep_steps=5)
    two = bench.long_run(traffic, 100, sample, days=2, link_mbit=100, period=1000, keep_versions=10, keep_steps=5)
    assert one.per_day == pytest.approx(sum(traffic.per_minute(100).values()) * 1440)
    assert two.entries == pytest.approx(2 * one.entries)
    assert two.disk_bytes == pytest.approx(2 * one.disk_bytes) == pytest.approx(two.entries * 800)
    assert two.ram_bytes == pytest.approx(two.entries * 1500)
    assert two.sync_bytes == pytest.approx(two.entries * 600 + 1300)  # the entries and one SyncHello
    assert two.transfer_s == pytest.approx(two.sync_bytes * 8 / 100e6)
    assert two.verify_s == pytest.approx(two.entries / 5000)
    assert two.catch_up_s == pytest.approx(two.transfer_s + two.verify_s)
    # from a cut: its bytes (closed part + the open window), loading it, then at most one period of
    # entries, however long the run
    link = 100e6 / 8
    assert two.cut_bytes == one.cut_bytes == 3000 + 100 * 5 * 3 + 10 * 50  # each worker's open steps, open versions
    assert two.cut_catch_up_s == one.cut_catch_up_s == pytest.approx(
        (5000 + 1300) / link + 5000 * 1e-7 + 1000 * (600 / link + 1 / 5000))
    assert two.cut_sync_bytes == one.cut_sync_bytes == 5000 + 1300 + 1000 * 600
    assert two.cut_disk_bytes == one.cut_disk_bytes == 5000 + 2 * 1000 * 800
    at_max = bench.long_run(traffic, 100, sample, days=1, link_mbit=100, period=one.max_period, keep_versions=10,
                            keep_steps=5)
    assert at_max.cut_catch_up_s == pytest.approx(bench.GOAL_S)
    more = bench.long_run(traffic, 200, sample, days=1, link_mbit=100, period=1000, keep_versions=10, keep_steps=5)
    assert more.per_day > one.per_day  # workers' entries grow with them, the trainer's checkpoints do not
    assert more.per_day < 2 * one.per_day + 1


def test_a_cut_grows_with_the_peers_and_the_window_not_with_the_run():
    traffic = bench.PROFILES[1]
    entries, _seconds = bench.make_sample(traffic, bench.worker_ids(20), 1200)
    short = bench.measure_cut(entries, factor=1)
    week = bench.measure_cut(entries, factor=16_000)
    assert short.versions >= 2 and short.per_version > 0
    assert short.batches >= 20 and 50 < short.per_batch < 400  # a batch id and two or three claims
    assert short.closed_bytes < week.closed_bytes < short.closed_bytes + 22 * 40  # wider integers, no more rows
    more, _seconds = bench.make_sample(traffic, bench.worker_ids(40), 1200)
    per_peer = (bench.measure_cut(more, factor=1).closed_bytes - short.closed_bytes) / 20
    assert 150 < per_peer < 400  # a peer id twice (log and row), a head hash, ten totals, a few integers


def test_scale_mode_measures_both_columns_and_prints_the_goal_ratio_last(capsys):
    bench.main(["--scale", "--sample", "120", "--workers", "9", "--baseline-workers", "6", "--days", "1"])
    out = capsys.readouterr().out
    for traffic in bench.PROFILES:
        assert traffic.name in out
    assert out.count("sample at 9 workers:") == out.count("sample at 6 workers:") == len(bench.PROFILES)
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("entries per day")]
    assert len(rows) == len(bench.PROFILES)
    goal = [line for line in out.splitlines() if "ratio catch-up / goal" in line or "the same from a cut" in line]
    assert len(goal) == 2 * len(bench.PROFILES)
    assert out.rstrip().splitlines()[-2:] == goal[-2:]  # the ratios last: today's sync, then from a cut
    assert all(float(v) > 0 for line in goal for v in line.split()[-2:])


def test_a_swarm_too_small_for_the_receipts_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--scale", "--workers", "3"])
    assert exit_.value.code == 2
    assert "--workers and --baseline-workers: more than 4" in capsys.readouterr().err


def node_data_dir(path: Path, entries: list) -> dict[str, bytes]:
    """A data dir as a node leaves it (ledger.sqlite, run.json) holding ``entries``; its files' bytes."""
    run = bench.run_config()
    with open_ledger_store(path) as store:
        store.bind_run(run.name)
        store.commit(entries)
    write_run_record(path, run)
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_memory_report_measures_a_node_data_dirs_replica_and_leaves_the_dir_as_it_was(tmp_path, capsys):
    """bench/ledger.py --memory DATA_DIR (issue 45): a node's database loaded into a fresh replica,
    its bytes per entry beside the entries' own bytes; the data dir is only copied from."""
    entries = bench.make_history(600)
    before = node_data_dir(tmp_path, entries)
    ratio = bench.memory_report(tmp_path)
    out = capsys.readouterr().out
    assert f"{len(entries)} entries by {1 + len(bench.WORKERS)} authors" in out
    raw = sum(len(se.raw) for se in entries) / len(entries)
    assert "baseline: entries as stored (raw)" in out and f" {raw:.0f} B/entry" in out
    assert "_logs" in out and "_vouched" in out
    assert 0 < ratio < 0.5  # the replica holds a fraction of what it loaded
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_cut_report_cuts_a_node_data_dir_and_a_new_node_from_the_cut_reaches_the_same_totals(tmp_path, capsys):
    """bench/ledger.py --cut DATA_DIR (issue 46 item 4): cuts of a node's database are right by its
    history, small beside the entries below them, and a new node from one plus the entries above it
    has the state of the whole database; the data dir is only copied from."""
    entries = bench.make_history(900)
    before = node_data_dir(tmp_path, entries)
    bench.main(["--cut", str(tmp_path), "--keep-steps", "4", "--keep-versions", "2"])
    out = capsys.readouterr().out
    assert f"{len(entries)} entries" in out
    assert out.count("a replica with the history finds it right") == len(bench.CUT_AT)
    assert out.count("its state = the whole replica rebased on the cut") == len(bench.CUT_AT)
    assert out.count("peers whose totals differ from the whole database's: 0") == len(bench.CUT_AT)
    ratio = float(out.rstrip().splitlines()[-1].split()[-1])  # printed last
    assert 0 < ratio < 0.5
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_cut_of_a_dir_that_is_not_a_nodes_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--cut", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"--cut: {tmp_path} is not a node's data dir" in capsys.readouterr().err

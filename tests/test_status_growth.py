"""What a long-running node's status says about growth (issue 45): live trio tasks by coroutine
name, so that the task a leak leaves behind is named, and, with PYTHONTRACEMALLOC=1, the lines whose
Python allocations grew since warm-up."""

from __future__ import annotations

import ctypes
import json
import tracemalloc

import pytest
import trio
import trio.testing

from node.config import NodeConfig
from node.context import NodeContext
from node.identity import Identity
from node.memgrowth import MemoryGrowth, c_heap, take_snapshot
from node.net.budget import StreamsConfig
from node.status import STATUS_FILE, serve_status, snapshot, tasks_by_name

from test_status_cadence import FakeHost


def test_tasks_by_name_lists_the_most_common_first_and_cuts_the_tail():
    names = ["a"] * 3 + ["b"] * 5 + ["c"] + ["d"] * 2
    assert list(tasks_by_name(names, top=2).items()) == [("b", 5), ("a", 3)]
    assert tasks_by_name(names, top=10) == {"b": 5, "a": 3, "d": 2, "c": 1}
    assert tasks_by_name([], top=3) == {}


async def left_behind(done: trio.Event) -> None:
    await done.wait()


def test_a_nodes_status_names_the_tasks_it_holds(tmp_path):
    async def main():
        node = NodeContext(NodeConfig(data_dir=str(tmp_path), summary_interval=0), Identity.generate(),
                           FakeHost(), tmp_path, started_at=trio.current_time())
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_status, node, StreamsConfig())
            before = snapshot(node)
            for _ in range(7):
                nursery.start_soon(left_behind, done)
            await trio.sleep(0)
            after = snapshot(node)
            name = f"{__name__}.left_behind"
            assert name not in before["task_names"] and after["task_names"][name] == 7
            assert after["tasks"] == before["tasks"] + 7 == sum(after["task_names"].values())  # no tail cut here
            done.set()
            await trio.sleep(20)  # past a status write: the file says the same
            assert name not in json.loads((tmp_path / STATUS_FILE).read_text())["task_names"]
            assert "memory_growth" not in after  # not asked for: tracemalloc is off
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


kept: list[bytes] = []


def grow(n: int) -> None:
    kept.extend(bytes(1000) for _ in range(n))  # the line the report must name


def test_memory_growth_names_the_line_that_grew_since_the_baseline():
    tracemalloc.start()
    try:
        growth = MemoryGrowth(warmup=100.0, every=60.0, top=5, take=take_snapshot)
        assert growth.observe(0.0) == {"baseline_in_s": 100.0}
        grow(500)  # before the baseline: warm-up, not growth
        assert growth.observe(100.0)["top"] == []
        grow(2000)
        assert growth.observe(130.0)["top"] == []  # no snapshot before `every` seconds
        report = growth.observe(160.0)
        top = report["top"][0]
        line = grow.__code__.co_firstlineno + 1
        assert top["at"] == f"{__file__}:{line}" and report["since_s"] == 60.0
        assert 2000 <= top["blocks"] < 2500 and 2000 * 1000 / 1024 <= top["kib"] < 2500 * 1100 / 1024
    finally:
        tracemalloc.stop()
        kept.clear()


def test_status_reports_memory_growth_when_tracemalloc_runs(tmp_path):
    async def main():
        node = NodeContext(NodeConfig(data_dir=str(tmp_path), summary_interval=0), Identity.generate(),
                           FakeHost(), tmp_path, started_at=trio.current_time())
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_status, node, StreamsConfig())
            assert "baseline_in_s" in snapshot(node)["memory_growth"]
            nursery.cancel_scope.cancel()

    tracemalloc.start()
    try:
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        tracemalloc.stop()


def test_the_c_heap_counts_native_memory_in_use_and_freed():
    heap = c_heap()
    if heap is None:
        pytest.skip("not glibc 2.33+: no mallinfo2")
    block = ctypes.create_string_buffer(64 * 2**20)  # malloc'd by ctypes, outside Python's allocator
    with_block = c_heap()
    assert with_block["in_use_mib"] - heap["in_use_mib"] >= 63
    del block
    assert c_heap()["in_use_mib"] - heap["in_use_mib"] < 1

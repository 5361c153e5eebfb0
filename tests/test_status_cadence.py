"""status.json is rewritten each second only while someone reads it, every ten seconds otherwise
(issue 16: building and writing it each second was the largest single cost of an idle relay), and
a reader still gets a status at most a second or two old."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from node.config import NodeConfig
from node.context import NodeContext
from node.identity import Identity
from node.net.budget import StreamsConfig
from node.status import WANT_CHECK_EVERY, serve_status
from node.status_files import (IDLE_EVERY, NODE_FILE, STATUS_FILE, WANT_FILE, WATCHED_FOR, read_status,
                               want_status)


class FakeHost:
    """What serve_status and the snapshot read of the host (a unit test: no sockets)."""

    def __init__(self) -> None:
        self.handler_errors = SimpleNamespace(counts={})
        self.inbound: dict = {}
        self.handlers: dict = {}

    def set_handler(self, protocol, handler) -> None:
        self.handlers[protocol] = handler

    def listen_addrs(self) -> list[str]:
        return ["/ip4/127.0.0.1/tcp/1"]


def written_at_clock(tmp_path) -> float:
    """The node's (mock) clock when it last wrote status.json."""
    return json.loads((tmp_path / STATUS_FILE).read_text())["uptime_s"]


def test_unread_status_is_written_every_ten_seconds_and_every_second_while_read(tmp_path):
    async def main():
        node = NodeContext(NodeConfig(data_dir=str(tmp_path), summary_interval=0), Identity.generate(),
                           FakeHost(), tmp_path, started_at=trio.current_time())

        def written_at(t: float) -> bool:  # uptime_s is rounded to 0.1 s
            return written_at_clock(tmp_path) == pytest.approx(t, abs=0.06)

        async with trio.open_nursery() as nursery:
            await nursery.start(serve_status, node, StreamsConfig())
            await trio.sleep(0.6)
            assert written_at(0.0)
            await trio.sleep(IDLE_EVERY - 1.5)  # t=9.1: nobody reads, so nothing was written
            assert written_at(0.0)
            want_status(tmp_path)  # a reader: answered at the next look, then each second
            await trio.sleep(0.3)
            assert written_at(9.0 + WANT_CHECK_EVERY)
            for k in (1, 2, 3):
                await trio.sleep(1)
                assert written_at(9.0 + WANT_CHECK_EVERY + k)
            past = time.time() - WATCHED_FOR - 1  # the reader went away
            os.utime(tmp_path / WANT_FILE, (past, past))
            await trio.sleep(IDLE_EVERY - 0.5)
            assert written_at(12.0 + WANT_CHECK_EVERY)
            await trio.sleep(0.5)
            assert written_at(12.0 + WANT_CHECK_EVERY + IDLE_EVERY)
            nursery.cancel_scope.cancel()
        final = json.loads((tmp_path / STATUS_FILE).read_text())
        assert final["stopped"] is True and not (tmp_path / NODE_FILE).exists()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def write_status(tmp_path, t: float, peer_id: str = "x") -> None:
    (tmp_path / STATUS_FILE).write_text(json.dumps({"time": t, "peer_id": peer_id}))


def test_a_reader_waits_for_a_fresh_status_from_a_running_node(tmp_path):
    write_status(tmp_path, time.time() - 60)  # last written a minute ago: nobody was reading
    asked, done = threading.Event(), threading.Event()

    def node():  # the node's side, as serve_status does it: the touch brings a fresh write
        while not done.is_set():
            if (tmp_path / WANT_FILE).exists():
                asked.set()
                write_status(tmp_path, time.time(), peer_id="fresh")
                return
            done.wait(0.01)

    writer = threading.Thread(target=node)
    writer.start()
    try:
        status = read_status(tmp_path, running=True, wait=30)
    finally:
        done.set()
        writer.join()
    assert asked.is_set() and status["peer_id"] == "fresh"  # the node's answer, not the minute-old file


def test_a_status_file_that_is_not_a_json_object_is_refused_with_a_clear_error(tmp_path):
    for junk in ("[1, 2]", '{"time": "soon"', "7"):
        (tmp_path / STATUS_FILE).write_text(junk)
        with pytest.raises(ValueError):
            read_status(tmp_path, running=False)
    (tmp_path / STATUS_FILE).write_text('{"time": "soon"}')  # an object with a bad time: read, not fresh
    assert read_status(tmp_path, running=True, wait=0)["time"] == "soon"


def test_a_stopped_node_is_read_as_it_left_its_status(tmp_path):
    write_status(tmp_path, 123.0)
    # A wait here would hang the test (faulthandler_timeout ends it): not running, nothing to wait for.
    assert read_status(tmp_path, wait=3600)["time"] == 123.0  # no node.json
    (tmp_path / NODE_FILE).write_text(json.dumps({"pid": 2 ** 22 + 1}))  # above pid_max: not alive
    assert read_status(tmp_path, wait=3600)["time"] == 123.0
    (tmp_path / NODE_FILE).write_text(json.dumps({"pid": os.getpid()}))  # alive, never writes
    assert read_status(tmp_path, wait=0.2)["time"] == 123.0  # the old one, after the wait

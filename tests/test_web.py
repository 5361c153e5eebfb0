"""The web status page (issue 19): HTTP over real sockets, the node's routes, and the page in a
real headless browser against a running multi-process swarm."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import urllib.error
import urllib.request

import pytest
import trio

from node.health import ProgressWatch
from node.identity import Identity
from node.ledger.entries import RolloutsJudged
from node.status import with_health
from node.trainer.testing import FakeLedger
from node.web import MAX_REQUEST_BYTES, node_routes, page_html, serve_http
from waiting import wait_until


def get(url: str, method: str = "GET") -> tuple[int, object, bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


PEER_A = Identity.from_seed(b"\x0a" * 32).peer_id


class CountingLedger(FakeLedger):
    """The ledger's stand-in (tests/test_fakes_conformance.py checks its totals), counting the reads."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def totals(self, peer=None):
        self.calls += 1
        return super().totals(peer)


def routes(ledger=None):
    status = {"peer_id": "12D3KooWself", "role": "relay", "membership": {"members": []}}
    return node_routes(lambda: status, lambda: b"swarm_up 1\n", ledger or CountingLedger(), 0.0)


async def test_routes_over_a_real_socket():
    ledger = CountingLedger()
    await ledger.append(RolloutsJudged(worker=PEER_A, step=0, accepted=True, samples=16, tokens=100, batch_hash=bytes(32)))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, "127.0.0.1", 0, routes(ledger))
        base = f"http://127.0.0.1:{port}"

        def fetch_all():
            return {p: get(base + p) for p in ("/", "/status.json", "/ledger.json", "/metrics", "/healthz",
                                                "/nope", "/status.json?x=1")}

        got = await trio.to_thread.run_sync(fetch_all)
        assert got["/"][0] == 200 and got["/"][1]["Content-Type"].startswith("text/html")
        assert got["/"][2] == page_html() and b"<script>" in got["/"][2]
        assert json.loads(got["/status.json"][2])["peer_id"] == "12D3KooWself"
        assert got["/status.json?x=1"][0] == 200
        assert json.loads(got["/ledger.json"][2])["totals"][PEER_A]["tokens"] == 100
        assert got["/metrics"][2] == b"swarm_up 1\n" and "version=0.0.4" in got["/metrics"][1]["Content-Type"]
        assert json.loads(got["/healthz"][2])["ok"] is True
        assert got["/nope"][0] == 404
        head = await trio.to_thread.run_sync(lambda: get(base + "/healthz", "HEAD"))
        assert head[0] == 200 and head[2] == b""
        post = await trio.to_thread.run_sync(lambda: get(base + "/healthz", "POST"))
        assert post[0] == 405
        nursery.cancel_scope.cancel()
    assert ledger.calls == 1  # totals are cached between polls


async def test_garbage_and_oversized_requests_get_a_4xx_and_the_server_keeps_serving():
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, "127.0.0.1", 0, routes())

        async def raw(data: bytes) -> bytes:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(data)
                out = b""
                while chunk := await stream.receive_some(65536):
                    out += chunk
                return out

        assert (await raw(b"this is not http\r\n\r\n")).startswith(b"HTTP/1.1 400")
        huge = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_REQUEST_BYTES + 10) + b"\r\n\r\n"
        assert (await raw(huge)).startswith(b"HTTP/1.1 431")
        assert (await raw(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 200")
        nursery.cancel_scope.cancel()


async def test_a_silent_client_is_dropped_after_the_request_timeout(autojump_clock):
    """A connection that never sends its request holds a slot only REQUEST_TIMEOUT seconds: the
    server closes it then (virtual time: the test never waits for real)."""
    import trio.testing

    from node.web import REQUEST_TIMEOUT, handle_connection

    client, server = trio.testing.memory_stream_pair()
    with trio.fail_after(2 * REQUEST_TIMEOUT):  # without the server's own timeout this fails, not hangs
        await handle_connection(server, routes())
        assert await client.receive_some(1024) == b""  # closed
    assert trio.current_time() == pytest.approx(REQUEST_TIMEOUT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_running_node_serves_its_page(tmp_path):
    from node.app.localswarm import LocalSwarm

    port = _free_port()
    with LocalSwarm(tmp_path) as swarm:
        swarm.start("relay", "relay", "--http-port", str(port))
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: swarm.status("relay").get("web"), what="the status page is up")
        assert swarm.status("relay")["web"]["url"] == base + "/"
        status = json.loads(get(base + "/status.json")[2])
        assert status["role"] == "relay" and status["peer_id"] == swarm.peer_id("relay")
        # judged health, as the page and `swarm-node status` show it: a lone relay is starting
        assert status["health"]["state"] == "starting" and status["health"]["cause"] == "no other member known alive yet"
        assert get(base + "/healthz")[0] == 200
        metrics = get(base + "/metrics")[2].decode()
        assert "swarm_tcp_bytes_total" in metrics and "process_resident_memory_bytes" in metrics
        assert "totals" in json.loads(get(base + "/ledger.json")[2])


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _dump(url: str) -> str:
    """The page's DOM after its script ran (headless Chromium)."""
    proc = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                           "--dump-dom", url], capture_output=True, text=True, timeout=120)
    return proc.stdout


VALIDATOR = "12D3KooWJKp5tsFpnTaqNZsdLpJFT8ZXP44eCFDMuwcbu7o7zYth"
STALL_CAUSE = "validator backlog: 115 batches not yet sent, 40 with validators (0 of 16 samples ready)"


def stalled_trainer_status() -> dict:
    """A trainer's snapshot as node/status.py builds it, six minutes at step 22 with 155 batches
    waiting for a verdict (issue 39's stall), as the trainer itself judges it (node/trainer/progress.py)."""
    trainer = {"step": 22, "publish_error": "", "intake": {"accepted": 400}, "seconds_since_step": 360.0,
               "steps_per_min": 0.15, "last_step_at": 1.7e9, "stalled": STALL_CAUSE,
               "batches": {"gated": 155, "ready": 0, "trained": 90, "rejected": 0, "no_signal": 0},
               "samples_in_hand": [0, 16], "gate": {"live_validators": 1, "validators": 1, "per_validator": {VALIDATOR: 40}},
               "last_step": {"step": 22, "loss": -0.0102}, "reward": [[i, 0.1 + i / 100] for i in range(1, 23)],
               "rejected_by_reason": {}}
    snap = {"peer_id": "12D3KooWself", "role": "trainer", "run": "my-run", "uptime_s": 420.0, "addrs": [],
            "run_roles": {VALIDATOR: "validator", "12D3KooWself": "trainer"},
            "membership": {"members": [], "connections": 1,
                           "rejected": {"shards/stream-error": 62, "/swarm/ledger/sync/1.0.0/wrong-run": 3}}}
    return with_health(ProgressWatch(), {**snap, "trainer": trainer}, 0.0)


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (make chromium, as root)")
async def test_the_page_shows_a_stalled_trainer_with_its_cause_names_units_and_axis_titles_in_a_browser():
    """Chromium renders a stalled trainer's page (issue 39): the stall and its cause at the top,
    the step, its age, steps/min and loss; peer ids named by role; bytes in MB; the reward chart
    with both axis titles and its last x label inside the chart; each rejection explained."""
    import re

    class Ledger:
        def totals(self):
            return {VALIDATOR: {"verdicts": 28, "bytes_served": 6_610_469}}

    status = stalled_trainer_status()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, "127.0.0.1", 0, node_routes(lambda: status, lambda: b"", Ledger(), 0.0))
        dom = await trio.to_thread.run_sync(_dump, f"http://127.0.0.1:{port}/")
        nursery.cancel_scope.cancel()
    assert '<div id="error"></div>' in dom and 'data-polls="' in dom
    assert '<div id="health" data-state="stalled">' in dom
    assert "no step for 6.0 min; " + STALL_CAUSE in dom
    figures = dict(re.findall(r'<tr><td>([^<]+)</td><td class="num">([^<]+)</td></tr>', dom.split('id="progress"', 1)[1]))
    assert figures["step"] == "22" and figures["since the last step"] == "6.0 min"
    assert figures["steps per minute"] == "0.15" and figures["loss"] == "-0.0102"
    assert figures["batches waiting for a verdict"] == "155"
    ledger = dom.split('id="ledger"', 1)[1]
    assert f'title="{VALIDATOR}">validator 12D3KooW…o7zYth</td>' in ledger  # named by the run file, not a bare id
    assert ">6.6 MB<" in ledger and ">served<" in ledger
    svg = dom.split('id="reward-svg"', 1)[1].split("</svg>", 1)[0]
    width = float(re.search(r'width="(\d+)"', dom.split('<svg', 1)[1]).group(1))
    assert re.search(r'id="x-title">step</text>', svg) and re.search(r'id="y-title"[^>]*>mean reward</text>', svg)
    ticks = re.findall(r'<text x="([\d.]+)" y="[\d.]+" class="xtick" text-anchor="(\w+)">(\d+)</text>', svg)
    assert ticks[0][1:] == ("start", "1") and ticks[-1][1:] == ("end", "22") and float(ticks[-1][0]) <= width
    rejections = dom.split('id="rejections"', 1)[1].split("</table>", 1)[0]
    stream_error = rejections.split("stream-error", 1)[1].split("</tr>", 1)[0]
    assert ">62<" in stream_error and "a few are normal" in stream_error
    assert "<td>/swarm/ledger/sync/1.0.0</td>" in rejections and "another [run] name" in rejections


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (make chromium, as root)")
async def test_the_reward_chart_draws_the_held_out_score_beside_the_training_reward_in_a_browser():
    """The trainer's eval section (node/trainer/evaluation.py) is a second curve on the reward chart,
    its points at their versions (the base, v0, left of the first step), with a caption saying what
    was measured."""
    import re

    from node.trainer.evaluation import EvalBook, EvalRecord

    book = EvalBook(5, 64, [EvalRecord(v, 0.1 + v / 100, 64, 1.0) for v in (0, 5, 10, 15, 20)])
    book.held_out = True
    status = stalled_trainer_status()
    status["trainer"]["eval"] = book.status()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, "127.0.0.1", 0, node_routes(lambda: status, lambda: b"", None, 0.0))
        dom = await trio.to_thread.run_sync(_dump, f"http://127.0.0.1:{port}/")
        nursery.cancel_scope.cancel()
    svg = dom.split('id="reward-svg"', 1)[1].split("</svg>", 1)[0]
    line = re.search(r'<polyline points="([^"]+)"[^>]*id="eval-line"', svg).group(1).split()
    assert len(line) == 5 and svg.count('class="eval-point"') == 5
    xs = [float(p.split(",")[0]) for p in line]
    assert xs == sorted(xs) and xs[0] == min(float(x) for x in re.findall(r'<line x1="([\d.]+)"', svg))  # v0 at the axis
    ticks = re.findall(r'class="xtick" text-anchor="\w+">(\d+)</text>', svg)
    assert ticks[0] == "0" and ticks[-1] == "22"
    caption = dom.split('id="eval-caption">', 1)[1].split("</div>", 1)[0]
    assert caption == "held-out score (orange): greedy on 64 held-out tasks, every 5 versions; base 0.1000, v20 0.3000"


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (Debian: apt-get install chromium)")
def test_the_page_shows_the_members_of_a_running_swarm_in_a_browser(tmp_path):
    """Chromium renders the page of a relay in a three-process swarm: the script ran (it counts its
    polls), the member table lists the other two nodes, and a later dump shows more polls."""
    from node.app.localswarm import LocalSwarm

    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    with LocalSwarm(tmp_path) as swarm:
        swarm.start("relay", "relay", "--http-port", str(port))
        swarm.start("r2", "relay")
        swarm.start("r3", "relay")
        others = {swarm.peer_id("r2"), swarm.peer_id("r3")}
        # member_states: the status file is {} until the node first writes it
        wait_until(lambda: others <= {p for p, s in swarm.member_states("relay").items() if s == "alive"},
                   what="the relay sees both others alive")

        def dump() -> str:
            return _dump(url)

        def polls(dom: str) -> int:
            return int(dom.split('data-polls="', 1)[1].split('"', 1)[0]) if 'data-polls="' in dom else 0

        dom = wait_until(lambda: (d := dump()) and all(f'data-peer="{p}"' in d for p in others) and d,
                         what="the member table lists both other nodes")
        assert "relay" in dom and polls(dom) >= 1 and '<div id="error"></div>' in dom  # no fetch failed
        assert "Checkpoint propagation" in dom and "Contributions (ledger)" in dom
        swarm.kill("r3")  # the page updates: the killed node leaves the alive set in a later render
        gone = f'data-peer="{swarm.peer_id("r3")}"'

        def r3_not_alive(dom: str) -> bool:
            return gone not in dom or 'class="alive">alive' not in dom.split(gone, 1)[1].split("</tr>", 1)[0]

        wait_until(lambda: r3_not_alive(dump()), what="the page shows r3 no longer alive")


async def test_a_client_that_breaks_http_midway_does_not_stop_the_server():
    """Pipelined requests, a body on a GET and a half-sent head: each connection ends, the server serves on."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, "127.0.0.1", 0, routes())
        for data in (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n",
                     b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
                     b"GET /healthz HTTP/1.1\r\nHo"):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(data)
            await stream.aclose()
        status, _, body = await trio.to_thread.run_sync(lambda: get(f"http://127.0.0.1:{port}/healthz"))
        assert status == 200 and json.loads(body)["ok"] is True
        nursery.cancel_scope.cancel()


async def test_the_page_binds_only_the_address_it_is_given():
    """--http-listen: on 127.0.0.2 (another loopback address on Linux) nothing answers on 127.0.0.1."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, "127.0.0.2", 0, routes())
        status, _, _ = await trio.to_thread.run_sync(lambda: get(f"http://127.0.0.2:{port}/healthz"))
        assert status == 200
        with pytest.raises(OSError):
            await trio.to_thread.run_sync(lambda: get(f"http://127.0.0.1:{port}/healthz"))
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ issue 42, hole 4: idle connections


def test_slots_a_new_connection_takes_the_slot_of_the_longest_silent_one():
    from node.web import Slots

    slots = Slots(3)
    assert [slots.admit(c) for c in range(3)] == [(True, None)] * 3
    slots.on_request(1)  # 1 sent its request: it is answered, not evicted
    assert slots.admit(3) == (True, 0) and len(slots) == 3
    assert slots.admit(4) == (True, 2)
    slots.on_request(3), slots.on_request(4)
    assert slots.admit(5) == (False, None)  # every slot answering: refused at once
    slots.release(1)
    assert slots.admit(5) == (True, None)
    slots.on_request(0)  # evicted before its request arrived: stays out
    assert 0 not in slots.answering and len(slots) == 3


def test_running_out_of_descriptors_is_logged_once_a_minute_not_per_accept():
    import logging

    from node.fds import Rarely

    rarely = Rarely(60.0)
    assert [rarely.due(t) for t in (0.0, 0.1, 59.9, 60.0, 61.0, 125.0)] == [True, False, False, True, False, True]
    records = [logging.LogRecord("trio.serve_listeners", logging.ERROR, "", 0, "accept returned EMFILE", (), None)
               for _ in range(3)]
    for r, at in zip(records, (1000.0, 1000.1, 1070.0)):
        r.created = at
    as_filter = Rarely(60.0)
    assert [as_filter.filter(r) for r in records] == [True, False, True]


def _hold(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that never send a byte (a client refused at accept is closed at once:
    its later reads see the end, which is what the test counts)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(10)
        try:
            s.connect(("127.0.0.1", port))
        except OSError:  # the backlog is full: the kernel drops the SYN; enough are held
            s.close()
            break
        socks.append(s)
    return socks


def _closed_by_server(socks: list[socket.socket]) -> int:
    shut = 0
    for s in socks:
        s.setblocking(False)
        try:
            shut += s.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:  # reset
            shut += 1
    return shut


@pytest.mark.slow
def test_idle_connections_neither_lock_out_healthz_nor_end_the_node(tmp_path):
    """Issue 42 hole 4: 1,100 silent connections to the page (and 300 to the libp2p port) against a
    node whose open-file limit leaves room for only ~50 more descriptors. Before: the page took a
    descriptor per connection, EMFILE ended the node (gossip tick loop). Now: the page holds its 32
    (the longest-silent one gives way to each newcomer), libp2p refuses past its descriptor reserve,
    ``/healthz`` answers at once and the node keeps running."""
    import resource

    from node.app.localswarm import LocalSwarm
    from node.web import MAX_CONNECTIONS

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the test holds 1,400 connections; this process may open {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))  # the attacker's own side
    port = _free_port()
    socks: list[socket.socket] = []
    try:
        with LocalSwarm(tmp_path) as swarm:
            proc = swarm.start("relay", "relay", "--http-port", str(port))
            wait_until(lambda: swarm.status("relay").get("web"), what="the status page is up")
            used = len(os.listdir(f"/proc/{proc.pid}/fd"))
            limit = used + MAX_CONNECTIONS + 20
            resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (limit, limit))
            libp2p_port = int(swarm.addr("relay").split("/tcp/")[1].split("/")[0])
            socks += _hold(port, 1100)
            socks += (p2p := _hold(libp2p_port, 300))
            assert len(socks) > 1000
            base = f"http://127.0.0.1:{port}"
            status, _, body = get(base + "/healthz")
            assert status == 200 and json.loads(body)["ok"] is True, "healthz locked out"
            # the page keeps at most its slots: all but ~32 of the idle ones are closed by the node
            http = socks[: len(socks) - len(p2p)]
            wait_until(lambda: _closed_by_server(http) >= len(http) - MAX_CONNECTIONS, what="idle page connections closed")
            wait_until(lambda: _closed_by_server(p2p) >= len(p2p) - 64, what="libp2p connections refused")
            assert proc.alive(), swarm.tail("relay")
            assert len(os.listdir(f"/proc/{proc.pid}/fd")) < limit
            for s in socks:
                s.close()
            socks.clear()
            # still a node: it answers and keeps writing its status
            assert get(base + "/healthz")[0] == 200
            assert swarm.status("relay")["role"] == "relay" and proc.alive()
    finally:
        for s in socks:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

"""The node's web status page: ``--http-port`` serves ``/``, ``/status.json``, ``/ledger.json``,
``/metrics`` and ``/healthz`` over HTTP/1.1 (issue 19).

How this works: :func:`serve_http` accepts TCP connections with trio, bounded in number
(``MAX_CONNECTIONS``, decided at accept by :class:`Slots`) and in time (``REQUEST_TIMEOUT`` for the
whole request), and parses each
request with h11 (a sans-I/O HTTP/1.1 implementation: bytes in, events out). One request per
connection (``Connection: close``): the page polls every few seconds, keep-alive would buy
nothing and cost a bound. Only GET and HEAD; no request bodies; a request head larger than
``MAX_REQUEST_BYTES`` is refused. Routes are plain functions returning ``(content type, bytes)``,
so the server knows nothing of the node: :func:`node_routes` builds them from a running node.

The page (node/data/status_page.html) is one self-contained file: no CDN, no build step; a small
script polls ``/status.json`` and ``/ledger.json`` and draws tables and an inline SVG. Default off,
bound to 127.0.0.1 unless ``--http-listen`` says otherwise: status is public information (it
travels on gossip anyway), but a reverse proxy is the place for exposing it.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from importlib import resources
from typing import NamedTuple, Protocol

import h11
import trio

from . import fds
from .net.ports import check_port_free

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 32  # held at once; past it a new one evicts the oldest still silent, or is closed at once
MAX_REQUEST_BYTES = 16 * 1024  # request line and headers
REQUEST_TIMEOUT = 10.0  # seconds to read one request and write its answer
ACCEPT_RETRY_S = 0.1  # out of descriptors: wait this long before accepting again (as trio.serve_listeners)
LEDGER_CACHE_S = 2.0  # totals are recomputed from the replica at most this often
PAGE = "status_page.html"

Route = Callable[[], tuple[str, bytes]]


class LedgerTotals(Protocol):
    def totals(self) -> dict[str, dict[str, int]]:
        """Contribution totals per peer id (node.ledger.service.LedgerService)."""


def page_html() -> bytes:
    return resources.files("node").joinpath("data", PAGE).read_bytes()


def json_route(produce: Callable[[], object]) -> Route:
    return lambda: ("application/json", json.dumps(produce()).encode())


class Admission(NamedTuple):
    admitted: bool
    evicted: int | None  # the connection that gave up its slot for this one


class Slots:
    """Which connections the page holds (pure: connection ids in, decisions out).

    Issue 42: the slot used to be taken after ``accept``, so connections waiting for one held a
    descriptor each without limit or timeout (1,100 idle ones ended the node; 32 kept ``/healthz``
    from answering). Now a connection is admitted or closed at accept. A held connection is
    *silent* until its request head has arrived, then *answering*. When every slot is taken, a new
    connection takes the slot of the longest-silent one (an honest client sends its request as soon
    as it connects; a connection that says nothing is the one worth dropping), so idle connections
    cannot lock out a health check; if none is silent, the new one is refused."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.silent: dict[int, None] = {}  # insertion order = arrival order
        self.answering: set[int] = set()

    def __len__(self) -> int:
        return len(self.silent) + len(self.answering)

    def admit(self, conn: int) -> Admission:
        if len(self) < self.limit:
            self.silent[conn] = None
            return Admission(True, None)
        if self.silent:
            oldest = next(iter(self.silent))
            del self.silent[oldest]
            self.silent[conn] = None
            return Admission(True, oldest)
        return Admission(False, None)

    def on_request(self, conn: int) -> None:
        """Its request head arrived: no longer evictable (it is answered within REQUEST_TIMEOUT)."""
        if conn in self.silent:  # not if evicted meanwhile
            del self.silent[conn]
            self.answering.add(conn)

    def release(self, conn: int) -> None:
        self.silent.pop(conn, None)
        self.answering.discard(conn)


async def serve_http(host: str, port: int, routes: dict[str, Route], *,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``routes`` (path -> route) on host:port until cancelled; ``task_status.started(port)``
    with the bound port once listening (port 0 picks a free one)."""
    check_port_free(host, port, "--http-port")  # one line for the user, not an OSError traceback
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    slots = Slots(MAX_CONNECTIONS)
    scopes: dict[int, trio.CancelScope] = {}
    ids = itertools.count()
    out_of_files = fds.Rarely()  # said once a minute while it lasts

    async def serve_one(conn: int, stream: trio.SocketStream, scope: trio.CancelScope) -> None:
        try:
            with scope:  # cancelled when a newer connection takes this one's slot
                await handle_connection(stream, routes, on_request=lambda: slots.on_request(conn))
        finally:
            await trio.aclose_forcefully(stream)  # also when evicted before handle_connection ran
            slots.release(conn)
            scopes.pop(conn, None)

    async def accept_from(listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as e:
                    if not fds.out_of_files(e):
                        raise
                    if out_of_files.due(trio.current_time()):  # the backlog keeps them; try again shortly
                        log.warning("web: out of file descriptors; connections wait in the backlog (%s)", e)
                    await trio.sleep(ACCEPT_RETRY_S)
                    continue
                conn = next(ids)
                admitted, evicted = slots.admit(conn)
                if evicted is not None:
                    scopes.pop(evicted).cancel()
                if not admitted:
                    await trio.aclose_forcefully(stream)
                    continue
                scopes[conn] = trio.CancelScope()
                nursery.start_soon(serve_one, conn, stream, scopes[conn])

    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(accept_from, listener, nursery)
        task_status.started(bound)


async def handle_connection(stream, routes: dict[str, Route], on_request: Callable[[], None] = lambda: None) -> None:
    """Answer one connection within ``REQUEST_TIMEOUT`` seconds, then close it whatever happened;
    ``on_request()`` once its request head has arrived."""
    try:
        with trio.move_on_after(REQUEST_TIMEOUT):
            await answer(stream, routes, on_request)
    except (h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
        log.debug("web: client dropped: %s", e)  # the client's doing (went away, broke HTTP): not ours
    finally:
        await trio.aclose_forcefully(stream)


async def answer(stream, routes: dict[str, Route], on_request: Callable[[], None] = lambda: None) -> None:
    """Read one request from ``stream`` and write its response (the client's errors get a 4xx)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
    try:
        request = await _next_request(stream, conn)
    except h11.RemoteProtocolError as e:
        await _send(stream, conn, e.error_status_hint, "text/plain", f"bad request: {e}\n".encode())
        await _drain(stream)
        return
    if request is None:
        return
    on_request()
    method, path = request.method.decode(), request.target.decode().split("?", 1)[0]
    route = routes.get(path)
    if method not in ("GET", "HEAD"):
        status, ctype, body = 405, "text/plain", b"only GET and HEAD\n"
    elif route is None:
        status, ctype, body = 404, "text/plain", f"no such page: {path}; try / or /status.json\n".encode()
    else:
        try:
            ctype, body = route()
            status = 200
        except Exception as e:  # ours: a broken route must not take the page down
            log.exception("web: %s failed", path)
            status, ctype, body = 500, "text/plain", f"{type(e).__name__}: {e}\n".encode()
    await _send(stream, conn, status, ctype, b"" if method == "HEAD" else body, length=len(body))


async def _drain(stream, most: int = 64 * 1024, seconds: float = 1.0) -> None:
    """Read what the client still sends (bounded) before closing: closing a socket with unread
    data makes the kernel reset the connection, and the client may lose the error response."""
    with trio.move_on_after(seconds):
        while most > 0 and (chunk := await stream.receive_some(4096)):
            most -= len(chunk)


async def _next_request(stream, conn: h11.Connection):
    received = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(4096)
            received += len(data)
            if received > MAX_REQUEST_BYTES:  # h11's own limit applies only while a head is incomplete
                raise h11.RemoteProtocolError("request head too large", 431)
            conn.receive_data(data)  # b"" = the client closed
            continue
        if isinstance(event, h11.Request):
            return event
        if isinstance(event, h11.ConnectionClosed):
            return None
        raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}", 400)


async def _send(stream, conn: h11.Connection, status: int, ctype: str, body: bytes, length: int | None = None) -> None:
    headers = [("content-type", ctype), ("content-length", str(len(body) if length is None else length)),
               ("connection", "close"), ("cache-control", "no-store"), ("x-content-type-options", "nosniff")]
    if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # h11 lets a server answer a broken request
        return
    data = conn.send(h11.Response(status_code=status, headers=headers))
    data += conn.send(h11.Data(data=body)) if body else b""  # HEAD: the head only (h11 checks)
    data += conn.send(h11.EndOfMessage())
    await stream.send_all(data)


# ------------------------------------------------------------------------------ wiring to a node


def node_routes(snapshot: Callable[[], dict], metrics: Callable[[], bytes], ledger: LedgerTotals | None,
                started: float) -> dict[str, Route]:
    """The routes of a running node's page: its status snapshot, ledger totals, metrics, health."""
    cache: dict = {"at": -LEDGER_CACHE_S, "value": {}}

    def ledger_totals() -> dict:
        now = time.monotonic()
        if ledger is not None and now - cache["at"] >= LEDGER_CACHE_S:
            cache.update(at=now, value=ledger.totals())
        return {"totals": cache["value"]}

    def health() -> dict:
        return {"ok": True, "uptime_s": round(time.monotonic() - started, 1)}

    html = page_html()
    return {
        "/": lambda: ("text/html; charset=utf-8", html),
        "/status.json": json_route(snapshot),
        "/ledger.json": json_route(ledger_totals),
        "/metrics": lambda: ("text/plain; version=0.0.4; charset=utf-8", metrics()),
        "/healthz": json_route(health),
    }


async def serve_web(node, ledger: LedgerTotals | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The node's page on ``[node] http_listen:http_port``; hands back the bound port."""
    from .status import snapshot

    cfg = node.config
    routes = node_routes(lambda: snapshot(node), node.metrics.render, ledger, time.monotonic())
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, cfg.http_listen, cfg.http_port, routes)
        url = f"http://{cfg.http_listen if ':' not in cfg.http_listen else f'[{cfg.http_listen}]'}:{port}/"
        node.status["web"] = lambda: {"url": url}
        log.info("status page", extra={"url": url})
        task_status.started(port)

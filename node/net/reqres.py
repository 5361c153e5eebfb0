"""Request/response on libp2p streams: framing, deadlines, decoding, resets and blame, done once.

How this works
--------------
* A protocol is one :class:`RequestResponse` value, defined once beside its messages and shared by
  both ends (rust-libp2p's ``request_response`` Config and Codec): its id, how requests and replies
  are read, its deadline and its inbound budget. The server makes its stream handler with
  :meth:`RequestResponse.handler` and hands in only the node's wiring (peer table, metrics, the
  ``[streams]`` deadlines) and its hooks; the client calls it with :meth:`RequestResponse.call`.
* Every inbound stream of a budgeted protocol goes through its :class:`Inbound`, the trio edge of
  the pure accounting in node/net/budget.py: per-peer and total stream slots, a byte reservation
  of each frame's announced length before its body is read, a header deadline and a minimum body
  rate. A peer that misses a deadline holds a slot without sending: its stream is cut and it is
  struck through the peer table (``Peers.strike_stalled``). Protocols that read frames themselves
  (shards sessions) use :class:`Inbound` directly.
* Server side, :meth:`RequestResponse.handler` turns ``answer(peer, request) -> reply`` into a
  stream handler: at most the budget's streams at once, a share of them per peer (the others wait, or are refused as
  "busy"), then up to ``per_stream`` exchanges of one length-prefixed frame in (the first header
  within ``[streams] header_timeout``, later ones within ``timeout``; decoded by the
  :class:`Codec`) and the handler's reply out (None: no reply, the stream ends).
* Client side, :func:`open_call` opens a stream and hands back a :class:`Caller` whose ``ask``
  writes a request and reads one reply; :func:`call` is one ``ask`` on a fresh stream.
* Errors say whose fault they are (STYLE.md 6): a :class:`~node.wire.RemoteProtocolError` is the
  peer's (counted, reported to the peer table unless it only says the stream broke, the stream
  reset); a :class:`~node.wire.LocalProtocolError` is ours and propagates; a call that gets no usable
  reply raises :class:`CallFailure` with a :class:`FailureKind`.
"""

from __future__ import annotations

import fcntl
import logging
import struct
import termios
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

from .budget import STALLED, Budget, StreamLimits, StreamsConfig, limits as default_limits
from .failure import CallFailure, FailureKind  # noqa: F401 — callers import them from here too
from .host import OPEN_STREAM_TIMEOUT, STREAM_ERRORS, tcp_socket_of
from .. import refusals
from ..dbthread import StoreClosed
from ..peers import FaultRule
from ..peers.service import STALL_SOURCE
from ..wire import (
    MAX_FRAME,
    TRANSPORT_FAILURES,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    decode,
    read_exactly,
    read_frame,
    read_header,
    write_frame,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
CLOSE_TIMEOUT = 1.0  # a close or reset of a stream the peer no longer reads from
# Refusals that are nobody's fault (a stream that broke, a peer too slow, our own load): counted,
# never reported to the peer table by a protocol's handler (node/refusals.py; a stall is struck by Inbound).
NOT_FAULTS = refusals.NOT_FAULTS
STALL_WEIGHT = 10.0  # score points one stall costs (decaying, node/peers/table.py)


@dataclass(frozen=True)
class Codec(Generic[T]):
    """How one frame becomes a value: at most ``max_size`` bytes, then ``decode`` (which raises
    RemoteProtocolError for garbage)."""

    max_size: int
    decode: Callable[[bytes], T]


def raw(max_size: int = MAX_FRAME) -> Codec[bytes]:
    """Frames as bytes (the handler parses them itself, e.g. a signed envelope)."""
    return Codec(max_size, bytes)


def messages(*types: type[Message], max_size: int = MAX_FRAME) -> Codec[Message]:
    """Frames decoded as one of ``types``; any other message type is garbage ("wrong-type")."""

    def decode_one(data: bytes) -> Message:
        msg = decode(data, max_size)
        if not isinstance(msg, types):
            raise RemoteProtocolError("wrong-type", f"{msg.TYPE} is not one of {[t.TYPE for t in types]}")
        return msg

    return Codec(max_size, decode_one)


@dataclass(frozen=True)
class RequestResponse(Generic[T, R]):
    """One request/response protocol: what its server and its clients share, so that each site
    names the protocol once instead of repeating its codecs, deadlines and budget.

    ``request`` reads what the server receives, ``reply`` what the client receives. ``timeout``
    bounds one exchange: a client's wait for its reply, a server's wait for a frame after the first
    (the first header is due within ``[streams] header_timeout``) and for its reply to go out.
    The server's inbound budget is ``limits``, or by default ``max_inflight`` streams, a quarter per
    peer, one frame of ``request.max_size`` per stream (node/net/budget.py ``limits``); a stream
    carries up to ``per_stream`` exchanges, all within ``stream_timeout`` (None: unbounded);
    ``wait_for_slot``: a stream over the budget waits for a slot (False: refused as "busy").
    Faults are counted and reported under ``source`` (default: the protocol id).
    """

    protocol: str
    request: Codec[T]
    reply: Codec[R] | None  # None: a protocol only served here, never called
    timeout: float
    max_inflight: int = 0
    limits: StreamLimits | None = None
    per_stream: int = 1
    stream_timeout: float | None = None
    wait_for_slot: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        if not self.source:
            object.__setattr__(self, "source", self.protocol)
        if self.limits is not None and self.limits.frame_cap < self.request.max_size:
            raise ValueError(f"{self.protocol}: frame cap {self.limits.frame_cap} below the codec's {self.request.max_size}")

    def budget(self) -> StreamLimits:
        """The server's inbound budget (see the class docstring)."""
        if self.limits is not None:
            return self.limits
        if self.max_inflight < 1:  # our bug: a protocol served with no budget
            raise ValueError(f"{self.protocol}: served without limits or max_inflight")
        return default_limits(self.max_inflight, self.request.max_size)

    def handler(self, answer: Handler, *, admit: Callable[[str], str | None] | None = None,
                on_fault: Callable[[str, str], None] | None = None, peers=None, metrics=None,
                streams: StreamsConfig | None = None) -> Callable[[object], Awaitable[None]]:
        """The stream handler serving this protocol with ``answer(peer, request) -> reply``
        (:func:`_handler_of` says what ``admit`` and ``on_fault`` do)."""
        return _handler_of(self, answer, admit=admit, on_fault=on_fault, peers=peers, metrics=metrics, streams=streams)

    async def call(self, host, peer: str, request: Message | bytes, timeout: float | None = None, *,
                   peers=None) -> R:
        """One request and its reply on a new stream to ``peer``, within ``timeout`` (default: the
        protocol's); CallFailure otherwise. A garbage reply is reported to ``peers``."""
        if self.reply is None:  # our bug
            raise LocalProtocolError(f"{self.protocol}: called without a reply codec")
        return await call(host, peer, self.protocol, request, self.timeout if timeout is None else timeout,
                          reply=self.reply, peers=peers, source=self.source)


# --------------------------------------------------------------------------------------------
# Streams


def peer_of(stream) -> str:
    """The remote peer id of a stream ("" when the stream does not say)."""
    try:
        return stream.muxed_conn.peer_id.to_base58()
    except AttributeError:
        return ""


async def reset(stream, *, shielded: bool = False) -> None:
    """Reset quietly: the peer may be gone already (``shielded``: even while we are being cancelled,
    so that a session's ``finally`` frees the stream)."""
    with trio.move_on_after(CLOSE_TIMEOUT, shield=shielded):
        try:
            await stream.reset()
        except STREAM_ERRORS:
            pass


async def close(stream) -> None:
    """Close quietly: the peer may have reset or closed it already."""
    with trio.move_on_after(CLOSE_TIMEOUT):
        try:
            await stream.close()
        except STREAM_ERRORS:
            pass


# --------------------------------------------------------------------------------------------
# Inbound budgets (node/net/budget.py at the trio edge)


class Refused(Exception):
    """An inbound stream or frame refused by its protocol's budget (``reason``); nothing was read."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# A deadline noticed this many seconds after it passed was missed by our own loop, not only by the
# peer: a blocking call or a starved CPU (a trainer saving a checkpoint on a loaded machine) kept it
# from running, and the peer's bytes may have sat unread in the socket meanwhile. Striking then
# banned an honest worker for ten minutes in a SmolLM2 swarm on two busy cores. The stream is still
# cut; the peer is not struck. A peer that is really silent is struck at the next deadline our loop
# meets on time.
LATE_WAKE_S = 0.5
LATE = "late-deadline"  # counted reason of a stream cut at a deadline noticed late
# Our loop may also wake on time for the deadline yet run too little to read the connection: a
# thread holding the GIL (a model loading) or a starved CPU slows the muxer's reader, and the
# peer's frames wait in our socket or our secure session's buffer, not on the wire. inference-8
# banned the honest relay-5 so in issue 45's soak, loading its model 20 s after its start. Bytes of
# the stream's connection that we have received but not read, at the deadline, say the delay is
# ours: the stream is cut, the peer not struck. But a peer can keep that evidence true on purpose:
# a native sender outruns our Python Noise+yamux reader (an upload to us on another stream, pings),
# so the excuse covers one event per peer per stall_window (PeerTable.excuse); later stalls strike.
UNREAD = "unread-at-deadline"  # counted reason of a stream cut while its connection had unread bytes


def missed_by_us(deadline: float) -> bool:
    """Whether trio woke us more than :data:`LATE_WAKE_S` after ``deadline`` (call on waking)."""
    return trio.current_time() - deadline > LATE_WAKE_S


def unread_bytes(stream) -> int:
    """Bytes the connection under ``stream`` received that our side has not read yet: in its secure
    session's buffer and its TCP socket's receive queue (py-libp2p's Yamux -> SecureSession ->
    Noise -> RawConnection). 0 where we cannot tell (a relay circuit, another transport)."""
    session = getattr(getattr(stream, "muxed_conn", None), "secured_conn", None)
    buffered = max(0, getattr(session, "high_watermark", 0) - getattr(session, "low_watermark", 0))
    noise = getattr(getattr(session, "conn", None), "read_writer", None)
    sock = tcp_socket_of(getattr(noise, "read_write_closer", None))
    if sock is None:
        return buffered
    try:
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
    except (OSError, ValueError):  # closed meanwhile
        return buffered
    return buffered + queued


class Inbound:
    """One protocol's inbound streams: its :class:`~node.net.budget.Budget`, deadlines and blame."""

    def __init__(self, protocol: str, limits: StreamLimits, *, config: StreamsConfig | None = None,
                 peers=None, metrics=None, source: str | None = None) -> None:
        self.protocol = protocol
        self.source = source or protocol
        self.budget = Budget(limits)
        self.config = config or StreamsConfig()
        self.peers, self.metrics = peers, metrics
        self._lot = trio.lowlevel.ParkingLot()  # admitted streams waiting for a slot
        if peers is not None:
            cfg = self.config
            peers.set_rule(STALL_SOURCE, FaultRule(weight=STALL_WEIGHT, strikes=cfg.stall_strikes,
                                                   window=cfg.stall_window, ban_seconds=cfg.stall_ban_seconds,
                                                   fold=cfg.stall_fold, first_ban=cfg.stall_first_ban))

    def count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.reject(self.source, reason)

    def stalled(self, peer: str, deadline: float, stream=None) -> None:
        """``peer`` missed ``deadline`` while holding a slot on ``stream``: counted and struck (the
        caller cuts the stream), unless the delay was ours: we noticed the deadline late
        (:func:`missed_by_us`) or had not read what its connection received (:func:`unread_bytes`,
        excused for one event per peer per ``stall_window``); then only counted."""
        self.budget.note_stalled()
        if missed_by_us(deadline):
            self.count(LATE)
            log.info("%s: %s's stream cut at a deadline our own loop noticed %.1fs late; not struck",
                     self.protocol, peer[-8:], trio.current_time() - deadline)
            return
        if (unread := unread_bytes(stream)) > 0 and (
                self.peers is None or self.peers.table.excuse(peer, STALL_SOURCE, trio.current_time())):
            self.count(UNREAD)
            log.info("%s: %s's stream cut at its deadline with %d bytes of its connection still unread "
                     "by us; not struck", self.protocol, peer[-8:], unread)
            return
        self.count(STALLED)
        log.info("%s: %s held a stream without sending; cut and struck (one strike per %gs)", self.protocol,
                 peer[-8:], self.config.stall_fold)
        if self.peers is not None:
            self.peers.strike_stalled(peer, self.source)

    @asynccontextmanager
    async def open(self, stream, peer: str, *, wait: bool = True) -> AsyncIterator[Frames]:
        """A slot for one stream of ``peer`` (waiting for one while ``wait``), and its frame reader;
        :class:`Refused` when the peer is over its share, stall-banned, or no slot is free."""
        if self.peers is not None and self.peers.is_banned(peer, STALL_SOURCE):
            self.budget.refused["banned"] += 1
            raise Refused("banned")
        refusal = self.budget.admit(peer)
        if refusal is not None:
            raise Refused(refusal)
        try:
            while not self.budget.start():
                if not wait:
                    raise Refused(self.budget.refuse_busy())
                await self._lot.park()
            frames = Frames(self, stream, peer, trio.current_time())
            try:
                yield frames
            finally:
                frames.release()
                self.budget.stop()
                self._lot.unpark()
        finally:
            self.budget.leave(peer)


class Frames:
    """Frames of one admitted stream, read within its protocol's deadlines and byte budget. The
    bytes of the last frame read stay reserved until the next read or the end of the stream."""

    def __init__(self, inbound: Inbound, stream, peer: str, since: float) -> None:
        self.inbound, self.stream, self.peer = inbound, stream, peer
        self._since = since  # when the wait for the next header began
        self._held = 0

    def release(self) -> None:
        if self._held:
            self.inbound.budget.release(self.peer, self._held)
            self._held = 0

    def _stall(self, what: str, deadline: float) -> RemoteProtocolError:
        self.inbound.stalled(self.peer, deadline, self.stream)
        return RemoteProtocolError(STALLED, what)

    async def read(self, *, idle: float | None = None, strict: bool = True, max_size: int | None = None) -> bytes | None:
        """The next frame, or None at a clean end of stream. Its header must come within the header
        deadline (``strict``: missing it is a stall) or ``idle`` seconds (missing it is a plain
        timeout, trio.TooSlowError; None: no bound, for sessions that may rest), counted from the
        previous read (or the slot); its body at the minimum rate, always strictly. A frame larger
        than ``max_size`` (default: the protocol's frame cap) is "oversized" garbage."""
        self.release()
        inbound, cfg = self.inbound, self.inbound.config
        start = trio.current_time() if self._since is None else self._since
        self._since = None
        if strict:
            deadline = cfg.header_deadline(start)
        else:
            deadline = float("inf") if idle is None else start + idle
        with trio.move_on_at(deadline) as waited:
            cap = inbound.budget.limits.frame_cap
            n = await read_header(self.stream, cap if max_size is None else min(cap, max_size))
        if waited.cancelled_caught:
            if strict:
                raise self._stall(f"no frame header within {cfg.header_timeout:g}s", deadline)
            raise trio.TooSlowError
        if n is None:
            return None
        refusal = inbound.budget.reserve(self.peer, n)
        if refusal is not None:
            raise Refused(refusal)
        self._held = n
        body_deadline = cfg.body_deadline(n, trio.current_time())
        with trio.move_on_at(body_deadline) as body:
            data = await read_exactly(self.stream, n) if n else b""
        if body.cancelled_caught:
            raise self._stall(f"{n}-byte body slower than {cfg.min_body_rate:g} B/s", body_deadline)
        return data

    def answered(self) -> None:
        """Our reply went out: the frame's bytes are free and the next header's wait begins."""
        self.release()
        self._since = trio.current_time()


# --------------------------------------------------------------------------------------------
# Server side

Handler = Callable[[str, T], Awaitable[Message | bytes | None]]


def _handler_of(spec: RequestResponse, handler: Handler, *, admit: Callable[[str], str | None] | None,
                on_fault: Callable[[str, str], None] | None, peers, metrics,
                streams: StreamsConfig | None) -> Callable[[object], Awaitable[None]]:
    """:meth:`RequestResponse.handler`: ``admit(peer)`` may refuse a stream before anything is read
    (its reason is counted, the stream reset). Remote faults and timeouts go to ``on_fault(peer,
    reason)``; by default they are counted in ``metrics`` under the protocol's source and reported to
    ``peers`` (node/peers) unless in NOT_FAULTS. The budget and ``streams`` (the ``[streams]``
    deadlines) make the :class:`Inbound`; stalls are struck through ``peers``. The handler's
    ``inbound`` attribute is that budget."""
    protocol, codec, source, timeout = spec.protocol, spec.request, spec.source, spec.timeout
    inbound = Inbound(protocol, spec.budget(), config=streams, peers=peers, metrics=metrics, source=source)

    def count(reason: str) -> None:
        if metrics is not None:
            metrics.reject(source, reason)

    def default_fault(peer: str, reason: str) -> None:
        count(reason)
        if peers is not None and reason not in NOT_FAULTS:
            peers.report(peer, source, reason)

    fault = on_fault or default_fault

    async def exchange(frames: Frames, stream, peer: str) -> None:
        for i in range(spec.per_stream):
            data = await frames.read(strict=i == 0, idle=timeout, max_size=codec.max_size)
            if data is None:
                return
            reply = await handler(peer, codec.decode(data))
            if reply is None:
                return
            with trio.fail_after(timeout):
                await write_frame(stream, reply)
            frames.answered()

    async def handle(stream) -> None:
        peer = peer_of(stream)
        refusal = admit(peer) if admit is not None else None
        if refusal is not None:
            count(refusal)
            await reset(stream)
            return
        try:
            async with inbound.open(stream, peer, wait=spec.wait_for_slot) as frames:
                with trio.fail_after(spec.stream_timeout if spec.stream_timeout is not None else float("inf")):
                    await exchange(frames, stream, peer)
        except Refused as e:
            count(e.reason)
            await reset(stream)
        except StoreClosed:  # we are stopping, the sender did nothing wrong: it retries later or elsewhere
            count("stopping")
            await reset(stream)
        except RemoteProtocolError as e:
            if e.reason == STALLED:  # counted and struck by Inbound
                await reset(stream)
            else:
                fault(peer, e.reason)
                await reset(stream)
        except trio.TooSlowError:
            fault(peer, "timeout")
            await reset(stream)
        except STREAM_ERRORS as e:  # the peer went away mid-exchange
            log.debug("%s: stream from %s broke: %s", protocol, peer[-8:], e)
            await reset(stream)
        finally:
            await close(stream)

    handle.inbound = inbound
    return handle


# --------------------------------------------------------------------------------------------
# libp2p ping, budgeted


PING_PAYLOAD = 32  # libp2p ping: the peer sends 32 random bytes, we echo them
PING_IDLE = 30.0  # seconds a ping stream may rest between pings (other stacks ping one stream every ~15 s)
MAX_PINGS_PER_STREAM = 64  # then the stream is closed; the peer's ping service opens a new one
PING_LIMITS = StreamLimits(streams=64, streams_per_peer=4, frame_cap=PING_PAYLOAD,
                           buffer_bytes=64 * PING_PAYLOAD, buffer_per_peer=4 * PING_PAYLOAD)


def ping_handler(protocol: str, *, streams: StreamsConfig | None = None, peers=None, metrics=None):
    """The stream handler for libp2p ping (``/ipfs/ping/1.0.0``) under :data:`PING_LIMITS`, in place
    of py-libp2p's, which serves any number of streams per peer and lets each rest 10 s per ping.
    The first ping is due within the header deadline (missing it is a stall, struck); later ones
    within :data:`PING_IDLE` (missing it just ends the stream)."""
    inbound = Inbound(protocol, PING_LIMITS, config=streams, peers=peers, metrics=metrics)

    async def handle(stream) -> None:
        peer = peer_of(stream)
        try:
            async with inbound.open(stream, peer, wait=False):
                since = trio.current_time()
                for i in range(MAX_PINGS_PER_STREAM):
                    deadline = inbound.config.header_deadline(since) if i == 0 else since + PING_IDLE
                    with trio.move_on_at(deadline) as waited:
                        first = await stream.read(PING_PAYLOAD)
                        payload = first + (await read_exactly(stream, PING_PAYLOAD - len(first))
                                           if first and len(first) < PING_PAYLOAD else b"")
                    if waited.cancelled_caught:
                        if i == 0:
                            inbound.stalled(peer, deadline, stream)
                        break
                    if not payload:
                        break
                    with trio.fail_after(CLOSE_TIMEOUT * 5):
                        await stream.write(payload)
                    since = trio.current_time()
        except Refused as e:
            inbound.count(e.reason)
        except (RemoteProtocolError, trio.TooSlowError, *STREAM_ERRORS) as e:
            log.debug("ping from %s ended: %s", peer[-8:], e)
        except Exception as e:  # noqa: BLE001 — py-libp2p signals EOF by exception (StreamEOF)
            log.debug("ping from %s ended: %s", peer[-8:], type(e).__name__)
        finally:
            await reset(stream)

    handle.inbound = inbound
    return handle


# --------------------------------------------------------------------------------------------
# Client side


class Caller:
    """One open stream to ``peer``; ``ask`` as many times as the protocol allows."""

    def __init__(self, stream, peer: str, protocol: str, peers, source: str) -> None:
        self.stream, self.peer, self.protocol = stream, peer, protocol
        self._peers, self._source = peers, source

    def garbage(self, reason: str, detail: str = "") -> CallFailure:
        """A reply that makes no sense: reported to the peer table; raise what this returns."""
        if self._peers is not None:
            self._peers.report(self.peer, self._source, reason)
        return CallFailure(FailureKind.GARBAGE, detail or reason, reason)

    async def ask(self, request: Message | bytes, reply: Codec[T], timeout: float) -> T:
        """Write ``request``, read one reply within ``timeout``; CallFailure otherwise."""
        with trio.move_on_after(timeout) as deadline:
            try:
                await write_frame(self.stream, request)
            except LocalProtocolError:
                raise
            except Exception as e:  # noqa: BLE001 — a reset or closed stream, whatever libp2p calls it
                raise CallFailure(FailureKind.STREAM, f"write: {type(e).__name__}") from None
            try:
                frame = await read_frame(self.stream, reply.max_size)
            except RemoteProtocolError as e:
                if e.reason in TRANSPORT_FAILURES:
                    raise CallFailure(FailureKind.STREAM, str(e), e.reason) from None
                raise self.garbage(e.reason, str(e)) from None
            if frame is None:
                raise CallFailure(FailureKind.STREAM, "closed without a reply", "truncated")
            try:
                return reply.decode(frame)
            except RemoteProtocolError as e:
                raise self.garbage(e.reason, str(e)) from None
        assert deadline.cancelled_caught
        raise CallFailure(FailureKind.TIMEOUT, f"no reply within {timeout:g}s", "timeout")


@asynccontextmanager
async def open_call(host, peer: str, protocol: str, *, open_timeout: float = OPEN_STREAM_TIMEOUT,
                    peers=None, source: str | None = None) -> AsyncIterator[Caller]:
    """A :class:`Caller` on a new stream to ``peer``; the stream is closed on exit."""
    try:
        with trio.fail_after(open_timeout):
            stream = await host.open_stream(peer, protocol)
    except trio.Cancelled:
        raise
    except Exception as e:  # noqa: BLE001 — libp2p raises many types for "cannot dial / protocol refused"
        raise CallFailure(FailureKind.UNREACHABLE, f"{type(e).__name__}: {e}") from None
    try:
        yield Caller(stream, peer, protocol, peers, source or protocol)
    finally:
        with trio.CancelScope(shield=True):
            await close(stream)


async def call(host, peer: str, protocol: str, request: Message | bytes, timeout: float, *,
               reply: Codec[T], peers=None, source: str | None = None) -> T:
    """One request and its reply on a new stream, all within ``timeout``; CallFailure otherwise."""
    with trio.move_on_after(timeout) as deadline:
        async with open_call(host, peer, protocol, peers=peers, source=source) as caller:
            return await caller.ask(request, reply, timeout)
    assert deadline.cancelled_caught
    raise CallFailure(FailureKind.TIMEOUT, f"no reply within {timeout:g}s", "timeout")

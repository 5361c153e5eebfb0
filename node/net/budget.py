"""Per-peer and total budgets of inbound streams: slots, buffered bytes and deadlines.

How this works
--------------
Every stream protocol a node answers keeps one :class:`Budget` (its :class:`StreamLimits`): how
many streams it serves at once, in total and per peer, and how many bytes of frames it holds at
once (read but not yet answered), in total and per peer. The trio edge (node/net/reqres.py:
:class:`~node.net.reqres.Inbound`) asks it before it does any work for a remote peer:

* a new stream is **admitted** (:meth:`Budget.admit`) only while its peer holds fewer than
  ``streams_per_peer`` streams (waiting or served); it is then **started** (:meth:`Budget.start`)
  once fewer than ``streams`` are served in total (until then it waits for a slot, or is refused);
* once a frame's header (its 4-byte length) is read, the announced length is **reserved**
  (:meth:`Budget.reserve`) before a byte of the body is read: refused when it exceeds the frame cap,
  the peer's share or what is left of the total, so unfinished frames never hold more than
  ``buffer_bytes`` for the protocol, whoever sends them, nor more than ``buffer_per_peer`` for one
  peer;
* deadlines (:class:`StreamsConfig`): a frame header must arrive within ``header_timeout`` seconds
  of the slot being given (or of the previous answer), and the body at ``min_body_rate`` bytes/s
  after ``body_grace`` seconds. A peer that misses one holds a slot without sending: the edge cuts
  the stream and strikes the peer through the peer table (node/peers/service.py). Stalls within
  ``stall_fold`` seconds after the peer's last strike are one event and one strike: a partition,
  or one connection our side reads late, stalls every stream on it at once.

Per-peer limits are always smaller than the totals (checked in :class:`StreamLimits`), so one peer
can never take every slot or the whole byte budget: an honest peer finds a slot however one other
peer behaves. Counters (peaks, refusals by reason) are kept for status and tests.

Pure: no I/O, no clock; times are arguments (seconds on the caller's monotonic clock).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

PER_PEER_SHARE = 4  # by default one peer may hold a quarter of a protocol's streams and bytes

# Refusal reasons (counted in metrics under the protocol's source).
PEER_STREAMS = "peer-streams"  # this peer already holds its share of streams
BUSY = "busy"  # every slot is taken (nobody's fault)
PEER_BYTES = "peer-bytes"  # this peer's frames in flight already hold its share of bytes
BYTES = "busy-bytes"  # the protocol's byte budget is spent (nobody's fault)
OVERSIZED = "oversized"  # a frame announced larger than the protocol's frame cap
STALLED = "stalled"  # a header or body did not arrive in time: the peer held a slot without sending


@dataclass(frozen=True)
class StreamLimits:
    """What one protocol serves at once. Per-peer numbers must be smaller than the totals."""

    streams: int  # streams served at once, all peers together
    streams_per_peer: int  # streams one peer may hold (served or waiting for a slot)
    frame_cap: int  # the largest frame the protocol reads (bytes)
    buffer_bytes: int  # bytes of frames held at once (read, not yet answered), all peers together
    buffer_per_peer: int  # the same for one peer

    def __post_init__(self) -> None:
        if not 1 <= self.streams_per_peer < self.streams or (self.streams == 1 and self.streams_per_peer != 1):
            raise ValueError(f"streams_per_peer must be in 1..streams-1, got {self.streams_per_peer} of {self.streams}")
        if not self.frame_cap <= self.buffer_per_peer < self.buffer_bytes:
            raise ValueError(f"need frame_cap <= buffer_per_peer < buffer_bytes, got {self.frame_cap}, "
                             f"{self.buffer_per_peer}, {self.buffer_bytes}")


def limits(streams: int, frame_cap: int, *, buffer_frames: int | None = None, share: int = PER_PEER_SHARE,
           per_peer: int | None = None) -> StreamLimits:
    """Limits for ``streams`` streams of frames up to ``frame_cap`` bytes: one peer gets 1/``share``
    of the streams (``per_peer`` to say it exactly) and the bytes of as many whole frames; the total
    byte budget holds ``buffer_frames`` whole frames (default: one per stream)."""
    per_peer = per_peer if per_peer is not None else max(1, streams // share)
    per_peer = min(per_peer, streams - 1) if streams > 1 else 1
    frames = buffer_frames if buffer_frames is not None else streams
    total_bytes = max(frames * frame_cap, (per_peer + 1) * frame_cap)
    peer_bytes = max(frame_cap, min(per_peer * frame_cap, total_bytes - frame_cap))
    return StreamLimits(max(streams, 2), per_peer, frame_cap, total_bytes, peer_bytes)


@dataclass
class StreamsConfig:
    """``[streams]`` table: deadlines every inbound stream protocol applies to its peers."""

    header_timeout: float = 5.0  # seconds a request's frame header may take to arrive once its stream has a slot
    min_body_rate: float = 262144.0  # bytes/s a frame's body must arrive at, at least, after body_grace
    body_grace: float = 2.0  # seconds every frame body gets on top of its length / min_body_rate
    stall_strikes: int = 3  # stall events (see stall_fold) that get a peer banned and disconnected...
    stall_window: float = 600.0  # ... when they fall within this many seconds (also: one unread-bytes excuse per peer per window; ban lengths start over after a window without a ban)
    stall_ban_seconds: float = 600.0  # how long such a ban lasts at most...
    stall_first_ban: float = 60.0  # ... but a peer's first lasts this long, each later one twice the last (0: always stall_ban_seconds)
    stall_fold: float = 10.0  # stalls within this many seconds after a peer's last strike are one event, not a new strike (a cut link stalls all its streams at once)

    def validate(self) -> None:
        if not 0 < self.header_timeout <= 600:
            raise ValueError(f"header_timeout: 0..600 seconds, got {self.header_timeout}")
        if self.min_body_rate < 1024:
            raise ValueError(f"min_body_rate: at least 1024 bytes/s, got {self.min_body_rate}")
        if not 0 <= self.body_grace <= 600:
            raise ValueError(f"body_grace: 0..600 seconds, got {self.body_grace}")
        if self.stall_strikes < 1 or self.stall_window <= 0 or self.stall_ban_seconds < 0:
            raise ValueError("stall_strikes >= 1, stall_window > 0, stall_ban_seconds >= 0")
        if self.stall_first_ban < 0:
            raise ValueError(f"stall_first_ban: 0 seconds or more, got {self.stall_first_ban}")
        if not 0 <= self.stall_fold < self.stall_window:
            raise ValueError(f"stall_fold: 0 seconds or more, below stall_window ({self.stall_window:g}), "
                             f"got {self.stall_fold}")

    def header_deadline(self, since: float) -> float:
        """When the next frame header must have arrived, for a wait that began at ``since``."""
        return since + self.header_timeout

    def body_deadline(self, length: int, since: float) -> float:
        """When a body of ``length`` bytes whose header arrived at ``since`` must be complete."""
        return since + self.body_grace + length / self.min_body_rate


class Budget:
    """The accounting of one protocol's inbound streams (see the module docstring)."""

    def __init__(self, limits: StreamLimits) -> None:
        self.limits = limits
        self.streams_of: dict[str, int] = {}  # peer -> streams admitted (served or waiting)
        self.bytes_of: dict[str, int] = {}  # peer -> bytes reserved
        self.served = 0  # streams holding a slot
        self.reserved = 0  # bytes reserved, all peers
        self.peak_served = 0
        self.peak_reserved = 0
        self.peak_peer_reserved = 0
        self.refused: collections.Counter[str] = collections.Counter()  # reason -> streams or frames refused
        self.stalled = 0  # streams cut for missing a deadline

    # ------------------------------------------------------------------ streams

    def admit(self, peer: str) -> str | None:
        """A new stream from ``peer``: None if admitted (call :meth:`leave` when it ends), else why not."""
        held = self.streams_of.get(peer, 0)
        if held >= self.limits.streams_per_peer:
            self.refused[PEER_STREAMS] += 1
            return PEER_STREAMS
        self.streams_of[peer] = held + 1
        return None

    def start(self) -> bool:
        """Give an admitted stream a slot if one is free (call :meth:`stop` when it ends)."""
        if self.served >= self.limits.streams:
            return False
        self.served += 1
        self.peak_served = max(self.peak_served, self.served)
        return True

    def refuse_busy(self) -> str:
        """An admitted stream found no slot and will not wait: counted, and its reason returned."""
        self.refused[BUSY] += 1
        return BUSY

    def stop(self) -> None:
        if self.served <= 0:
            raise AssertionError("Budget.stop without a slot")
        self.served -= 1

    def leave(self, peer: str) -> None:
        held = self.streams_of.get(peer, 0)
        if held <= 0:
            raise AssertionError(f"Budget.leave for {peer!r} without a stream")
        if held == 1:
            del self.streams_of[peer]
        else:
            self.streams_of[peer] = held - 1

    def note_stalled(self) -> None:
        self.stalled += 1
        self.refused[STALLED] += 1

    # ------------------------------------------------------------------ bytes

    def reserve(self, peer: str, length: int) -> str | None:
        """Hold ``length`` bytes for a frame ``peer`` announced: None if held (call :meth:`release`),
        else why not (nothing is held then)."""
        lim = self.limits
        if length > lim.frame_cap:
            self.refused[OVERSIZED] += 1
            return OVERSIZED
        mine = self.bytes_of.get(peer, 0)
        if mine + length > lim.buffer_per_peer:
            self.refused[PEER_BYTES] += 1
            return PEER_BYTES
        if self.reserved + length > lim.buffer_bytes:
            self.refused[BYTES] += 1
            return BYTES
        if length:
            self.bytes_of[peer] = mine + length
            self.reserved += length
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            self.peak_peer_reserved = max(self.peak_peer_reserved, mine + length)
        return None

    def release(self, peer: str, length: int) -> None:
        if not length:
            return
        mine = self.bytes_of.get(peer, 0)
        if mine < length:
            raise AssertionError(f"Budget.release of {length} bytes for {peer!r} holding {mine}")
        if mine == length:
            del self.bytes_of[peer]
        else:
            self.bytes_of[peer] = mine - length
        self.reserved -= length

    # ------------------------------------------------------------------ views

    def held_by(self, peer: str) -> tuple[int, int]:
        """(streams admitted, bytes reserved) of ``peer`` now."""
        return self.streams_of.get(peer, 0), self.bytes_of.get(peer, 0)

    def snapshot(self) -> dict:
        lim = self.limits
        return {
            "streams": self.served, "streams_max": lim.streams, "streams_per_peer": lim.streams_per_peer,
            "bytes": self.reserved, "bytes_max": lim.buffer_bytes, "bytes_per_peer": lim.buffer_per_peer,
            "peak_streams": self.peak_served, "peak_bytes": self.peak_reserved,
            "refused": dict(self.refused), "stalled": self.stalled,
        }

"""The wire module: schemas, bounds, garbage, envelopes and frames."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

import hypothesis
import hypothesis.strategies as st
import msgpack
import pytest
import trio
import trio.testing

from node.identity import Identity
from node.wire import (
    MAX_FRAME,
    Envelope,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    bounded,
    decode,
    decode_as,
    encode,
    frame_of,
    frame_parts,
    pack,
    unpack_viewing_tail,
    read_frame,
    read_message,
    register,
    seal,
    write_frame,
    write_parts,
)


@register
@dataclass(frozen=True)
class Sample(Message):
    TYPE: ClassVar[str] = "test.sample"
    name: str = bounded(max_len=8)
    count: int = bounded(min=0, max=100)
    blob: bytes = bounded(max_len=16, default=b"")
    tags: list[str] = bounded(max_len=3, item_max_len=5, default_factory=list)
    ratio: float = bounded(min=0.0, max=1.0, default=0.5)
    logps: list[float] = bounded(max_len=4, item_min=-10.0, item_max=0.0, default_factory=list)
    free: float = bounded(default=0.0)  # no range: still finite


def test_round_trip():
    msg = Sample(name="a", count=3, blob=b"xy", tags=["p", "q"], ratio=0.25)
    assert decode(encode(msg)) == msg
    assert decode_as(Sample, encode(msg)) == msg


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"name": "x" * 9, "count": 1}, "oversized"),
        ({"name": "x", "count": 101}, "out-of-bounds"),
        ({"name": "x", "count": -1}, "out-of-bounds"),
        ({"name": "x", "count": "1"}, "bad-field"),
        ({"name": "x", "count": True}, "bad-field"),
        ({"name": b"x", "count": 1}, "bad-field"),
        ({"name": "x"}, "missing-field"),
        ({"name": "x", "count": 1, "evil": 1}, "unknown-field"),
        ({"name": "x", "count": 1, "tags": ["a", "b", "c", "d"]}, "oversized"),
        ({"name": "x", "count": 1, "ratio": float("nan")}, "bad-field"),
        ({"name": "x", "count": 1, "free": float("inf")}, "bad-field"),
        ({"name": "x", "count": 1, "free": float("-inf")}, "bad-field"),
        ({"name": "x", "count": 1, "logps": [-1.0, -1e30]}, "out-of-bounds"),
        ({"name": "x", "count": 1, "logps": [0.5]}, "out-of-bounds"),
        ({"name": "x", "count": 1, "tags": ["p", "x" * 6]}, "oversized"),  # each item's length too
        ({"name": "x", "count": 1, "logps": [float("-inf")]}, "bad-field"),
        ({"name": "x", "count": 1, "logps": [float("nan")]}, "bad-field"),
    ],
)
def test_schema_violations_are_remote_errors(fields, reason):
    data = pack({"t": "test.sample", "v": 1, **fields})
    with pytest.raises(RemoteProtocolError) as exc:
        decode(data)
    assert exc.value.reason == reason


def test_unknown_type_and_version():
    with pytest.raises(RemoteProtocolError, match="unknown-type"):
        decode(pack({"t": "nope", "v": 1}))
    with pytest.raises(RemoteProtocolError, match="bad-version"):
        decode(pack({"t": "test.sample", "v": 2, "name": "a", "count": 1}))
    with pytest.raises(RemoteProtocolError, match="malformed"):
        decode(pack([1, 2, 3]))


def test_random_garbage_only_raises_remote_errors():
    rng = random.Random(7)
    valid = encode(Sample(name="abc", count=5, tags=["x"]))
    for i in range(3000):
        if i % 2:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
        else:  # mutate a valid message: the nastier case
            buf = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                buf[rng.randrange(len(buf))] = rng.getrandbits(8)
            data = bytes(buf)
        try:
            decode(data)
        except RemoteProtocolError:
            pass


def test_oversized_input_refused_before_parsing():
    with pytest.raises(RemoteProtocolError, match="oversized"):
        decode(b"\x00" * (MAX_FRAME + 1))
    with pytest.raises(RemoteProtocolError, match="oversized"):
        decode(msgpack.packb({"t": "test.sample", "v": 1, "name": "a" * 100, "count": 1}), max_size=50)


def test_encoding_an_invalid_message_is_a_local_bug():
    with pytest.raises(LocalProtocolError):
        encode(Sample(name="too long a name", count=1))


@register
@dataclass(frozen=True)
class Bulk(Message):
    TYPE: ClassVar[str] = "test.bulk"
    n: int = bounded(min=0, max=10)
    data: bytes = bounded(max_len=1 << 20)


@pytest.mark.parametrize("size", [0, 1, 255, 256, 4095, 4096, 65535, 65536, 1 << 20])
def test_a_long_trailing_bytes_field_is_framed_as_a_part_of_its_own(size):
    """The parts join to exactly the frame msgpack would give (so a peer cannot tell), and a value
    of SPLIT_BYTES or more is the very object passed in, not a copy."""
    blob = random.Random(size).randbytes(size)
    msg = Bulk(n=3, data=blob)
    parts = frame_parts(msg)
    body = pack(msg.to_wire())
    assert b"".join(parts) == len(body).to_bytes(4, "big") + body == frame_of(msg)
    assert decode(b"".join(parts)[4:]) == msg
    assert (parts[-1] is blob) == (size >= 4096) and len(parts) == (2 if size >= 4096 else 1)


@pytest.mark.parametrize("size", [0, 4095, 4096, 65535, 65536, 1 << 20])
def test_a_long_trailing_bytes_field_is_decoded_as_a_view_of_the_frame(size):
    """Asked for views, decode returns the block as a window on the frame it came in (a downloader
    copied each 1 MiB block out of its frame once more, in msgpack); short values and types not
    asked for are bytes, as before, and every message is the one sent."""
    msg = Bulk(n=3, data=random.Random(size).randbytes(size))
    body = frame_of(msg)[4:]
    viewed = decode(body, views=(Bulk,))
    assert viewed == msg == decode(body) == decode(body, views=(Sample,))
    assert type(decode(body).data) is bytes and type(decode(body, views=(Sample,)).data) is bytes
    if size >= 4096:
        assert type(viewed.data) is memoryview and viewed.data.obj is body and viewed.data.readonly
    else:
        assert type(viewed.data) is bytes


def _mutations(body: bytes, rnd: random.Random) -> list[bytes]:
    """Frames a peer could send instead of ``body``: cut, grown, or with bytes changed near the
    fields or the bin header (where a shortcut could misread the layout)."""
    out = [body[:-1], body + b"\x00", body[:len(body) // 2]]
    for _ in range(8):
        b = bytearray(body)
        for _ in range(rnd.randint(1, 3)):
            b[rnd.randrange(min(len(b), 80))] = rnd.randrange(256)
        out.append(bytes(b))
    return out


_PLAIN = st.one_of(st.integers(-2**40, 2**40), st.text(max_size=6), st.binary(max_size=6), st.booleans(), st.none())
_LONG = st.tuples(st.integers(4096, 20_000), st.binary(min_size=1, max_size=4)).map(lambda t: t[1] * t[0])
_TAIL = st.one_of(_LONG, _LONG, st.integers(0, 4095).map(bytes), st.text(min_size=4096, max_size=4100), _PLAIN,
                  st.lists(_PLAIN, max_size=3))


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    st.lists(st.tuples(st.sampled_from(["t", "v", "n", "data", "x", 7, b"k"]), _PLAIN), max_size=5),
    st.sampled_from(["data", "n", "t", 3]),
    _TAIL,
    st.integers(0, 2**32),
)
def test_a_view_of_the_tail_is_only_a_shortcut_of_the_whole_parse(pairs, last_key, last_value, seed):
    """Whatever a peer sends (repeated keys, keys that are not strings, the long value not last
    or not bytes, a map that claims more pairs than it has, cut or grown frames, changed bytes):
    decode with views gives the message decode gives, or the same refusal. A misread layout would
    hand the picker and the hash check bytes the sender never framed as the block."""
    rnd = random.Random(seed)
    head = {"t": "test.bulk", "v": 1} if rnd.random() < 0.7 else {}
    wire = {**head, **dict(pairs[:rnd.randint(0, len(pairs))]), last_key: last_value}
    if rnd.random() < 0.3:
        items = list(wire.items())
        rnd.shuffle(items)
        wire = dict(items)
    try:
        body = pack(wire)
    except (TypeError, ValueError):
        return
    for frame in [body, *_mutations(body, rnd)]:
        assert _outcome(frame, views=(Bulk,)) == _outcome(frame)
        view = unpack_viewing_tail(frame)
        if view is not None:
            assert view == msgpack.unpackb(frame, raw=False)


def _outcome(frame: bytes, **kwargs):
    try:
        msg = decode(frame, **kwargs)
    except RemoteProtocolError as e:
        return ("refused", e.reason)
    return ("message", msg)


def test_a_tail_view_needs_the_whole_layout_it_reads():
    """The layouts the shortcut declines, each parsed whole instead: a str decoy where the bin
    header would be, a repeated key whose first value was the long one, and fields longer than
    what it reads ahead."""
    big = b"z" * 5000
    decoy = pack({"t": "test.bulk", "v": 1, "n": 1, "data": "\xc6" * 4096})
    assert unpack_viewing_tail(decoy) is None
    assert _outcome(decoy, views=(Bulk,)) == _outcome(decoy) == ("refused", "bad-field")
    twice = msgpack.packb({"t": "test.bulk", "v": 1, "n": 1}, use_bin_type=True)
    twice = bytes([0x85]) + twice[1:] + pack("data") + pack(big) + pack("data") + pack(b"short")
    assert decode(twice, views=(Bulk,)).data == b"short" == decode(twice).data
    long_fields = pack({"t": "test.bulk", "v": 1, "pad": "p" * 300, "data": big})
    assert unpack_viewing_tail(long_fields) is None
    empty_then_bin = pack({}) + pack(big)  # no pair to hold the value: garbage, whole or not
    assert unpack_viewing_tail(empty_then_bin) is None
    assert _outcome(empty_then_bin, views=(Bulk,)) == _outcome(empty_then_bin) == ("refused", "malformed")


async def test_write_parts_joins_them_for_a_stream_that_cannot_take_parts():
    class Collect:
        def __init__(self):
            self.writes = []

        async def write(self, b):
            self.writes.append(b)

    sink = Collect()
    await write_parts(sink, [b"ab", memoryview(b"cd"), bytearray(b"e")])
    assert sink.writes == [b"abcde"] and type(sink.writes[0]) is bytes


def test_framing_parts_still_checks_the_message():
    with pytest.raises(LocalProtocolError):
        frame_parts(Bulk(n=11, data=b"x" * 5000))
    with pytest.raises(LocalProtocolError):
        frame_parts(Bulk(n=1, data=b"x" * ((1 << 20) + 1)))


def test_envelope_signature_and_domain():
    alice, mallory = Identity.generate(), Identity.generate()
    env = seal(alice, "greeting", Sample(name="hi", count=1))
    assert decode_as(Envelope, encode(env)).open_as("greeting", Sample) == Sample(name="hi", count=1)
    with pytest.raises(RemoteProtocolError, match="wrong-domain"):
        env.open("ledger-entry")  # a signature for one kind cannot be replayed as another
    forged = Envelope(domain=env.domain, payload=env.payload, public_key=mallory.public_bytes, signature=env.signature)
    with pytest.raises(RemoteProtocolError, match="bad-signature"):
        forged.open("greeting")
    tampered = Envelope(domain=env.domain, payload=env.payload + b"\x00", public_key=env.public_key, signature=env.signature)
    with pytest.raises(RemoteProtocolError, match="bad-signature"):
        tampered.open("greeting")
    with pytest.raises(RemoteProtocolError, match="bad-length"):
        decode(pack({**env.to_wire(), "public_key": b"short"}))


async def test_frames_over_a_stream():
    left, right = trio.testing.memory_stream_pair()

    class Adapter:  # trio streams use receive_some/send_all; libp2p streams read/write
        def __init__(self, s):
            self.s = s

        async def read(self, n=None):
            return await self.s.receive_some(n)

        async def write(self, b):
            await self.s.send_all(b)

    a, b = Adapter(left), Adapter(right)
    await write_frame(a, Sample(name="one", count=1))
    await write_frame(a, b"")
    assert await read_message(b) == Sample(name="one", count=1)
    assert await read_frame(b) == b""
    await left.send_all((MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(RemoteProtocolError, match="oversized"):
        await read_frame(b)
    await left.send_all((10).to_bytes(4, "big") + b"abc")
    await left.aclose()
    with pytest.raises(RemoteProtocolError, match="truncated"):
        await read_frame(b)

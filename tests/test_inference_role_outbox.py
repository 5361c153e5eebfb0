"""The inference role's outbox (pure: bounded queue, trainer choice, retries, backoff, staleness) and
one submission against fake streams on trio's fake clock."""

from __future__ import annotations

import math

import pytest
import trio

from node.rollouts.config import WorkerConfig
from node.rollouts.schema import RolloutAck
from node.inference.outbox import BatchState, Outbox, Pending, alive_trainers
from node.inference.submit import SubmitFailure, call_submit
from node.net.failure import FailureKind
from node.wire import LocalProtocolError, encode


def item(n: int, version: int = 0, now: float = 0.0) -> Pending:
    return Pending(batch_id=bytes([n]) * 32, envelope=b"x", policy_version=version, num_samples=4, created_at=now)


def ack(p: Pending, accepted: bool = True, reason: str = "", step: int = 0) -> RolloutAck:
    return RolloutAck(batch_id=p.batch_id, accepted=accepted, reason=reason, trainer_step=step)


def outbox(capacity: int = 4, attempts: int = 3, async_level: int = 2) -> Outbox:
    return Outbox(capacity, max_attempts=attempts, backoff=1.0, backoff_max=8.0, async_level=async_level)


def test_capacity_bounds_the_queue_and_frees_on_delivery():
    ob = outbox(capacity=2)
    a, b, c = item(1), item(2), item(3)
    assert ob.offer(a) and ob.offer(b)
    assert ob.full and not ob.offer(c)
    assert not ob.offer(item(1))  # already known
    got, trainer = ob.take(["T"], 0.0)
    assert got is a and got.state is BatchState.IN_FLIGHT
    assert ob.on_ack(a.batch_id, trainer, ack(a), 0.1).state is BatchState.ACCEPTED
    assert not ob.full and ob.offer(c)
    assert [p.batch_id[0] for p in ob.pending()] == [2, 3]


def test_oldest_first_and_one_flight_per_batch():
    ob = outbox()
    a, b = item(1), item(2)
    ob.offer(a)
    ob.offer(b)
    assert ob.take(["T"], 0)[0] is a
    assert ob.take(["T"], 0)[0] is b  # a is in flight, not offered twice
    assert ob.take(["T"], 0) is None


def test_failure_backs_the_trainer_off_and_retries_on_another():
    ob = outbox()
    a = item(1)
    ob.offer(a)
    _, t1 = ob.take(["T1", "T2"], 0.0)
    out = ob.on_failure(a.batch_id, t1, FailureKind.UNREACHABLE, 10.0)
    assert (out.state, out.reason) == (BatchState.QUEUED, "unreachable")
    assert ob.blocked_until(t1) == 11.0  # first backoff: 1 s
    again, t2 = ob.take(["T1", "T2"], 10.0)
    assert again is a and t2 != t1
    assert a.tried == [t1, t2]


def test_backoff_doubles_is_capped_and_resets_on_ack():
    ob = outbox(attempts=100)
    a = item(1)
    ob.offer(a)
    now = 0.0
    waits = []
    for _ in range(6):
        _, t = ob.take(["T"], now)
        ob.on_failure(a.batch_id, t, FailureKind.TIMEOUT, now)
        waits.append(ob.blocked_until("T") - now)
        assert ob.take(["T"], now) is None  # the only trainer is backed off
        assert ob.next_wakeup(["T"], now) == ob.blocked_until("T")
        now = ob.blocked_until("T")
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    _, t = ob.take(["T"], now)
    ob.on_ack(a.batch_id, t, ack(a), now)
    assert ob.backoff_of("T") == 0.0 and ob.blocked_until("T") == 0.0


def test_batch_dropped_after_max_attempts():
    ob = outbox(attempts=3)
    a = item(1)
    ob.offer(a)
    outcomes = []
    now = 0.0
    for _ in range(3):
        now = ob.next_wakeup(["T1", "T2"], now)
        _, t = ob.take(["T1", "T2"], now)
        outcomes.append(ob.on_failure(a.batch_id, t, FailureKind.STREAM, now).reason)
    assert outcomes == ["stream", "stream", "undeliverable"]
    assert a.state is BatchState.DROPPED and len(ob) == 0


def test_unreachable_trainers_cost_no_attempts():
    """With no trainer reachable the batch waits (backpressure), it is not thrown away."""
    ob = outbox(attempts=2)
    a = item(1)
    ob.offer(a)
    now = 0.0
    for _ in range(10):
        now = ob.next_wakeup(["T"], now)
        _, t = ob.take(["T"], now)
        assert ob.on_failure(a.batch_id, t, FailureKind.UNREACHABLE, now).state is BatchState.QUEUED
    assert a.attempts == 0 and len(ob) == 1


def test_final_refusal_is_not_retried_transient_is():
    ob = outbox()
    a, b = item(1), item(2)
    ob.offer(a)
    ob.offer(b)
    _, t = ob.take(["T"], 0)
    out = ob.on_ack(a.batch_id, t, ack(a, False, "wrong_task"), 0)
    assert (out.state, out.reason) == (BatchState.REFUSED, "wrong_task")
    assert ob.backoff_of("T") == 0.0  # a sensible refusal says the trainer is alive
    _, t = ob.take(["T"], 0)
    out = ob.on_ack(b.batch_id, t, ack(b, False, "busy"), 0)
    assert (out.state, out.reason) == (BatchState.QUEUED, "busy")
    assert ob.blocked_until("T") == 1.0
    assert ob.take(["T"], 0.5) is None and ob.take(["T"], 1.0)[0] is b


def test_stale_batches_are_dropped_not_sent():
    ob = outbox(async_level=2)
    old, mid, new = item(1, version=0), item(2, version=3), item(3, version=5)
    for p in (old, mid, new):
        ob.offer(p)
    dropped = ob.observe_version(5)  # floor = 3
    assert dropped == [old] and old.state is BatchState.DROPPED
    _, t = ob.take(["T"], 0)  # mid in flight
    # The trainer says it is at step 6: floor 4; mid (v3) is in flight, new (v5) stays.
    out = ob.on_ack(mid.batch_id, t, ack(mid, False, "busy", step=6), 0)
    assert (out.state, out.reason) == (BatchState.DROPPED, "stale")
    assert [p.batch_id[0] for p in ob.pending()] == [3]
    assert ob.is_stale(3) and not ob.is_stale(4)


def test_load_spreads_over_healthy_trainers():
    ob = outbox(capacity=8)
    for n in range(6):
        ob.offer(item(n))
    used = []
    for _ in range(6):
        p, t = ob.take(["A", "B", "C"], 0)
        ob.on_ack(p.batch_id, t, ack(p), 0)
        used.append(t)
    assert sorted(used) == ["A", "A", "B", "B", "C", "C"]


def test_results_for_unknown_batches_are_our_bug():
    ob = outbox()
    a = item(1)
    with pytest.raises(LocalProtocolError):
        ob.on_failure(a.batch_id, "T", FailureKind.TIMEOUT, 0)
    ob.offer(a)
    with pytest.raises(LocalProtocolError):  # queued, not in flight
        ob.on_ack(a.batch_id, "T", ack(a), 0)


def test_no_trainer_no_send_and_wakeup_is_infinite():
    ob = outbox()
    ob.offer(item(1))
    assert ob.take([], 0) is None
    assert ob.next_wakeup([], 0) == math.inf
    assert ob.next_wakeup(["T"], 3.0) == 3.0


def test_alive_trainers_filters_by_run_and_liveness():
    members = {"T1": "trainer", "T2": "relay", "X": "trainer", "me": "inference"}
    assert alive_trainers(members, ["T1", "T2", "T3", "me"], "me") == ["T1", "T2"]


def test_worker_config_validation():
    WorkerConfig().validate()
    for bad in ({"max_pending_batches": 0}, {"cheat": "lie"}, {"backoff_s": 5, "backoff_max_s": 1},
                {"max_batch_bytes": 8 * 1024 * 1024}):
        with pytest.raises(ValueError):
            WorkerConfig(**bad).validate()


# --------------------------------------------------------------------------------------------
# call_submit against fake streams, on trio's fake clock


class FakeStream:
    """A stream that records what was written and answers with ``reply`` (bytes), or never."""

    def __init__(self, reply: bytes | None) -> None:
        self.reply = reply
        self.written = b""
        self.closed = False

    async def write(self, data: bytes) -> None:
        self.written += data

    async def read(self, n: int | None = None) -> bytes:
        if self.reply is None:
            await trio.sleep_forever()
        out, self.reply = self.reply[:n], self.reply[n:]
        return out

    async def close(self) -> None:
        self.closed = True


class FakeHost:
    def __init__(self, stream: FakeStream | None) -> None:
        self.stream = stream

    async def open_stream(self, peer: str, protocol: str) -> FakeStream:
        if self.stream is None:
            raise ConnectionError("no route")
        return self.stream


def framed(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


BID = b"\x07" * 32


async def test_call_submit_returns_the_ack_and_closes():
    stream = FakeStream(framed(encode(RolloutAck(batch_id=BID, accepted=True, trainer_step=4))))
    ack = await call_submit(FakeHost(stream), "T", BID, b"batch", timeout=5)
    assert ack.accepted and ack.trainer_step == 4
    assert stream.written == framed(b"batch") and stream.closed


@pytest.mark.parametrize("reply,kind", [
    (None, "timeout"),  # the trainer never answers
    (b"", "stream"),  # EOF before the ack
    (framed(b"\xc1garbage"), "garbage"),  # not a message
    (framed(encode(RolloutAck(batch_id=b"\x08" * 32, accepted=True))), "garbage"),  # another batch's ack
    ((10**6).to_bytes(4, "big"), "garbage"),  # an absurd frame length
])
async def test_call_submit_failures_name_their_kind(reply, kind, autojump_clock):
    start = trio.current_time()
    with pytest.raises(SubmitFailure) as err:
        await call_submit(FakeHost(FakeStream(reply)), "T", BID, b"batch", timeout=7)
    assert err.value.kind.value == kind
    # Only the silent trainer costs the whole deadline, exactly; every other failure is immediate.
    assert trio.current_time() - start == (7 if kind == "timeout" else 0)


async def test_call_submit_unreachable():
    with pytest.raises(SubmitFailure) as err:
        await call_submit(FakeHost(None), "T", BID, b"batch", timeout=5)
    assert err.value.kind is FailureKind.UNREACHABLE


def paced(p: Pending, accepted: bool, reason: str = "", wait_ms: int = 0) -> RolloutAck:
    return RolloutAck(batch_id=p.batch_id, accepted=accepted, reason=reason, retry_after_ms=wait_ms)


def test_busy_with_a_wait_keeps_the_batch_and_costs_no_attempt():
    """Issue 15: a busy trainer does not burn the batch; it is resubmitted after the wait, still fresh."""
    ob = outbox(attempts=1)  # one counted attempt would drop it
    a = item(1)
    ob.offer(a)
    for k in range(5):
        now = 10.0 * k
        got, t = ob.take(["T"], now)
        out = ob.on_ack(a.batch_id, t, paced(a, False, "busy", wait_ms=3000), now)
        assert (out.state, out.reason) == (BatchState.QUEUED, "busy") and a.attempts == 0
        assert ob.take(["T"], now + 2.9) is None  # the trainer said when
    got, t = ob.take(["T"], 53.0)
    assert got is a and ob.on_ack(a.batch_id, t, paced(a, True), 53.0).state is BatchState.ACCEPTED


def test_a_busy_batch_that_went_stale_meanwhile_is_dropped_not_resent():
    ob = outbox()
    a = item(1, version=0)
    ob.offer(a)
    _, t = ob.take(["T"], 0.0)
    out = ob.on_ack(a.batch_id, t, RolloutAck(batch_id=a.batch_id, accepted=False, reason="busy",
                                              trainer_step=3, retry_after_ms=1000), 0.0)
    assert (out.state, out.reason) == (BatchState.DROPPED, "stale")


def test_an_ack_with_a_wait_holds_generation_until_the_earliest_trainer_is_free():
    ob = outbox()
    a, b = item(1), item(2)
    ob.offer(a)
    ob.offer(b)
    assert ob.generation_hold(["T", "U"], 0.0) == 0.0
    _, t = ob.take(["T"], 0.0)
    ob.on_ack(a.batch_id, t, paced(a, True, wait_ms=4000), 0.0)
    assert ob.generation_hold(["T"], 0.0) == 4.0  # the only trainer asked for 4 s
    assert ob.generation_hold(["T", "U"], 0.0) == 0.0  # another trainer takes work now
    _, u = ob.take(["U"], 0.0)
    ob.on_ack(b.batch_id, u, paced(b, True, wait_ms=2000), 0.0)
    assert ob.generation_hold(["T", "U"], 1.0) == 2.0 and ob.generation_hold(["T", "U"], 5.0) == 5.0
    c = item(3)
    ob.offer(c)
    assert ob.take(["T"], 0.5)[0] is c  # a batch already made is still sent: holding it would only age it


def test_a_trainer_cannot_park_a_worker_beyond_its_backoff_cap():
    ob = outbox()  # backoff_max 8 s
    a = item(1)
    ob.offer(a)
    _, t = ob.take(["T"], 0.0)
    ob.on_ack(a.batch_id, t, paced(a, True, wait_ms=3_600_000), 0.0)
    assert ob.generation_hold(["T"], 0.0) == 8.0


def test_generation_does_not_start_from_the_oldest_version_the_trainer_still_takes():
    ob = outbox(async_level=2)
    ob.observe_version(5)
    assert not ob.is_stale(3) and ob.too_old_to_start(3)  # fresh now, refused after one more trainer step
    assert not ob.too_old_to_start(4)
    sync = outbox(async_level=0)
    sync.observe_version(5)
    assert not sync.too_old_to_start(5) and sync.too_old_to_start(4)


def test_a_trainer_back_in_the_member_table_is_tried_at_once():
    """A trainer that left the member table and came back is a new process: the backoff its
    failures built up while it was still listed (dead, not yet declared so) says nothing about it.
    One that stayed listed keeps its backoff. (In issue 45's hour soak the workers' backoffs
    started fresh at the trainer's revival; their 47-72 s waits were py-libp2p's negative dial
    cache, tests/test_redial_restarted.py.)"""
    ob = Outbox(4, max_attempts=3, backoff=1.0, backoff_max=30.0, async_level=2)
    a = item(1)
    ob.offer(a)
    now = 0.0
    for _ in range(6):  # 1, 2, 4, 8, 16, 30 s
        now = ob.next_wakeup(["T"], now)
        _, t = ob.take(["T"], now)
        ob.on_failure(a.batch_id, t, FailureKind.UNREACHABLE, now)
    assert ob.blocked_until("T") == now + 30.0
    assert ob.take(["T"], now + 1.0) is None  # still in the table: still backed off
    assert ob.take([], now + 2.0) is None  # declared dead
    got = ob.take(["T"], now + 3.0)  # alive again (its start record)
    assert got is not None and got[1] == "T"
    ob.on_failure(a.batch_id, "T", FailureKind.UNREACHABLE, now + 3.0)  # not serving yet: back off anew, from 1 s
    assert ob.blocked_until("T") == now + 4.0

"""A crowd of fake ``public`` member records against a download's direct-peer dial (review of
issue 46; node/shards/peering.py, :class:`DialBook`, says why).

The attacker's cost: a key pair and a signed record per fake, claiming ``public``, its address a
black hole (a dial that never answers costs us a dial slot for ``DIAL_TIMEOUT``). Before, every
fake was dialled again 30 s after its last dial, its dial counted toward ``max_peers``, and an
honest member was one random draw among the fakes at every dial: the crowd held every slot, and a
member whose connection membership pruned was lost in the crowd again.

The download here is the real :class:`Download` choosing and dialling on trio's virtual clock; its
host is a stand-in: honest members answer a dial, fakes never do.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable

import trio

from node.shards.client import DIAL_TIMEOUT, RESCAN_INTERVAL
from node.shards.peering import (
    DIAL_AGAIN_AFTER,
    MAX_DIAL_BACKOFF,
    MEMBERS_REFRESH,
    SPECULATIVE_LOOKS,
    SPECULATIVE_SLOTS,
    DialBook,
    direct_addrs,
)
from node.shards.testing import StaticMembers

from test_shards_sessions import fake_download


class Net:
    """The host a download sees: its direct peers, peers it holds a relay circuit to, and dials
    that reach an honest member in 0.1 s and hang on any other (a black hole)."""

    def __init__(self, direct: set[str], circuit: set[str], honest: set[str]) -> None:
        self.direct, self.circuit, self.honest = direct, circuit, honest
        self.dials: Counter[str] = Counter()
        self.hanging = 0  # dials of fakes in flight
        self.most_hanging = 0

    def direct_peers(self) -> list[str]:
        return sorted(self.direct)

    def connected_peers(self) -> list[str]:
        return sorted(self.direct | self.circuit)

    async def connect_direct(self, peer: str, addrs: list[str]) -> None:
        self.dials[peer] += 1
        if peer in self.honest:
            await trio.sleep(0.1)
            self.direct.add(peer)
            return
        self.hanging += 1
        self.most_hanging = max(self.most_hanging, self.hanging)
        try:
            await trio.sleep_forever()
        finally:
            self.hanging -= 1

    async def open_stream(self, peer: str, protocol: str):
        raise OSError("no transfer sessions here: only the dials are looked at")


def crowd(fakes: int, honest: list[str]) -> dict[str, tuple[str, list[str]]]:
    records = {f"fake{i:04d}": ("public", [f"/ip4/10.66.{i // 250}.{i % 250}/tcp/4001"]) for i in range(fakes)}
    return records | {p: ("public", [f"/ip4/10.1.0.{k}/tcp/4001"]) for k, p in enumerate(honest)}


async def run_download(dl, net: Net, until: float,
                       at: dict[float, Callable[[], None]] | None = None) -> dict[str, float]:
    """Rescan every RESCAN_INTERVAL until ``until`` (virtual seconds), calling ``at[t]`` at ``t``;
    returns when each peer first became direct."""
    dl.owner.host = net
    first_direct: dict[str, float] = {}
    at = dict(at or {})
    async with trio.open_nursery() as nursery:
        dl._nursery = nursery
        while (now := trio.current_time()) < until:
            for t, fn in list(at.items()):
                if now >= t:
                    fn()
                    del at[t]
            dl._connect_new(now)
            for p in net.direct:
                first_direct.setdefault(p, now)
            await trio.sleep(RESCAN_INTERVAL)
        nursery.cancel_scope.cancel()
    return first_direct


async def test_a_crowd_of_fake_public_records_does_not_keep_a_download_from_members_with_evidence(autojump_clock):
    """200 fakes. A member we hold a relay circuit to (it exists: it holds its key and answered)
    is dialled at the first rescan, and a member whose direct connection membership pruned is
    dialled back at the next one: evidence first, their dials not held up by the fakes'. Before,
    each was one draw among 200 fakes at each free slot."""
    honest = ["h-circuit", "h-pruned", "h-record"]
    records = crowd(200, honest)
    net = Net({"origin", "h-pruned"}, {"h-circuit"}, set(honest))
    dl = fake_download([], "origin", max_peers=4, rng_seed=1)
    dl.owner.members = StaticMembers(records)
    pruned_at = 100.0
    reached = await run_download(dl, net, 200.0, {pruned_at: lambda: net.direct.discard("h-pruned")})
    assert reached["h-circuit"] <= RESCAN_INTERVAL
    assert "h-pruned" in net.direct and net.dials["h-pruned"] == 1  # dialled back once, after the prune
    assert net.most_hanging <= SPECULATIVE_SLOTS, "dials of fakes in flight are capped"


async def test_a_fake_public_record_costs_a_dial_that_fails_fewer_times_each_hour(autojump_clock):
    """20 fakes and one honest member known by its record alone: the honest one is found within a
    sweep of the crowd (a draw without replacement), and a fake is dialled again only after a
    back-off that doubles at each failure: at most 1 + log2(MAX_DIAL_BACKOFF / DIAL_AGAIN_AFTER)
    times an hour (7), where before each was dialled every 30 s a free slot allowed (~50 times)."""
    records = crowd(20, ["honest"])
    net = Net({"origin"}, set(), {"honest"})
    dl = fake_download([], "origin", max_peers=4, rng_seed=2)
    dl.owner.members = StaticMembers(records)
    hour = 3600.0
    reached = await run_download(dl, net, hour)
    sweep = math.ceil(len(records) / SPECULATIVE_SLOTS) * (DIAL_TIMEOUT + RESCAN_INTERVAL)
    assert reached["honest"] <= sweep + MEMBERS_REFRESH, reached["honest"]
    most = max(n for p, n in net.dials.items() if p.startswith("fake"))
    assert most <= 1 + math.log2(MAX_DIAL_BACKOFF / DIAL_AGAIN_AFTER), net.dials
    assert net.dials["honest"] == 1  # held ever since


def test_a_rescan_looks_at_a_bounded_number_of_members_however_many_there_are():
    """Issue 46 (review): looking for public members walked every member's record at each rescan
    of a download short of peers: O(N) a second, 10,000 records at N = 10,000. A rescan now looks
    at SPECULATIVE_LOOKS member ids drawn from a snapshot refreshed every MEMBERS_REFRESH s: the
    look-ups per rescan are the same at N = 500 and N = 5,000."""
    rescans = 100
    counts = []
    for n in (500, 5000):
        # Private members: none is dialled, so every rescan looks again.
        members = StaticMembers({f"m{i}": ("private", [f"/ip4/10.0.{i // 250}.{i % 250}/tcp/1"]) for i in range(n)})
        book = DialBook("me")
        for k in range(rescans):
            assert book.to_dial(float(k), ["origin"], ["origin"], members.members,
                                lambda p: direct_addrs(p, members.addrs_of, members.reachability_of),
                                lambda p: True, 4, random.Random(k)) == []
        counts.append(dict(members.calls))
    assert counts[0] == counts[1]
    assert counts[1]["members"] == math.ceil(rescans / MEMBERS_REFRESH)
    assert counts[1]["reachability_of"] == rescans * SPECULATIVE_LOOKS

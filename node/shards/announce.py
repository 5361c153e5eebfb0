"""Checkpoint announcements on ``/swarm/<run>/checkpoints/1`` and the manifest fetch that follows one.

How this works
--------------
A trainer seals an :class:`Announce` (run, version, manifest root, sizes) and publishes it when it
publishes a version, then again every ``announce_interval`` so late joiners learn of it. A topic
validator (:func:`validate_announce`) accepts only announcements signed by a trainer of this run,
so forgeries are neither stored nor forwarded. Followers hear each announcement
(:func:`follow_announcements`) and, when their fetch policy (:func:`fetch_policy`) wants the
version, fetch its manifest over a stream (:func:`fetch_manifest`): first from the announcer, then
from any connected peer, each reply checked against the announced root and the trainers' keys. A
node that knows a newer version exists but heard no announcement of it asks a peer for its newest
manifest instead (:func:`call_newest`, node/shards/catchup.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from libp2p.peer.id import ID

from ..net.reqres import reset
from ..wire import LocalProtocolError, RemoteProtocolError, encode, seal, write_frame
from .catchup import NEWEST
from .config import ShardsConfig
from .manifest import SignedManifest, open_manifest, root_id
from .protocol import (
    ANNOUNCE_DOMAIN,
    FIRST_MESSAGE_TIMEOUT,
    PROTOCOL,
    PROTOCOL_BY_VERSION,
    SOURCE,
    Announce,
    ManifestReply,
    ManifestRequest,
    NewestRequest,
    Reject,
    open_announce,
    read_shards_message,
)
from .store import PieceStore

log = logging.getLogger("node.shards.service")  # announcements log as part of the service

MANIFEST_RETRY = 2.0  # seconds between rounds of asking every connected peer for a manifest


def fetch_policy(cfg: ShardsConfig, role: str) -> str:
    """Which announced versions this node downloads: "all" (relays), "newest", or "none" (trainers)."""
    if cfg.fetch != "auto":
        return cfg.fetch
    return {"relay": "all", "trainer": "none"}.get(role, "newest")


def validate_announce(node, run_name: str, trainers: list[str], msg) -> bool:
    """gossipsub topic validator: a well-formed announcement of this run by one of its trainers,
    published by that trainer itself. Announcements jump every outbound queue and push bulk gossip
    out of a full one (node/net/patches/safety.py UrgentTopics), so a trainer's announcement
    republished by anyone else (a new message id each time, unseen) would let that peer evict ledger
    and membership gossip across the swarm; forwarding keeps the originator, so honest ones pass."""
    try:
        signer = open_announce(msg.data, run_name, trainers).signer
        if ID(msg.from_id).to_base58() != signer:
            raise RemoteProtocolError("not-origin", "announcement published by a peer other than its trainer")
        return True
    except RemoteProtocolError as e:
        node.metrics.reject(node.topic("checkpoints"), e.reason)
        return False


async def announce(node, signed: SignedManifest, delta: tuple[int, bytes] | None = None) -> None:
    """Publish ``signed``'s version on the checkpoints topic (best effort), with the (base version,
    delta manifest root) of its delta when there is one."""
    m = signed.manifest
    base, delta_root = delta if delta is not None else (-1, b"")
    env = seal(node.identity, ANNOUNCE_DOMAIN, Announce(
        run=m.run, version=m.version, root=signed.root, total_size=m.total_size, num_pieces=m.num_pieces,
        delta_root=delta_root, delta_base=base))
    try:
        await node.host.pubsub.publish(node.topic("checkpoints"), encode(env))
    except Exception as e:  # no peers yet, etc.: the next re-announcement will do
        log.debug("shards: announce failed: %s", e)


async def reannounce_loop(node, interval: float, published: Callable[[], SignedManifest | None],
                          delta_of: Callable[[int], tuple[int, bytes] | None] = lambda version: None) -> None:
    """Every ``interval`` seconds, announce the version we published last (if any), with its delta."""
    while True:
        await trio.sleep(interval)
        signed = published()
        if signed is not None:
            await announce(node, signed, delta_of(signed.version))


async def follow_announcements(sub, run_name: str, trainers: list[str],
                               on_announce: Callable[..., None]) -> None:
    """Call ``on_announce(version, root, source, delta)`` for each announcement on subscription
    ``sub``; ``source`` is the peer that forwarded it (who most likely holds the manifest), ``delta``
    the (base version, delta manifest root) the trainer offers, or None."""
    while True:
        msg = await sub.get()
        try:
            sa = open_announce(msg.data, run_name, trainers)
        except RemoteProtocolError:
            continue  # the validator counted it
        a = sa.announce
        source = ID(msg.from_id).to_base58() if msg.from_id else sa.signer
        on_announce(a.version, a.root, source, a.delta)


async def fetch_manifest(node, store: PieceStore, run_name: str, trainers: list[str],
                         is_banned: Callable[[str, float], bool], version: int, root: bytes,
                         source: str) -> SignedManifest:
    """The manifest of ``version`` with root ``root``: saved on disk, else asked of ``source`` and
    then of every connected peer not banned, round after round until one answers correctly."""
    saved = store.saved_manifest(version)
    if saved is not None and saved.root == root:
        return saved
    while True:
        peers = [source] + [p for p in node.host.connected_peers() if p != source]
        for peer in peers:
            if is_banned(peer, trio.current_time()):
                continue
            try:
                with trio.fail_after(FIRST_MESSAGE_TIMEOUT):
                    return await call_manifest(node.host, peer, root, run_name, trainers)
            except RemoteProtocolError as e:
                node.metrics.reject(SOURCE, e.reason)
            except (LocalProtocolError, AssertionError):
                raise
            except Exception as e:  # unreachable peer, timeout, reset
                log.debug("shards: manifest from %s: %s", peer[-8:], e)
        await trio.sleep(MANIFEST_RETRY)


async def call_manifest(host, peer: str, root: bytes, run_name: str, trainers: list[str]) -> SignedManifest:
    """Ask ``peer`` for the manifest with root ``root``; RemoteProtocolError unless it sends that one."""
    return await call_signed(host, peer, root, lambda env: open_manifest(env, run_name, trainers), "manifest")


async def call_signed(host, peer: str, root: bytes, opener, what: str):
    """Ask ``peer`` for the signed ``what`` (a manifest or a delta manifest) with root ``root`` and
    open it with ``opener(envelope)``; RemoteProtocolError unless it sends that one."""
    reply = await _ask(host, peer, ManifestRequest(root=root))
    if isinstance(reply, Reject) or reply is None:
        raise RemoteProtocolError("no-manifest", reply.reason if reply else "eof")
    if root_id(reply.envelope.payload) != root:
        raise RemoteProtocolError("wrong-root", f"{what} does not hash to the announced root")
    return opener(reply.envelope)


async def call_newest(host, peer: str, above: int, run_name: str, trainers: list[str],
                      version: int = NEWEST) -> SignedManifest | None:
    """Ask ``peer`` for the manifest of the newest version it holds, if newer than ``above``, or of
    ``version`` when one is named (node/shards/catchup.py): None when it has none or refuses;
    RemoteProtocolError unless what it sends is a manifest of this run signed by one of its
    trainers (what an announcement proves), newer than ``above`` or of the version named."""
    reply = await _ask(host, peer, NewestRequest(above=above, version=version),
                       PROTOCOL if version == NEWEST else PROTOCOL_BY_VERSION)
    if isinstance(reply, Reject) or reply is None:
        return None
    signed = open_manifest(reply.envelope, run_name, trainers)
    if version != NEWEST and signed.version != version:
        raise RemoteProtocolError("wrong-version", f"v{signed.version} answers a request for v{version}")
    if version == NEWEST and signed.version <= above:
        raise RemoteProtocolError("not-newer", f"v{signed.version} answers a request for one above v{above}")
    return signed


async def _ask(host, peer: str, request, protocol: str = PROTOCOL) -> ManifestReply | Reject | None:
    """One request on a new stream to ``peer``: its reply, a ``ManifestReply`` or a ``Reject`` (None at EOF)."""
    stream = await host.open_stream(peer, protocol)
    try:
        await write_frame(stream, request)
        reply = await read_shards_message(stream)
        if reply is not None and not isinstance(reply, (ManifestReply, Reject)):
            raise RemoteProtocolError("unexpected", reply.TYPE)
        return reply
    finally:
        await reset(stream, shielded=True)

"""Multiaddr checks that do not need the libp2p stack (only the small ``multiaddr`` package)."""

from __future__ import annotations

import multiaddr


class MultiaddrError(ValueError):
    """Not a usable address; the message names the field it came from (config turns it into a ConfigError)."""


def check_multiaddr(text: str, field: str, *, need_peer_id: bool) -> multiaddr.Multiaddr:
    """Parse ``text``; MultiaddrError naming ``field`` when it is not a usable TCP multiaddr."""
    try:
        addr = multiaddr.Multiaddr(text)
    except Exception as e:  # the package raises several private error types
        raise MultiaddrError(f"{field}: {text!r} is not a multiaddr ({e})") from None
    protos = [p.name for p in addr.protocols()]
    if "tcp" not in protos and "p2p-circuit" not in protos:
        raise MultiaddrError(f"{field}: {text!r} has no /tcp/<port> part")
    if need_peer_id and "p2p" not in protos:
        raise MultiaddrError(f"{field}: {text!r} needs a /p2p/<peer id> part")
    return addr

"""The packaged default bootstrap list: ``bootstrap/peers.txt``, linked as ``node/data/bootstrap.txt``."""

from __future__ import annotations

from importlib import resources

from .config import ConfigError, check_addr


def parse_bootstrap_list(text: str, source: str = "bootstrap/peers.txt") -> list[str]:
    """Non-comment lines, each checked to be a full multiaddr with a peer id."""
    peers = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            check_addr(line, f"{source}:{n}", need_peer_id=True)
        except ConfigError:
            raise
        peers.append(line)
    return peers


def read_bootstrap_list() -> list[str]:
    text = resources.files("node").joinpath("data", "bootstrap.txt").read_text()
    return parse_bootstrap_list(text)

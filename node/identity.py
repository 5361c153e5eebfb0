"""Node identity: one Ed25519 key, kept in the data dir, that names the peer and signs its messages.

The peer id is libp2p's: base58btc of the identity multihash of the protobuf-encoded public key
(libp2p peer-id spec, "Inlining keys"). It is computed here without importing libp2p, so the
ledger, proofs and GPU-side code can name peers without the network stack.

The key file holds the 32-byte raw private key in PEM (PKCS#8). It is created with mode 0600 by
an atomic write-then-rename, reused on restart, and never replaced when it is unreadable: losing a
key loses the peer's identity and its ledger history, so a corrupt file is the operator's call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .atomic import write_atomic

log = logging.getLogger("node.identity")

KEY_FILE = "identity.key"
# protobuf PublicKey{Type=Ed25519(1), Data=<32 bytes>} wrapped in an identity multihash (0x00, len 36)
_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


class IdentityError(Exception):
    """The key file is missing, unreadable or not an Ed25519 key (an operator problem)."""


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = _B58[r] + out
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + out


def b58decode(text: str) -> bytes:
    n = 0
    for ch in text:
        idx = _B58.find(ch)
        if idx < 0:
            raise ValueError(f"invalid base58 character {ch!r}")
        n = n * 58 + idx
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    pad = len(text) - len(text.lstrip("1"))
    return b"\0" * pad + body


def peer_id_of(public_key: bytes) -> str:
    """libp2p peer id (string form, "12D3KooW...") of a raw 32-byte Ed25519 public key."""
    if len(public_key) != 32:
        raise ValueError("Ed25519 public key must be 32 bytes")
    return b58encode(_PEER_ID_PREFIX + public_key)


def public_key_of(peer_id: str) -> bytes:
    """Inverse of :func:`peer_id_of`; ValueError for ids that do not inline an Ed25519 key."""
    raw = b58decode(peer_id)
    if len(raw) != 38 or not raw.startswith(_PEER_ID_PREFIX):
        raise ValueError(f"not an Ed25519 peer id: {peer_id[:20]!r}")
    return raw[6:]


def verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
        return True
    except (InvalidSignature, ValueError):
        return False


@dataclass(frozen=True)
class Identity:
    """A node's signing key. ``sign``/``public_bytes`` satisfy :func:`node.wire.seal`."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> "Identity":
        """Deterministic identity (tests, fixtures). ``seed`` must be 32 bytes."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def public_bytes(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def private_bytes(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.public_bytes)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def to_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def make_private_dir(path: Path) -> None:
    """Create ``path`` with mode 0700, or take group and other access away from an existing one."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        try:
            path.chmod(mode & 0o700)
        except OSError as e:  # a read-only mount: say so, never claim a change that did not happen
            log.warning("data dir %s is mode %o and could not be made 700 (%s); it holds the node's key",
                        path, mode, e.strerror or e)
            return
        log.warning("data dir %s was mode %o: now 700 (it holds the node's key)", path, mode)


def load_identity(path: Path) -> Identity:
    """Read a key file; IdentityError with the reason if it cannot be used."""
    try:
        data = path.read_bytes()
        mode = path.stat().st_mode & 0o777
    except OSError as e:
        raise IdentityError(f"cannot read key file {path}: {e.strerror or e}") from None
    if mode & 0o077:  # as ssh does: a key others could read may already be someone else's too
        raise IdentityError(
            f"key file {path} is accessible by other users (mode {mode:o}); "
            f"if that is safe, run: chmod 600 {path}"
        )
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise IdentityError(
            f"key file {path} is corrupt (not a PEM private key); restore it from a backup or "
            "move it away to create a new identity"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"key file {path} does not hold an Ed25519 key")
    return Identity(key)


def save_identity(identity: Identity, path: Path) -> None:
    """Atomically write the key with mode 0600 (refuses to overwrite an existing file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        raise IdentityError(f"refusing to overwrite existing key file {path}")
    write_atomic(path, identity.to_pem(), mode=0o600)


def load_or_create_identity(data_dir: Path) -> tuple[Identity, bool]:
    """The node's identity from ``data_dir``; created on first start. Returns (identity, created).

    The data dir is made private (0700) on the way: it holds the key, the ledger and the spool."""
    make_private_dir(Path(data_dir))
    path = Path(data_dir) / KEY_FILE
    if path.exists():
        return load_identity(path), False
    identity = Identity.generate()
    save_identity(identity, path)
    return identity, True

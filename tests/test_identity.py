"""Identity: created once with mode 0600, reused, never silently replaced; peer ids match libp2p."""

from __future__ import annotations

import stat

import pytest

from node.identity import KEY_FILE, Identity, IdentityError, load_or_create_identity, peer_id_of, public_key_of


def test_created_once_and_reused(tmp_path):
    first, created = load_or_create_identity(tmp_path)
    assert created
    mode = stat.S_IMODE((tmp_path / KEY_FILE).stat().st_mode)
    assert mode == 0o600
    again, created = load_or_create_identity(tmp_path)
    assert not created and again.peer_id == first.peer_id


@pytest.mark.parametrize("content", [b"", b"garbage", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"])
def test_corrupt_key_is_an_error_not_replaced(tmp_path, content):
    (tmp_path / KEY_FILE).write_bytes(content)
    with pytest.raises(IdentityError, match="corrupt"):
        load_or_create_identity(tmp_path)
    assert (tmp_path / KEY_FILE).read_bytes() == content


def test_peer_id_matches_libp2p():
    from libp2p.crypto.ed25519 import Ed25519PrivateKey
    from libp2p.peer.id import ID

    ident = Identity.generate()
    theirs = ID.from_pubkey(Ed25519PrivateKey.from_bytes(ident.private_bytes).get_public_key()).to_base58()
    assert ident.peer_id == theirs
    assert public_key_of(ident.peer_id) == ident.public_bytes
    assert peer_id_of(ident.public_bytes) == ident.peer_id
    with pytest.raises(ValueError):
        public_key_of("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")  # a sha256 (RSA-style) id


def test_a_key_others_can_read_is_refused(tmp_path):
    identity, _ = load_or_create_identity(tmp_path)
    key = tmp_path / KEY_FILE
    key.chmod(0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create_identity(tmp_path)
    key.chmod(0o600)
    assert load_or_create_identity(tmp_path)[0].peer_id == identity.peer_id


def test_the_data_dir_is_private(tmp_path):
    fresh, loose = tmp_path / "fresh" / "node", tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    for d in (fresh, loose):
        load_or_create_identity(d)
        assert d.stat().st_mode & 0o777 == 0o700

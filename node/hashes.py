"""Content ids: one hash for the whole project.

SHA-256, because it is in the standard library (no extra wheel on GPU images), runs at
~1.5-2 GB/s per core with SHA-NI on current x86 and ARMv8 CPUs — faster than the network and disk
it checks — and is what Hugging Face and safetensors tooling already use for file hashes.
"""

from __future__ import annotations

import hashlib

DIGEST_SIZE = 32


def digest(data: bytes | memoryview) -> bytes:
    """The 32-byte content id of ``data``."""
    return hashlib.sha256(data).digest()


def hasher() -> "hashlib._Hash":
    """An incremental hasher of the same algorithm, for data that arrives in parts."""
    return hashlib.sha256()

"""Crash-safe file writes: write a temporary file, fsync it, rename it over the target, fsync the
directory. A reader sees the old content or the new, never a torn mix; after ``durable=True``
returns, the new content survives a power cut (POSIX rename is atomic; the directory fsync makes
the rename itself durable)."""

from __future__ import annotations

import os
from pathlib import Path


class DataDirError(Exception):
    """A file in the data dir cannot be used as it is (damaged, another run's, missing); the message
    says which one and what to do. The CLI prints it as one line instead of a traceback."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, durable: bool = True, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically (``durable``: also fsync file and directory)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)

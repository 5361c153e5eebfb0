"""Where a running node leaves its status for local readers, and how to read it back.

Kept apart from node/status.py (which serves the status protocol and so imports trio and the
libp2p host) so that ``swarm-node status`` and ``swarm-node id`` read these files without
loading the network stack (issue 19: that import was 1.0 s of a 1.4 s command).

A node rewrites status.json every second only while someone reads it: a reader touches
``status.want`` and the node, which looks at that file's age every 0.25 s, writes at once and then
every second until the touch is ``WATCHED_FOR`` seconds old, and every ``IDLE_EVERY`` seconds
otherwise. Building and writing the status was the largest single cost of an idle relay (issue
16: ~2 ms a write on a cold cache, a fifth of its CPU at N=25), paid each second for a file
nobody read.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STATUS_FILE = "status.json"  # every status provider's output (see the module docstring for how often)
NODE_FILE = "node.json"  # peer id, addresses and pid of the running node (for scripts and tests)
WANT_FILE = "status.want"  # touched by readers: its modification time says someone is reading
WATCHED_FOR = 10.0  # seconds after a touch during which the node writes status.json every second
IDLE_EVERY = 10.0  # seconds between writes while nobody reads
FRESH = 1.5  # a status at most this old (wall seconds) is taken as it is by read_status
FRESH_WAIT = 2.5  # how long read_status waits for a fresh one from a running node


def watched(data_dir: Path, now: float) -> bool:
    """Whether a reader touched the want file within the last ``WATCHED_FOR`` seconds."""
    try:
        return now - os.stat(data_dir / WANT_FILE).st_mtime < WATCHED_FOR
    except OSError:
        return False


def want_status(data_dir: Path) -> None:
    """Ask the node for a status each second for a while; a reader without write access reads
    what is there (at most ``IDLE_EVERY`` seconds old)."""
    try:
        (data_dir / WANT_FILE).touch()
    except OSError:
        pass


def node_running(data_dir: Path) -> bool:
    """A node wrote node.json (it removes it when it stops cleanly) and its pid is alive."""
    try:
        pid = int(json.loads((data_dir / NODE_FILE).read_text())["pid"])
        os.kill(pid, 0)
    except PermissionError:
        return True  # someone else's process: alive
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def read_status(data_dir: Path, running: bool | None = None, wait: float = FRESH_WAIT) -> dict:
    """The node's status, at most ``FRESH`` seconds old when the node is running: asks for it and
    waits up to ``wait`` seconds (blocking: async callers pass 0 and poll). Raises OSError /
    ValueError when there is no readable status. ``running`` None: decided from node.json."""
    path = data_dir / STATUS_FILE
    want_status(data_dir)
    if running is None:
        running = node_running(data_dir)
    deadline = time.monotonic() + wait
    while True:
        try:
            status = json.loads(path.read_text())
            if not isinstance(status, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError):
            if not running or time.monotonic() >= deadline:
                raise
            status = None  # mid-rename or not written yet
        if status is not None:
            written = status.get("time")
            fresh = isinstance(written, (int, float)) and time.time() - written <= FRESH
            if fresh or status.get("stopped") or not running or time.monotonic() >= deadline:
                return status
        time.sleep(0.05)

"""How many more files this process may open (issue 42: 1,100 idle connections to the status page
under a 1,024 open-file limit ended the node, EMFILE raised in the gossip tick loop).

Every socket, SQLite journal, piece file and directory listing takes a file descriptor from one
per-process budget (RLIMIT_NOFILE). The status page holds at most its 32 connections (node/web.py);
libp2p connections, which peers open by the hundred, are admitted only while :data:`RESERVE`
descriptors stay free (node/net/host.py), so the node's own work always finds one: short of them,
the node refuses new connections and keeps running.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import resource

RESERVE = 64  # descriptors kept for the node's own work (ledger SQLite, the piece store, its data dir)
# What the kernel answers when the process (EMFILE) or the system (ENFILE) has no descriptor left,
# or no memory for a socket: the same condition trio's serve_listeners retries on.
OUT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_FD_DIR = "/proc/self/fd"


def out_of_files(e: BaseException) -> bool:
    """Whether ``e`` says the process ran out of descriptors (a condition to wait out, not a bug)."""
    return isinstance(e, OSError) and e.errno in OUT_OF_FILES


def headroom() -> int | None:
    """Descriptors this process may still open before its soft limit; None where it cannot tell
    (no /proc, or no limit). Listing /proc/self/fd costs one descriptor and microseconds."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir(_FD_DIR))
    except FileNotFoundError:
        return None
    except OSError as e:
        if out_of_files(e):
            return 0
        raise
    return soft - used


def room_for_remote() -> bool:
    """Whether a connection a remote peer opened may be kept: :data:`RESERVE` descriptors stay free."""
    free = headroom()
    return free is None or free > RESERVE


class Rarely:
    """True at most once per ``every`` seconds: running out of descriptors lasts, and a line per
    refused accept would flood the log (trio's own accept loop logs a traceback every 0.1 s). Also a
    logging filter (by the record's time)."""

    def __init__(self, every: float = 60.0) -> None:
        self.every, self.last = every, -math.inf

    def due(self, now: float) -> bool:
        if now - self.last < self.every:
            return False
        self.last = now
        return True

    def filter(self, record: logging.LogRecord) -> bool:
        return self.due(record.created)


_ACCEPT_LOG = logging.getLogger("trio.serve_listeners")  # trio logs "accept returned EMFILE" here
_accept_log_filter = Rarely()


def quiet_accept_errors() -> None:
    """Let trio's accept-loop error through once a minute (libp2p's listeners use that loop)."""
    if _accept_log_filter not in _ACCEPT_LOG.filters:
        _ACCEPT_LOG.addFilter(_accept_log_filter)

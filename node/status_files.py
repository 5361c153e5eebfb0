"""Where a running node leaves its status for local readers, and how to read it back.

Kept apart from node/status.py (which serves the status protocol and so imports trio and the
libp2p host) so that ``swarm-node status`` and ``swarm-node id`` read these files without
loading the network stack (issue 19: that import was 1.0 s of a 1.4 s command).
"""

from __future__ import annotations

STATUS_FILE = "status.json"  # every status provider's output, rewritten once a second
NODE_FILE = "node.json"  # peer id, addresses and pid of the running node (for scripts and tests)

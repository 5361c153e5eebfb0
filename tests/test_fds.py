"""Running out of file descriptors (issue 42 hole 4): a node that cannot open a file for a while
keeps running and resumes; node/fds.py's pieces."""

from __future__ import annotations

import os
import resource

import pytest

from waiting import wait_until


def test_headroom_counts_this_process_against_its_soft_limit():
    from node import fds

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = fds.headroom()
    r, w = os.pipe()
    try:
        assert fds.headroom() == before - 2
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + fds.RESERVE, hard))
        assert not fds.room_for_remote()  # the reserve is all that is left
        assert fds.out_of_files(OSError(24, "Too many open files")) and not fds.out_of_files(OSError(2, "x"))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        os.close(r)
        os.close(w)
    assert fds.room_for_remote()


@pytest.mark.slow
def test_a_node_with_no_descriptor_left_keeps_running_and_resumes(tmp_path):
    """Every descriptor taken (the soft limit lowered to what the node holds): before, the gossip
    tick's listing of the data dir raised EMFILE and ended the node, and so did the status writer.
    Now both say so once and skip their turn; given descriptors again, the node writes its status."""
    from node.app.localswarm import LocalSwarm
    from node.status_files import STATUS_FILE

    with LocalSwarm(tmp_path) as swarm:
        proc = swarm.start("relay", "relay")
        wait_until(lambda: "membership" in swarm.status("relay"), what="the relay fully started")
        _, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        held = len(os.listdir(f"/proc/{proc.pid}/fd"))
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (held, hard))
        log = proc.log_path

        def said(text: str) -> bool:
            assert proc.alive(), swarm.tail("relay")
            return text in log.read_text()

        wait_until(lambda: said("membership: cannot list the checkpoints held"), what="the tick ran out of descriptors")
        wait_until(lambda: said("status: cannot write"), what="the status writer ran out of descriptors")
        status = proc.data_dir / STATUS_FILE
        starved_at = status.stat().st_mtime_ns
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (held + 256, hard))
        wait_until(lambda: proc.alive() and status.stat().st_mtime_ns > starved_at, what="status written again")
        assert swarm.status("relay")["role"] == "relay"

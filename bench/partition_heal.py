"""How long after a partition heals a node talks to its bootstrap peer again (issue 45).

Real nodes (a relay, ``--others`` more relays, and an inference node that bootstraps from the first)
in one process, in a network namespace of their own: an nftables rule there drops every TCP packet, as the soak's partitions do,
for ``--cut`` seconds; then it is deleted. What is measured: the seconds from the heal until a
libp2p ping from the node to its bootstrap peer, over a connection the node holds, is answered
(no dial of our own: only the node's connection manager dials). Prints one line per run.

With others the node holds more connections across the cut, and probes them one per round.

Needs root, ``ip`` and ``nft``. Run: ``.venv/bin/python bench/partition_heal.py --cut 60 --runs 2 [--others 6]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import trio
from quick import parse_args  # bench/, the script's own folder

NS = "swarmheal"
TABLE = "swarmheal"


def nft(*args: str) -> None:
    subprocess.run(["nft", *args], check=True, capture_output=True)


async def one_run(cut: float, others: int, data: Path) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from swarmtest import node_config, open_nodes  # noqa: E402  (the tests' helpers: real nodes on loopback)

    configs = [node_config(data, f"relay{i}", "relay") for i in range(others + 1)]
    async with open_nodes(configs) as [boot, *rest]:
        cfg = node_config(data, "node", "inference", bootstrap=boot.host.listen_addrs()[:1])
        async with open_nodes([cfg]) as [node]:
            with trio.fail_after(120):
                while not {boot.peer_id, *(r.peer_id for r in rest)} <= set(node.membership.members()):
                    await trio.sleep(0.1)
            nft("add", "table", "inet", TABLE)
            nft("add", "chain", "inet", TABLE, "in", "{ type filter hook input priority 0 ; policy accept ; }")
            nft("add", "rule", "inet", TABLE, "in", "meta", "l4proto", "tcp", "drop")
            try:
                await trio.sleep(cut)
            finally:
                nft("delete", "table", "inet", TABLE)
            healed = trio.current_time()
            with trio.fail_after(600):
                while True:
                    if node.host.is_connected(boot.peer_id):
                        with trio.move_on_after(1.0):
                            try:
                                await node.host.ping(boot.peer_id)
                                return trio.current_time() - healed
                            except Exception:  # noqa: BLE001 — a ping into a dead connection fails: try again
                                pass
                    await trio.sleep(0.2)


def inside(args) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as d:
            took = trio.run(one_run, args.cut, args.others, Path(d))
        print(f"run {i + 1}: {args.others + 2} nodes, partition {args.cut:.0f} s, talking to the bootstrap again {took:.1f} s after the heal",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cut", type=float, default=60.0, help="seconds the partition lasts")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--others", type=int, default=0, help="more relays, all connected to the node across the cut")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parse_args(ap, {"cut": 10.0, "runs": 1})
    if args.inside:
        inside(args)
        return
    if os.geteuid() != 0:
        sys.exit("partition_heal: needs root (a network namespace and an nftables rule)")
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)  # a leftover of a crashed run
    subprocess.run(["ip", "netns", "add", NS], check=True)
    try:
        cmd = ["ip", "netns", "exec", NS, sys.executable, __file__, "--inside", "--cut", str(args.cut),
               "--runs", str(args.runs), "--others", str(args.others)]
        sys.exit(subprocess.run(cmd).returncode)
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


if __name__ == "__main__":
    main()

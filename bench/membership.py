"""Membership at N = 10, 25, 50 real processes on this machine: convergence, detection, load, RSS.

For each N it starts a relay plus N-1 more nodes (each given only the first one's address) and
measures:
  * convergence: from the last node being ready until every node sees every other alive;
  * bytes sent per node per second (all libp2p TCP bytes, i.e. membership + gossipsub control)
    over a steady window;
  * detection: from `kill -9` of one node until every other node marks it dead;
  * peak RSS per process (VmHWM).
Baseline, measured in the same run on the same machine: the naive design where every node
re-broadcasts its record every second (refresh interval pinned to 1 s), the "heartbeat to all"
scheme whose per-node cost grows with N. The load model's projection for N = 1,000 and 10,000 is
printed beside the measured points, with the anchors: SWIM/memberlist (first detection ~1.58
probe periods, constant per-node load) and the Prime protocol (10 s heartbeats, dead after 3
misses: up to ~45 s).

    .venv/bin/python bench/membership.py                # N = 10, 25, 50 (about 10 minutes)
    .venv/bin/python bench/membership.py --sizes 10 --steady 10
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.gossip.membership import MembershipConfig, load_model  # noqa: E402
from node.localswarm import LocalSwarm  # noqa: E402

OURS = "[run]\nname = \"bench\"\n"
NAIVE = OURS + "[membership]\nmin_refresh = 1.0\nmax_refresh = 1.0\n"


def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def traffic(swarm: LocalSwarm, names) -> dict[str, dict]:
    return {n: swarm.status(n).get("traffic", {}) for n in names}


def by_protocol(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Median over nodes of payload bytes/s sent per protocol (what the total is made of)."""
    protos = {p for t in after.values() for p in t.get("stream_bytes_sent", {})}
    out = {}
    for proto in protos:
        rates = [(after[k].get("stream_bytes_sent", {}).get(proto, 0)
                  - before[k].get("stream_bytes_sent", {}).get(proto, 0)) / seconds for k in after]
        out[proto] = statistics.median(rates)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def measure(n: int, run_file: str, steady: float, detect: bool, timeout: float) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"bench-members-{n}-"))
    names = ["relay"] + [f"n{i}" for i in range(1, n)]
    out: dict = {"n": n}
    with LocalSwarm(root, log_level="warning") as swarm:
        swarm.write_run_file(run_file)
        for name in names:
            # All relays: membership is the same in every role, and the ML roles would load torch
            # and a model, which measures something else.
            swarm.start(name, "relay", wait=60)
        ids = {name: swarm.node_info(name)["peer_id"] for name in names}
        t0 = time.monotonic()

        def converged() -> bool:
            for name in names:
                states = swarm.member_states(name)
                if sum(1 for pid in ids.values() if states.get(pid) == "alive") < n - 1:
                    return False
            return True

        swarm.wait_until(converged, timeout, poll=0.5)
        out["converge_s"] = time.monotonic() - t0
        time.sleep(3)  # let the join burst settle before the steady window
        before, tb = traffic(swarm, names), time.monotonic()
        time.sleep(steady)
        after, ta = traffic(swarm, names), time.monotonic()
        sent = {k: (before[k].get("tcp_bytes_sent", 0), after[k].get("tcp_bytes_sent", 0)) for k in names}
        rates = [(a - b) / (ta - tb) for b, a in sent.values() if a and b]
        out["bytes_per_node_s"] = statistics.median(rates) if rates else float("nan")
        out["by_protocol"] = by_protocol(before, after, ta - tb)
        out["rss_mb"] = max(peak_rss_mb(p.pid) for p in swarm.procs.values())
        if detect:
            victim = names[-1]
            swarm.kill(victim, signal.SIGKILL)
            t1 = time.monotonic()
            others = names[:-1]
            swarm.wait_until(
                lambda: all(swarm.member_states(o).get(ids[victim]) == "dead" for o in others), timeout, poll=0.25
            )
            out["detect_s"] = time.monotonic() - t1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10,25,50")
    ap.add_argument("--baseline-sizes", default="10,25,50", help="sizes at which to measure the naive baseline")
    ap.add_argument("--steady", type=float, default=20.0, help="seconds of steady traffic measured")
    ap.add_argument("--timeout", type=float, default=240.0)
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so LocalSwarm reaps the node processes it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [int(x) for x in args.sizes.split(",") if x]
    base_sizes = {int(x) for x in args.baseline_sizes.split(",") if x}
    cfg = MembershipConfig()
    rows = []
    for n in sizes:
        try:
            ours = measure(n, OURS, args.steady, detect=True, timeout=args.timeout)
        except TimeoutError as e:  # a size this machine cannot host: say so and go on
            print(f"N={n}: did not converge within {args.timeout:.0f}s ({e})", file=sys.stderr, flush=True)
            continue
        naive = measure(n, NAIVE, args.steady, detect=False, timeout=args.timeout) if n in base_sizes else None
        rows.append((ours, naive))
        print(f"measured N={n}: {ours} naive={naive}", file=sys.stderr, flush=True)

    print()
    print("Membership, real processes on this machine (probe period 1 s, suspicion 4*max(1,log10 N) s)")
    hdr = f"{'N':>6} {'converge s':>11} {'detect s':>9} {'B/s/node':>9} {'naive B/s':>10} {'naive/ours':>10} {'model B/s':>10} {'RSS MB':>7}"
    print(hdr)
    print("-" * len(hdr))
    for ours, naive in rows:
        model = load_model(ours["n"], cfg)["bytes_per_s"]
        nb = naive["bytes_per_node_s"] if naive else float("nan")
        print(
            f"{ours['n']:>6} {ours['converge_s']:>11.1f} {ours['detect_s']:>9.1f} {ours['bytes_per_node_s']:>9.0f} "
            f"{nb:>10.0f} {nb / ours['bytes_per_node_s']:>10.1f} {model:>10.0f} {ours['rss_mb']:>7.0f}"
        )
    for n in (1_000, 10_000):
        model = load_model(n, cfg)
        timeout = cfg.suspicion_timeout(n)
        print(
            f"{n:>6} {'(model)':>11} {1.58 * cfg.probe_period + timeout:>9.1f} {model['bytes_per_s']:>9.0f} "
            f"{'':>10} {'':>10} {model['bytes_per_s']:>10.0f} {'':>7}"
        )
    print()
    print("Payload bytes/s sent per node by protocol (median over nodes; before Yamux/Noise framing)")
    for ours, _ in rows:
        parts = ", ".join(f"{p} {r:.0f}" for p, r in ours["by_protocol"].items() if r >= 1)
        print(f"  N={ours['n']}: {parts}")
    print()
    print("detect s for the model rows = SWIM's mean first detection (1.58 periods) + suspicion timeout.")
    print("Anchors: SWIM/memberlist first detection ~1.58 probe periods, per-node load constant in N;")
    print("Prime protocol heartbeats: 10 s, dead after 3 misses -> up to ~45 s detection.")
    last_ours, last_naive = rows[-1] if rows else ({}, None)
    if last_naive:
        print(f"ratio naive/ours bytes per node at N={last_ours['n']}: "
              f"{last_naive['bytes_per_node_s'] / last_ours['bytes_per_node_s']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

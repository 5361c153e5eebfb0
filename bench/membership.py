"""Membership at N = 10, 25, 50 real processes on this machine: convergence, detection, load, RSS.

For each N it starts a relay plus N-1 more nodes (each given only the first one's address) and
measures:
  * convergence: from the last node being ready until every node sees every other alive;
  * bytes sent per node per second (all libp2p TCP bytes, i.e. membership + gossipsub control)
    over a steady window: it starts once the connection counts stop changing (probes dial
    members, so connections keep filling in for about N probe periods after convergence) and
    lasts at least one record refresh interval (records refresh in bursts), with the payload
    broken down by protocol;
  * detection: from `kill -9` of one node until every other node marks it dead;
  * peak RSS per process (VmHWM);
  * idle CPU per node: user + system CPU seconds per wall second over the steady window (median).
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
from node.app.localswarm import LocalSwarm  # noqa: E402
from procstat import cpu_seconds  # noqa: E402  (bench/, the script's own folder)
from quick import parse_args  # noqa: E402  (bench/, the script's own folder)

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


def settle_connections(swarm: LocalSwarm, names, timeout: float, every: float = 5.0) -> float:
    """Wait until no node's connection count changed over ``every`` seconds; returns the wait."""
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        now = [swarm.status(n).get("membership", {}).get("connections") for n in names]
        if now == last:
            break
        last = now
        time.sleep(every)
    return time.monotonic() - t0


def measure(n: int, run_file: str, steady: float, detect: bool, timeout: float, stretch: bool = True) -> dict:
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

        try:
            swarm.wait_until(converged, timeout, poll=0.5)
        except TimeoutError:
            seen = {name: sum(1 for pid in ids.values() if swarm.member_states(name).get(pid) == "alive") for name in names}
            behind = {k: v for k, v in seen.items() if v < n - 1}
            raise TimeoutError(f"{len(behind)} of {n} nodes see fewer than {n - 1} alive: {behind}") from None
        out["converge_s"] = time.monotonic() - t0
        # Stable for 5 s (or half a shorter window: a quick run's settle need be no finer than what it measures).
        out["settle_s"] = settle_connections(swarm, names, timeout, every=min(5.0, steady / 2))
        before, tb = traffic(swarm, names), time.monotonic()
        cpu_before = {k: cpu_seconds(swarm.procs[k].pid) for k in names}
        # At least one record refresh interval (records refresh in bursts): 100 s at N = 50.
        window = max(steady, MembershipConfig().refresh_interval(n) + 5) if stretch else steady
        out["window_s"] = window
        time.sleep(window)
        after, ta = traffic(swarm, names), time.monotonic()
        cpu = [(cpu_seconds(swarm.procs[k].pid) - cpu_before[k]) / (ta - tb) for k in names]
        out["cpu_pct"] = 100 * statistics.median([c for c in cpu if c == c] or [float("nan")])
        sent = {k: (before[k].get("tcp_bytes_sent", 0), after[k].get("tcp_bytes_sent", 0)) for k in names}
        rates = [(a - b) / (ta - tb) for b, a in sent.values() if a and b]
        out["bytes_per_node_s"] = statistics.median(rates) if rates else float("nan")
        out["by_protocol"] = by_protocol(before, after, ta - tb)
        meshes = [swarm.status(k).get("membership", {}).get("mesh") for k in names]
        out["mesh"] = statistics.median([m for m in meshes if m is not None] or [float("nan")])
        out["rss_mb"] = max(peak_rss_mb(p.pid) for p in swarm.procs.values())
        if detect:
            victim = names[-1]
            swarm.kill(victim, signal.SIGKILL)
            t1 = time.monotonic()
            others = names[:-1]
            try:
                swarm.wait_until(
                    lambda: all(swarm.member_states(o).get(ids[victim]) == "dead" for o in others), timeout, poll=0.25
                )
                out["detect_s"] = time.monotonic() - t1
            except TimeoutError:
                out["detect_s"] = float("nan")  # printed as nan: not every node marked it dead in time
    return out


def attempt(n: int, run_file: str, args, detect: bool) -> dict:
    """One measurement, or {"failed": why} when this machine cannot host it (that is a result too:
    the naive design stops converging on 2 cores well before ours does)."""
    try:
        return measure(n, run_file, args.steady, detect=detect, timeout=args.timeout, stretch=args.stretch)
    except TimeoutError as e:
        return {"n": n, "failed": f"no convergence in {args.timeout:.0f} s", "error": str(e)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10,25,50")
    ap.add_argument("--baseline-sizes", default="10,25,50", help="sizes at which to measure the naive baseline")
    ap.add_argument("--steady", type=float, default=60.0,
                    help="seconds of steady traffic measured (stretched to one record refresh interval + 5 s)")
    ap.add_argument("--no-stretch", dest="stretch", action="store_false",
                    help="measure --steady seconds as given, even under one record refresh interval (bytes/s then "
                         "miss or catch a refresh burst: coarser)")
    ap.add_argument("--timeout", type=float, default=240.0)
    args = parse_args(ap, {"sizes": "3", "baseline_sizes": "3", "steady": 5.0, "stretch": False, "timeout": 40.0})
    # SIGTERM unwinds like Ctrl-C, so LocalSwarm reaps the node processes it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [int(x) for x in args.sizes.split(",") if x]
    base_sizes = {int(x) for x in args.baseline_sizes.split(",") if x}
    cfg = MembershipConfig()
    rows = []
    for n in sizes:
        ours = attempt(n, OURS, args, detect=True)
        print(f"measured N={n}: {ours}", file=sys.stderr, flush=True)
        naive = attempt(n, NAIVE, args, detect=False) if n in base_sizes else None
        print(f"naive N={n}: {naive}", file=sys.stderr, flush=True)
        rows.append((n, ours, naive))

    print()
    print("Membership, real processes on this machine (probe period 1 s, suspicion 4*max(1,log10 N) s)")
    hdr = (f"{'N':>6} {'converge s':>11} {'settle s':>9} {'detect s':>9} {'TCP B/s':>9} {'payload':>9} "
           f"{'model':>7} {'naive TCP':>10} {'naive/ours':>10} {'RSS MB':>7} {'CPU %':>6}")
    print(hdr)
    print("-" * len(hdr))
    # The model at the mesh degree the swarm really ran at (py-libp2p accepts grafts up to
    # degree_high, so meshes settle above the configured 6); projections use the largest one seen.
    degrees = [ours["mesh"] for _, ours, _ in rows if ours.get("mesh", 0) > 0]
    big_degree = round(max(degrees)) if degrees else 6
    for n, ours, naive in rows:
        mesh = ours.get("mesh", 0)
        model = load_model(n, cfg, degree=round(mesh) if mesh > 0 else big_degree)["bytes_per_s"]
        if naive is None:
            nb = ratio = ""
        elif "failed" in naive:
            nb, ratio = "failed", ""
        else:
            nb = f"{naive['bytes_per_node_s']:.0f}"
            ratio = f"{naive['bytes_per_node_s'] / ours['bytes_per_node_s']:.1f}" if "failed" not in ours else ""
        if "failed" in ours:
            print(f"{n:>6} {'failed: ' + ours['failed']:>59} {model:>7.0f} {nb:>10} {ratio:>10}")
            continue
        payload = sum(ours["by_protocol"].values())
        print(
            f"{n:>6} {ours['converge_s']:>11.1f} {ours['settle_s']:>9.0f} {ours['detect_s']:>9.1f} "
            f"{ours['bytes_per_node_s']:>9.0f} {payload:>9.0f} {model:>7.0f} {nb:>10} {ratio:>10} {ours['rss_mb']:>7.0f}"
            f" {ours.get('cpu_pct', float('nan')):>6.2f}"
        )
    for n in (1_000, 10_000):
        model = load_model(n, cfg, degree=big_degree)
        timeout = cfg.suspicion_timeout(n)
        print(
            f"{n:>6} {'(model)':>11} {'':>9} {1.58 * cfg.probe_period + timeout:>9.1f} {'':>9} {'':>9} "
            f"{model['bytes_per_s']:>7.0f}"
        )
    print()
    print("Payload bytes/s sent per node by protocol (median over nodes; before Yamux/Noise framing)")
    for n, ours, naive in rows:
        for name, res in (("ours", ours), ("naive", naive)):
            if res and "by_protocol" in res:
                parts = ", ".join(f"{p} {r:.0f}" for p, r in res["by_protocol"].items() if r >= 1)
                print(f"  N={n} {name}: {parts}")
    print()
    for n, ours, _ in rows:
        if "mesh" in ours:
            print(f"  N={n}: median gossipsub mesh on the members topic: {ours['mesh']:.0f} peers")
    print(f"model: node/gossip/membership.py load_model at the measured mesh degree ({big_degree} for the projections)")
    print("TCP B/s: all bytes a node writes to its TCP connections (Yamux, Noise, handshakes included);")
    print("payload: the same on libp2p streams before framing, which is what the load model counts.")
    print("CPU %: one node's user + system CPU time per wall second over the steady window (median over nodes).")
    print("detect s for the model rows = SWIM's mean first detection (1.58 periods) + suspicion timeout.")
    print("Anchors: SWIM/memberlist first detection ~1.58 probe periods, per-node load constant in N;")
    print("Prime protocol heartbeats: 10 s, dead after 3 misses -> up to ~45 s detection.")
    # The naive baseline failing to converge is a result; ours failing is a failure (make bench-quick fails on it).
    failed = [n for n, ours, _ in rows if "failed" in ours]
    if failed:
        print(f"bench/membership.py: no convergence at N = {', '.join(map(str, failed))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

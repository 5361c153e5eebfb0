"""The piece picker's CPU per request as checkpoints grow, beside the scan it replaced, same run.

    .venv/bin/python bench/picker.py [--pieces 256,1024,16384] [--peers 8]

A download is simulated on the pure picker (node/shards/picker.py): ``--peers`` peers, one a seed
and the others holding a random half of the pieces, each answering its oldest request 1 ms of
simulated time apart, until every piece is verified. Printed per size: microseconds of CPU per
poll and per request, and the choice of a new piece timed both ways on the same states: from the
bags of unstarted pieces by availability, and as it was made before them (every unstarted piece
the peer holds, sorted, the least available found, the ties listed). A real node polls once per message
that arrives, so these microseconds are paid per wake-up and per piece.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.shards.picker import Picker, PickerParams  # noqa: E402
from quick import parse_args  # noqa: E402  (bench/, the script's own folder)

PIECE = 1 << 20


def scan_choice(p: Picker, pieces: set[int], rng: random.Random) -> int:
    """The choice of a new piece before bags: a scan of every unstarted piece the peer holds."""
    candidates = sorted(p._unstarted & pieces)
    least = min(p.availability[i] for i in candidates)
    return rng.choice([i for i in candidates if p.availability[i] == least])


def run(num_pieces: int, num_peers: int, seed: int = 0) -> tuple[float, float, float, float, int]:
    """(µs per poll, µs per request, µs per choice: ours, the scan's; requests)."""
    rng = random.Random(seed)
    p = Picker([PIECE] * num_pieces, PickerParams(block_size=PIECE), rng=random.Random(seed))
    for k in range(num_peers):
        p.on_bitfield(f"P{k}", set(range(num_pieces)) if k == 0 else
                      {i for i in range(num_pieces) if rng.random() < 0.5})
    t, polls, requests, spent = 0.0, 0, 0, 0.0
    choices, ours, scan = 0, 0.0, 0.0
    sim_rng, side_rng = p.rng, random.Random(seed)
    while not p.complete:
        # Both ways of choosing a new piece, timed on the same state, for every peer that has one
        # (on a side generator, so that the simulated download is the same with or without this).
        if len(p.verified) >= p.params.random_first:
            p.rng = side_rng
            for st in p.peers.values():
                if not st.pieces.isdisjoint(p._unstarted):
                    c0 = time.thread_time()
                    p._rarest_held(st.pieces)
                    c1 = time.thread_time()
                    scan_choice(p, st.pieces, side_rng)
                    ours, scan, choices = ours + c1 - c0, scan + time.thread_time() - c1, choices + 1
            p.rng = sim_rng
        c0 = time.thread_time()
        acts = p.poll(t)
        spent += time.thread_time() - c0
        polls += 1
        requests += len(acts.requests)
        for peer, st in list(p.peers.items()):
            if st.in_flight:
                piece, offset = next(iter(st.in_flight))
                t += 0.001
                kept, _ = p.on_block(peer, piece, offset, PIECE, t)
                if kept and p.piece_ready(piece):
                    p.on_piece_verified(piece, t)
    us = 1e6
    return spent / polls * us, spent / requests * us, ours / choices * us, scan / choices * us, requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pieces", default="256,1024,16384", help="checkpoint sizes, in 1 MiB pieces")
    ap.add_argument("--peers", type=int, default=8)
    args = parse_args(ap, {"pieces": "64,256"})
    print(f"== picker: {args.peers} peers (one seed, the rest holding half each), CPU per request")
    for n in (int(x) for x in args.pieces.split(",")):
        per_poll, per_req, ours, scan = run(n, args.peers)[:4]
        print(f"  {n:6d} pieces: poll {per_poll:6.0f} µs, {per_req:5.0f} µs per request; choosing a new piece "
              f"{ours:5.1f} µs (bags) against {scan:6.1f} µs (the scan it replaced), ratio {scan / ours:.1f}")


if __name__ == "__main__":
    main()

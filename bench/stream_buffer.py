"""A Yamux stream's receive buffer: py-libp2p's bytearray beside StreamChunks, same run.

    .venv/bin/python bench/stream_buffer.py [--standing-mib 0,1,4,7] [--mib 256]

Replays what a downloader's stream buffer goes through in ``bench/shards.py overhead``: DATA
frame bodies of 65,495 bytes come in (one Noise message each, YamuxSends), and the reader takes one
message at a time, its 4-byte length and then its 1 MiB body, with ``--standing-mib`` of unread
frames behind it (counted in that bench: 7-8 MiB for most frames once the window is widened to
the requests in flight). Each buffer is driven with the operations py-libp2p's Yamux code uses:
``extend`` per frame; ``bytes(b[:n])`` then ``del b[:n]`` per read. Printed: CPU milliseconds per
MiB through the buffer for each, and their ratio (StreamChunks / bytearray).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.net.patches.speed import StreamChunks  # noqa: E402
from quick import parse_args  # noqa: E402  (bench/, the script's own folder)

MiB = 1 << 20
FRAME = 65_495  # a DATA frame's body: one Noise message's plaintext less Yamux's 12-byte header
MESSAGE = MiB + 40  # a Data message of one 1 MiB piece, msgpack map included


def drive(buffer, standing: int, total: int, frames: list[bytes]) -> float:
    """CPU-seconds to push ``total`` bytes through ``buffer`` with ``standing`` bytes unread behind the reader."""
    k = 0
    while len(buffer) < standing:
        buffer.extend(frames[k % len(frames)])
        k += 1
    t0, moved = time.process_time(), 0
    while moved < total:
        frame = frames[k % len(frames)]
        buffer.extend(frame)
        k += 1
        moved += len(frame)
        while len(buffer) >= standing + MESSAGE:
            bytes(buffer[:4])
            del buffer[:4]
            bytes(buffer[:MESSAGE - 4])
            del buffer[:MESSAGE - 4]
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--standing-mib", default="0,1,4,7")
    ap.add_argument("--mib", type=int, default=256, help="bytes pushed through each buffer")
    args = parse_args(ap, {"standing_mib": "0,4", "mib": 32})
    # Distinct frames, as a checkpoint's are (one frame sent again and again would stay in the cache).
    frames = [os.urandom(FRAME) for _ in range(256)]
    print(f"{'standing MiB':>12} | {'bytearray ms/MiB':>16} | {'StreamChunks ms/MiB':>19} | ratio")
    for standing in (int(s) for s in args.standing_mib.split(",")):
        old = drive(bytearray(), standing * MiB, args.mib * MiB, frames) / args.mib * 1e3
        new = drive(StreamChunks(), standing * MiB, args.mib * MiB, frames) / args.mib * 1e3
        print(f"{standing:>12} | {old:>16.3f} | {new:>19.3f} | {new / old:.2f}")


if __name__ == "__main__":
    main()

"""Cost of the checks a checkpoint gets at rest: the non-finite scan beside SHA-256 of the same bytes.

    .venv/bin/python bench/finite.py [--size-mib 256]

Every downloader scans a version's safetensors for NaN and infinity once it is assembled, and every
node re-hashes its complete versions at start (node/shards/finite.py, node/shards/service.py). Both
read the whole checkpoint; SHA-256 over the same bytes (the piece check a download already pays) is
the baseline, measured in the same run, from the page cache. The ratio says how the scan compares.
The machine is shared and noisy: compare the ratio, not the absolute figures.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.shards.finite import non_finite_in_file  # noqa: E402
from quick import parse_args  # noqa: E402  (bench/, the script's own folder)


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=256)
    args = parse_args(p, {"size_mib": 16})
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (np.float32, np.float16):
            n = (args.size_mib << 20) // np.dtype(dtype).itemsize
            path = Path(tmp) / "model.safetensors"
            save_file({"w": rng.standard_normal(n, dtype=np.float32).astype(dtype)}, str(path))
            raw = path.read_bytes()  # in the page cache for both
            scan = best_of(3, lambda: non_finite_in_file(path))
            sha = best_of(3, lambda: hashlib.sha256(raw).digest())
            mib = len(raw) / 2**20
            print(f"{np.dtype(dtype).name}: {mib:.0f} MiB  non-finite scan {mib / scan:,.0f} MiB/s  "
                  f"sha256 {mib / sha:,.0f} MiB/s  scan time / sha256 time {scan / sha:.2f}")
            path.unlink()


if __name__ == "__main__":
    main()

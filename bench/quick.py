"""The ``--quick`` flag every benchmark has: the same code path at a size CI runs in under a minute.

``make bench-quick`` runs every script in bench/ with ``--quick`` (tests/test_bench_quick.py checks
that each one has the flag), so a benchmark that stops working fails CI instead of rotting until
someone next runs it. A quick run's figures are printed as usual, beside their baseline, but from
small sizes and few repeats on a busy machine: they say the benchmark works, not how fast anything is.
"""

from __future__ import annotations

import argparse


def parse_args(ap: argparse.ArgumentParser, quick: dict, argv: list[str] | None = None) -> argparse.Namespace:
    """``ap``'s arguments with a ``--quick`` flag added, whose values ``quick`` gives (destination ->
    value); flags given explicitly still win over them."""
    def flag(dest: str, value) -> str:
        name = dest.replace("_", "-")
        if isinstance(value, bool):
            return f"--{name}" if value else f"--no-{name}"
        if isinstance(value, list):  # nargs="+" or action="append": the words as typed, not a Python list
            return f"--{name} {' '.join(map(str, value))}"
        return f"--{name} {value}"

    shown = ", ".join(flag(k, v) for k, v in quick.items())
    ap.add_argument("--quick", action="store_true",
                    help=f"a short run of the same code for CI (make bench-quick), under a minute: {shown or 'as is'}")
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(**quick)
        args = ap.parse_args(argv)
    return args

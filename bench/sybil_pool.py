"""Sybil keys flooding the fresh-identity pool (issue 42, hole 3): an honest newcomer's batches per minute.

A pure simulation of the real QuotaBook (node/rollouts/quota.py ``simulate_flood``): ``n`` fresh keys
send junk back to back and retry at exactly the time the trainer's refusal names; one honest
newcomer, at an address of its own, samples a batch every ``--honest-every`` seconds. Printed per
``n``: the newcomer's fair share (the pool split equally among the ``n + 1`` parties, or what it
wants if less) and its batches taken per minute when

* ``keys``: each Sybil key counts for itself (loopback, where every node has one address), no validator;
* ``keys+fail``: the same with a validator that fails each junk batch ``--fail-after`` s after intake;
* ``new key/try``: each Sybil signs every attempt with a new key, keys counted for themselves
  (the lockout of sharing per key: the baseline of the per-address rule);
* ``1 addr``: the same key-making, all from one address, the pool shared per address;
* ``n addrs``: the same from ``n`` addresses.

The baseline of fixed intervals served first come, first served gave the newcomer 1 of 24 batches
in two minutes against 4 keys.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.rollouts.quota import QuotaConfig, simulate_flood  # noqa: E402
from quick import parse_args  # noqa: E402  (bench/, the script's own folder)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sybils", default="4,16,64", help="comma-separated numbers of flooding keys")
    ap.add_argument("--minutes", type=float, default=30.0, help="simulated minutes per case")
    ap.add_argument("--honest-every", type=float, default=5.0, help="seconds the newcomer takes to sample a batch")
    ap.add_argument("--fail-after", type=float, default=10.0, help="seconds from intake to a junk batch's failed verdict")
    args = parse_args(ap, {"minutes": 2.0}, argv)
    cfg = QuotaConfig()
    wants = cfg.interval_s / args.honest_every
    print(f"pool {cfg.new_total} batches / {cfg.interval_s:.0f} s, newcomer wants {wants:.1f}/min, {args.minutes:g} min each")
    cases = {  # column -> simulate_flood's keywords for n flooding parties
        "keys": lambda n: {}, "keys+fail": lambda n: {"fail_after_s": args.fail_after},
        "new key/try": lambda n: {"key_making": True}, "1 addr": lambda n: {"key_making": True, "origins": 1},
        "n addrs": lambda n: {"key_making": True, "origins": n}}
    print(f"{'sybils':>6} {'fair/min':>9} " + " ".join(f"{name:>11}" for name in cases))
    seconds = args.minutes * cfg.interval_s
    for n in (int(x) for x in args.sybils.split(",")):
        fair = min(wants, cfg.new_total / (n + 1))
        got = [simulate_flood(cfg, n, seconds, args.honest_every, **kw(n)) / args.minutes for kw in cases.values()]
        print(f"{n:>6} {fair:>9.2f} " + " ".join(f"{g:>11.2f}" for g in got))


if __name__ == "__main__":
    main()

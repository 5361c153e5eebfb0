"""``swarm-node penalties``: who was penalised or banned, by whom and why, from the local ledger.

Reads the ledger database of a data dir read-only (safe while the node runs), like ``swarm-node
ledger``, and lists every ``penalty`` entry, the active bans, and failed verdicts per worker and
reason. Penalties and verdicts are replicated to every peer, so any node can answer this.

The run's trainers come from the run file, or else the run.json the data dir's node left (as for
``swarm-node ledger``): a database based on a trainer-signed cut is rebuilt from the cut, which only
they sign. Penalty entries and verdicts at or below the cut were pruned with it; the bans still
running at the cut's time are in the cut and listed.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path


def add_commands(sub) -> None:
    p = sub.add_parser("penalties", help="penalties, bans and failed verdicts (with reasons) from the local ledger")
    p.add_argument("--data-dir", help="node data dir (default: the run's data dir)")
    p.add_argument("--run", metavar="FILE", type=Path, help="run file (TOML)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_penalties)


def collect(store, now_s: float, run=None) -> dict:
    """Penalty entries, active bans and failed-verdict reasons from a ledger store of ``run`` (a
    :class:`~node.config.RunConfig`: its trainers open a stored cut; None: none known, which only a
    store without a cut can do without), and the cut the store is based on (``cut``: None, or its
    number and signer)."""
    from ...config import RunConfig
    from ...ledger.chain import Ledger
    from ...ledger.cut import open_signed_cut

    run = run or RunConfig(name=store.run() or "")
    from ...ledger.entries import Penalty, Verdict, parse_entry
    from ...ledger.store import rebuild

    penalties, failed = [], collections.defaultdict(collections.Counter)
    for _author, _seq, _hash, raw in store.iter_raw():
        se = parse_entry(bytes(raw), verify_signature=False)  # our own database: checked before it was stored
        if isinstance(se.body, Penalty):
            penalties.append((se.author, se.time_ms, se.body))
        elif isinstance(se.body, Verdict) and not se.body.ok:
            for r in se.body.reasons:
                if r != "ok":
                    failed[se.body.worker][r] += 1
    # Active bans as the node itself sees them (equivocators' entries past the fork excluded).
    replica = Ledger(store.run() or run.name, run.trainers, run.validators, 0, history=store.entries)
    rebuild(store, replica)  # LedgerStoreError when a stored cut does not open for the run's trainers
    now_ms = int(now_s * 1000)
    newest = store.latest_cut()
    return {
        "cut": None if newest is None else {"number": newest[0], "signer": open_signed_cut(newest[2], replica)[0]},
        "penalties": [
            {"peer": b.peer, "by": a, "time_ms": t, "reason": b.reason, "points": b.points, "ban_seconds": b.ban_seconds}
            for a, t, b in penalties
        ],
        "bans": {p: {"seconds_left": round((b.until_ms - now_ms) / 1000), "reason": b.reason, "by": b.by}
                 for p, b in replica.bans(now_ms).items()},
        "failed_verdicts": {w: dict(c) for w, c in failed.items()},
    }


def cmd_penalties(args) -> int:
    from ...config import ConfigError
    from ...ledger.store import LedgerStoreError, open_ledger_store
    from .ledger import tool_config

    try:
        config = tool_config(args.run, args.data_dir)
        store = open_ledger_store(config.resolved_data_dir(), read_only=True)
        with store:
            report = collect(store, time.time(), config.run)
    except (ConfigError, LedgerStoreError) as e:
        print(f"swarm-node penalties: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    if report["cut"]:
        print(f"based on cut {report['cut']['number']} signed by {report['cut']['signer']}: penalties and verdicts "
              f"at or below it were pruned with it; its bans still running are listed")
    print(f"{len(report['penalties'])} penalties")
    for p in report["penalties"]:
        ban = f", banned {p['ban_seconds']}s" if p["ban_seconds"] else ""
        print(f"  {p['peer'][-12:]}  {p['reason']}  {p['points']} pt{ban}  (by {p['by'][-8:]})")
    print(f"{len(report['bans'])} active bans")
    for peer, b in report["bans"].items():
        print(f"  {peer}  {b['reason']}  {b['seconds_left']}s left")
    print("failed verdicts per worker, by reason named")
    for worker, reasons in report["failed_verdicts"].items():
        print(f"  {worker[-12:]}  " + ", ".join(f"{r} x{n}" for r, n in sorted(reasons.items())))
    return 0

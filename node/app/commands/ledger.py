"""``swarm-node ledger``: totals per peer, ``ledger verify`` and ``ledger export`` on the local database.

They read the database of a data dir (``--data-dir``, or the default for the run of ``--run FILE``)
read-only, so they are safe while the node runs (SQLite WAL readers never block the writer).

A database based on a trainer-signed cut (node/ledger/cut.py) holds no entries at or below the cut's
heads: totals are the cut's plus the entries above it, ``verify`` checks the cut itself (its signature,
run and signer among the run's trainers, and the stored bases against its heads) and the entries
above it, and says so; ``export`` writes the entries it holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from ...ledger.chain import Evidence, Ledger
from ...ledger.entries import TOTAL_FIELDS, entry_to_json, parse_entry
from ...ledger.store import LedgerStore, LedgerStoreError, open_ledger_store, rebuild
from ...roles.sections import RunSections

_SHORT = {  # column headers for the totals table
    "entries": "entries",
    "checkpoints": "ckpts",
    "rollouts_accepted": "accepted",
    "rollouts_rejected": "rejected",
    "tokens": "tokens",
    "verdicts": "verdicts",
    "verdicts_failed": "failed",
    "bytes_served": "served",
    "penalties": "penalty",
    "bans": "bans",
}


# Why `served` could differ with and without --run (issue 39): standing comes from the run's trainers
# and validators (node/ledger/chain.py, "Sybil bounds"), which only the run file (or the run.json a
# node leaves in its data dir) names.
UNKNOWN_TRUST_NOTE = ("note: no run file (--run FILE) and no node has run on this data dir, so the run's trainers "
                      "and validators are unknown here: no receipt has standing and `served` counts only unvouched "
                      "credit (the run's nodes count more); pass --run for the run's totals")


def add_commands(sub) -> None:
    """Add ``ledger``, ``ledger verify`` and ``ledger export`` to the CLI."""
    p = sub.add_parser("ledger", help="contribution totals per peer from the local ledger replica")
    _location(p, argparse.SUPPRESS)
    p.add_argument("--peer", metavar="ID", help="only this peer")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_totals)
    inner = p.add_subparsers(dest="ledger_command", metavar="{verify,export}")

    v = inner.add_parser("verify", help="re-check every signature and chain link in the ledger database")
    _location(v, argparse.SUPPRESS)
    v.set_defaults(func=cmd_verify)

    e = inner.add_parser("export", help="write every entry (and equivocation evidence) as JSON lines")
    _location(e, argparse.SUPPRESS)
    e.add_argument("--out", metavar="FILE", type=Path, help="write here instead of stdout")
    e.set_defaults(func=cmd_export)


def _location(p: argparse.ArgumentParser, default) -> None:
    # SUPPRESS: a flag given before or after the sub-subcommand is kept, not reset to a default.
    p.add_argument("--data-dir", default=default, help="node data dir (default: the run's data dir)")
    p.add_argument("--run", metavar="FILE", type=Path, default=default, help="run file (TOML)")


class _Usage(Exception):
    pass


def tool_config(run_file: Path | None, data_dir: str | None):
    """The run file's config; without one (no --run, no $SWARM_RUN), the run the data dir's node last
    served (its run.json), so entries are judged as that node judges them (ConfigError for a bad run
    file). Also ``swarm-node penalties``'s."""
    from ...config import RUN_FILE_ENV, load_config, read_run_record

    config = load_config(run_file, dict(os.environ), {"data_dir": data_dir})
    if run_file is None and not os.environ.get(RUN_FILE_ENV):
        config.run = read_run_record(config.resolved_data_dir()) or config.run
    return config


def _config(args):
    from ...config import ConfigError

    try:
        return tool_config(getattr(args, "run", None), getattr(args, "data_dir", None))
    except ConfigError as e:
        raise _Usage(str(e)) from None


def _open(args) -> tuple[LedgerStore, object]:
    config = _config(args)
    try:
        return open_ledger_store(config.resolved_data_dir(), read_only=True), config
    except LedgerStoreError as e:
        raise _Usage(str(e)) from None


def _replica(store: LedgerStore, config) -> Ledger:
    run = config.run
    name = store.run() or run.name
    ledger = Ledger(name, run.trainers, run.validators, max_skew_ms=0, limits=RunSections.of(run).ledger.limits(),
                    history=store.entries)  # the entries stay in the database, not in memory
    for author, (seq, reason) in rebuild(store, ledger).items():
        print(f"warning: {author} not counted from seq {seq} ({reason}); run `swarm-node ledger verify`", file=sys.stderr)
    return ledger


def _guard(func):
    def wrapper(args) -> int:
        try:
            return func(args)
        except _Usage as e:
            print(f"swarm-node ledger: error: {e}", file=sys.stderr)
            return 2
        except LedgerStoreError as e:
            print(f"swarm-node ledger: error: {e}", file=sys.stderr)
            return 2

    wrapper.__name__ = func.__name__
    return wrapper


@_guard
def cmd_totals(args) -> int:
    store, config = _open(args)
    with store:
        ledger = _replica(store, config)
    totals = ledger.totals(args.peer)
    if not (config.run.trainers or config.run.validators) and len(ledger):
        print(UNKNOWN_TRUST_NOTE, file=sys.stderr)
    if args.json:
        out = {"digest": ledger.digest().hex(), "entries": len(ledger), "flagged": ledger.flagged(), "totals": totals}
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    header = ["peer"] + [_SHORT[f] for f in TOTAL_FIELDS]
    rows = [[_short_peer(p)] + [str(t[f]) for f in TOTAL_FIELDS] for p, t in totals.items()]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print(f"\n{len(ledger)} entries from {len(ledger.authors())} authors; digest {ledger.digest().hex()[:16]}")
    for author, seq in ledger.flagged().items():
        print(f"EQUIVOCATION: {author} signed two entries at seq {seq}; its entries from there on are excluded")
    return 0


def _short_peer(peer: str) -> str:
    return peer if len(peer) <= 20 else f"{peer[:8]}…{peer[-6:]}"


def cut_problems(store: LedgerStore, rules: Ledger) -> tuple[str | None, list[str]]:
    """The newest stored cut checked as a replica taking it would (signature, run, a signer among
    ``rules``' trainers) and the stored bases against its heads: (what it is, or None without a cut;
    its problems)."""
    from ...ledger.cut import open_cut
    from ...wire import RemoteProtocolError

    newest = store.latest_cut()
    if newest is None:
        return None, []
    number, _hash, raw = newest
    if not rules.trainers:
        return f"cut {number}", [f"cut {number}: its signer cannot be checked: no run file (--run FILE) and no "
                                 f"run.json in the data dir names the run's trainers"]
    try:
        opened = open_cut(raw, rules)
    except RemoteProtocolError as e:
        return f"cut {number}", [f"cut {number}: {e.reason}: {e.detail}"]
    problems = []
    if opened.cut.number != number or opened.hash != newest[1]:
        problems.append(f"cut {number}: stored as number {number}, hash {newest[1].hex()[:16]}; "
                        f"its bytes are cut {opened.cut.number}, hash {opened.hash.hex()[:16]}")
    heads = {log.author: (log.seq, log.hash) for log in opened.cut.logs if log.seq}
    if store.bases() != heads:
        problems.append(f"cut {number}: the stored bases are not its heads")
    return f"cut {number} signed by {opened.signer}", problems


@_guard
def cmd_verify(args) -> int:
    """Re-check the newest stored cut, every stored entry's signature, hash and link, and every piece
    of evidence."""
    store, config = _open(args)
    problems: list[str] = []
    with store:
        run_name = store.run()
        rules = Ledger(run_name or config.run.name, config.run.trainers, config.run.validators, max_skew_ms=0)
        cut, problems = cut_problems(store, rules)
        heads, bases = store.heads(), store.bases()
        checked = 0
        for author, head in sorted(heads.items()):
            bad = store.check_range(author, 1, head)  # from above the author's base
            if bad:
                problems.append(f"{author}: seq {bad[0]}: {bad[1]}")
            checked += head - bases.get(author, (0, b""))[0]
        for _author, seq, _h, raw in store.iter_raw():
            se = parse_entry(raw, verify_signature=False)  # signature checked above
            problem = rules.authority_problem(se)
            # Authority is only meaningful against the run file that lists trainers and validators.
            if problem == "wrong-run" or (problem and getattr(args, "run", None)):
                problems.append(f"{se.author}: seq {seq}: {problem}")
        evidence = 0
        for raw_a, raw_b in store.iter_evidence():
            evidence += 1
            try:
                ev = Evidence(parse_entry(raw_a), parse_entry(raw_b))
                why = ev.problem()
            except Exception as e:  # noqa: BLE001 - any failure is a finding to report
                why = str(e)
            if why:
                problems.append(f"evidence #{evidence}: {why}")
    for p in problems:
        print(f"FAIL {p}")
    status = "OK" if not problems else f"{len(problems)} problem(s)"
    if cut is None:
        print(f"verified {checked} entries from {len(heads)} authors and {evidence} evidence pair(s): {status}")
    else:  # the entries at or below the cut's heads are not here to verify: the cut's signature vouches for them
        print(f"based on {cut}; {checked} entries above it verified, from {len(heads)} authors, and {evidence} "
              f"evidence pair(s): {status}")
    return 0 if not problems else 1


@_guard
def cmd_export(args) -> int:
    store, _ = _open(args)
    with store, (open(args.out, "w") if args.out else contextlib.nullcontext(sys.stdout)) as out:
        for _author, _seq, _h, raw in store.iter_raw():
            out.write(json.dumps(entry_to_json(parse_entry(raw, verify_signature=False)), sort_keys=True) + "\n")
        for raw_a, raw_b in store.iter_evidence():
            a, b = parse_entry(raw_a, verify_signature=False), parse_entry(raw_b, verify_signature=False)
            line = {"evidence": {"author": a.author, "fork_seq": a.seq, "a": entry_to_json(a), "b": entry_to_json(b)}}
            out.write(json.dumps(line, sort_keys=True) + "\n")
    return 0

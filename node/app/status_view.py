"""``swarm-node status``: fetch a node's status and print it as readable sections (or JSON).

Reading the local ``status.json`` needs neither trio nor libp2p: they are imported only to ask a
remote node (``--connect``), so the common case starts in a fraction of a second
(tests/test_cli.py checks that importing this module loads no network stack).
"""

from __future__ import annotations

import logging
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..config import NodeConfig, check_connect_addr
from ..health import health_line
from ..status_files import STATUS_FILE, read_status
from .errors import RuntimeFailure, UsageError

CONNECT_TIMEOUT = 15.0  # seconds for --connect: dial, open the stream, read the answer
MAX_LIST_ITEMS = 8  # longer lists print their last items and how many there are in all
MAX_MEMBERS_SHOWN = 200  # member table rows; the rest are counted
# Keys of the snapshot shown in the node's own section (or the member table), not as services.
NODE_KEYS = ("membership", "peer_id", "role", "run", "uptime_s", "time", "addrs", "stopped", "traffic",
             "handler_errors", "health", "run_roles", "streams")


def fetch_status(config: NodeConfig, connect: str | None) -> dict:
    if connect:
        return _fetch_remote(config, connect)
    data_dir = Path(config.resolved_data_dir())
    path = data_dir / STATUS_FILE
    try:
        return read_status(data_dir)  # a running node writes a fresh one within a second
    except FileNotFoundError:
        raise UsageError(f"no status at {path}: is a node running with this data dir? (or use --connect ADDR)") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None


def _fetch_remote(config: NodeConfig, addr: str) -> dict:
    check_connect_addr(addr)  # a malformed address is the user's mistake (exit 2)
    # Lazy: trio and libp2p only when asking a remote node (reading status.json needs neither).
    import trio

    from ..identity import Identity
    from ..net.host import open_swarm_host
    from ..status import call_status

    # py-libp2p logs each failed dial attempt itself; the one line below says what matters.
    for name in ("libp2p", "multiaddr", "async_service"):
        logging.Logger.setLevel(logging.getLogger(name), logging.CRITICAL)  # also once node.log adopted it

    async def ask() -> dict:
        # A throwaway identity: asking for status must not need (or lock) the local node's key.
        async with open_swarm_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as host:
            with trio.fail_after(CONNECT_TIMEOUT):
                return await call_status(host, addr)

    try:
        return trio.run(ask)
    except trio.TooSlowError:
        raise RuntimeFailure(f"no answer from {addr} within {CONNECT_TIMEOUT:g} s") from None
    except Exception as e:  # ExceptionGroups from the host's nursery included: one line, the first cause
        raise RuntimeFailure(f"cannot get status from {addr}: {_reason(e)}") from None


def _reason(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


# ------------------------------------------------------------------------------ rendering


def render_status(status: dict, console: Console | None = None) -> None:
    console = console or Console()
    member = status.get("membership") or {}
    _node_section(status, member, console)
    console.print(escape(health_line(status) or "health: -"), highlight=False)  # node/health.py's judgement
    role = status.get("role")
    if isinstance(status.get(role), dict):  # what the node is for comes first, before the member table
        _section(str(role), status[role], console)
    counts = member.get("counts", {})
    if counts:
        console.print("members: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    rows = member.get("members", [])
    if rows:
        console.print(_member_table(rows))
        if len(rows) > MAX_MEMBERS_SHOWN:
            console.print(f"... and {len(rows) - MAX_MEMBERS_SHOWN} more members (--json lists all)")
    elif member:
        console.print("members: none known yet (no peer record received)")
    rejected = member.get("rejected") or {}
    if rejected:
        console.print("rejected: " + ", ".join(f"{k}={v}" for k, v in sorted(rejected.items())))
    for peer, ban in sorted((status.get("ledger", {}).get("bans") or {}).items()):
        console.print(f"[red]banned[/red] {peer[:20]}…  {ban['seconds_left']}s left  {escape(str(ban['reason']))}"
                      f"  (by {ban['by'][:20]}…)")
    margins = (status.get("validator") or {}).get("proof_margins")
    if margins and margins.get("worst_passing"):
        console.print(_margins_line(margins))
    for name, value in status.items():
        if name not in NODE_KEYS and name != role:
            _section(name, value, console)
    streams = status.get("streams")
    if isinstance(streams, dict) and streams:
        console.print()
        for line in stream_lines(streams):
            console.print(escape(line), highlight=False)


def _section(name: str, value, console: Console) -> None:
    console.print()
    console.print(f"[bold]{escape(name)}[/bold]")
    for line in section_lines(value):
        console.print(escape(line), highlight=False)


def stream_lines(streams: dict) -> list[str]:
    """The per-protocol stream budgets (node/net/budget.py) as one line per protocol that was used,
    the never-used ones counted in the heading: a dozen lines instead of ten per protocol."""
    used = {p: b for p, b in streams.items() if isinstance(b, dict) and (b.get("peak_streams") or b.get("refused")
                                                                         or b.get("stalled"))}
    open_now = sum(b.get("streams", 0) for b in used.values())
    out = [f"streams: {open_now} open on {len(used)} protocols used" + (
        f" ({len(streams) - len(used)} never used; --json has every budget)" if len(streams) > len(used) else "")]
    for proto, b in used.items():
        line = (f"  {proto}: {b.get('streams', 0)}/{b.get('streams_max', '?')} open, peak {b.get('peak_streams', 0)}, "
                f"{human_bytes(b.get('bytes', 0))} buffered (peak {human_bytes(b.get('peak_bytes', 0))})")
        if b.get("refused"):
            line += f", refused {_inline(b['refused'])}"
        if b.get("stalled"):
            line += f", stalled {b['stalled']}"
        out.append(line)
    return out


def _node_section(status: dict, member: dict, console: Console) -> None:
    own_role = escape(str(status.get("role")))
    if (member.get("self") or {}).get("unlisted"):
        own_role = f"{own_role} [red](unlisted: not in the run file)[/red]"
    head = (
        f"[bold]{status.get('peer_id', '?')}[/bold]  role={own_role}  run={escape(str(status.get('run')))}  "
        f"uptime={status.get('uptime_s')}s  connections={member.get('connections', '?')}"
    )
    if status.get("stopped"):
        head += "  [red](stopped)[/red]"
    console.print(head)
    addrs = status.get("addrs") or []
    console.print("  listening: " + (" ".join(addrs) if addrs else "-"), highlight=False)
    me = member.get("self") or {}
    held = (status.get("shards") or {}).get("held") or me.get("checkpoints") or []
    if me or held:
        console.print(f"  versions held: {','.join(map(str, held)) or 'none'}  record seq: {me.get('seq', '-')}")
    traffic = status.get("traffic") or {}
    if traffic:
        console.print(f"  traffic: sent {human_bytes(traffic.get('tcp_bytes_sent', 0))}, "
                      f"received {human_bytes(traffic.get('tcp_bytes_received', 0))}")
    errors = status.get("handler_errors") or {}
    if errors:
        console.print("  handler errors: " + ", ".join(f"{escape(k)}={v}" for k, v in sorted(errors.items())))


def _member_table(rows: list[dict]) -> Table:
    table = Table(show_lines=False)
    for col in ("peer id", "role", "state", "for", "seq", "checkpoints", "address"):
        table.add_column(col)
    colors = {"alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}
    for row in rows[:MAX_MEMBERS_SHOWN]:
        state = row["state"]
        table.add_row(
            row["peer_id"][:20] + "…",
            role_text(row),
            f"[{colors.get(state, 'white')}]{state}[/]"
            + (f" [yellow](accused by {row['suspected_by'][:12]}…)[/]" if row.get("suspected_by") else ""),
            f"{row['for_s']}s",
            str(row["seq"])[-6:],
            ",".join(map(str, row.get("checkpoints", []))) or "-",
            (row.get("addrs") or ["-"])[0],
        )
    return table


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def section_lines(value, indent: int = 1) -> list[str]:
    """A service's status as ``key: value`` lines, nested tables indented; nothing is cut mid-value.

    Flat tables print on one line (``a=1, b=2``); lists longer than ``MAX_LIST_ITEMS`` print their
    last items with the count in all (the full value is in ``--json``)."""
    pad = "  " * indent
    if not isinstance(value, dict):
        return [pad + _inline(value)]
    if not value:
        return [pad + "(empty)"]
    out: list[str] = []
    for key, v in value.items():
        if isinstance(v, dict) and v and not _flat(v):
            out.append(f"{pad}{key}:")
            out += section_lines(v, indent + 1)
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            out.append(f"{pad}{key}: {_count_note(v)}")
            out += [f"{pad}  - {_inline(x)}" for x in v[-MAX_LIST_ITEMS:]]
        else:
            out.append(f"{pad}{key}: {_inline(v)}")
    return out


def _flat(d: dict) -> bool:
    return all(not isinstance(v, (dict, list)) for v in d.values()) and len(d) <= 12


def _count_note(items: list) -> str:
    return f"{len(items)} in all, the last {MAX_LIST_ITEMS}:" if len(items) > MAX_LIST_ITEMS else ""


def _inline(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_inline(x)}" for k, x in v.items()) if v else "none"
    if isinstance(v, list):
        if not v:
            return "none"
        shown = ", ".join(_inline(x) if not isinstance(x, list) else "(" + " ".join(map(_inline, x)) + ")"
                          for x in v[-MAX_LIST_ITEMS:])
        return f"{shown}  ({len(v)} in all, the last {MAX_LIST_ITEMS} shown)" if len(v) > MAX_LIST_ITEMS else shown
    return str(v)


def role_text(row: dict) -> str:
    """A member's role as its record claims it, marked when it claims a role the run file did not
    grant: anyone can write "trainer" in its own record (node/gossip/membership.py: unlisted_role)."""
    return f"[yellow]{row['role']} (unlisted)[/yellow]" if row.get("unlisted") else row["role"]


def _margins_line(margins: dict) -> str:
    """How close accepted proofs came to the run's thresholds, and tighter ones once enough were seen."""
    worst, limit = margins["worst_passing"], margins["thresholds"]
    line = f"proofs: {margins['rollouts']} accepted rollouts, worst / threshold: " + ", ".join(
        f"{key.removeprefix('max_')} {worst[key]} / {limit[key]}" for key in limit
    )
    rec = margins.get("recommended")
    if rec and rec != limit:
        line += "\n  [yellow]recommended[/yellow] for the run file's \\[proofs]: " + " ".join(f"{k} = {v}" for k, v in rec.items())
    return line

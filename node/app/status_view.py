"""``swarm-node status``: fetch a node's status and print it as a table (or JSON)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..config import NodeConfig, check_connect_addr
from ..identity import Identity
from ..status import STATUS_FILE
from .errors import UsageError


def fetch_status(config: NodeConfig, connect: str | None) -> dict:
    if connect:
        return _fetch_remote(config, connect)
    path = Path(config.resolved_data_dir()) / STATUS_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"no status at {path}: is a node running with this data dir? (or use --connect ADDR)") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None


def _fetch_remote(config: NodeConfig, addr: str) -> dict:
    # Lazy: trio and libp2p only when asking a remote node (reading status.json needs neither).
    import trio

    from ..net.host import open_swarm_host
    from ..status import call_status

    check_connect_addr(addr)

    async def ask() -> dict:
        # A throwaway identity: asking for status must not need (or lock) the local node's key.
        async with open_swarm_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as host:
            with trio.fail_after(15):
                return await call_status(host, addr)

    try:
        return trio.run(ask)
    except trio.TooSlowError:
        raise UsageError(f"no answer from {addr} within 15 s") from None
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"cannot get status from {addr}: {type(e).__name__}: {e}") from None


def render_status(status: dict, console: Console | None = None) -> None:
    console = console or Console()
    member = status.get("membership", {})
    head = (
        f"[bold]{status.get('peer_id', '?')}[/bold]  role={status.get('role')}  run={status.get('run')}  "
        f"uptime={status.get('uptime_s')}s  connections={member.get('connections', '?')}"
    )
    if status.get("stopped"):
        head += "  [red](stopped)[/red]"
    console.print(head)
    counts = member.get("counts", {})
    console.print("members: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    table = Table(show_lines=False)
    for col in ("peer id", "role", "state", "for", "seq", "checkpoints", "address"):
        table.add_column(col)
    colors = {"alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}
    for row in member.get("members", []):
        state = row["state"]
        table.add_row(
            row["peer_id"][:20] + "…",
            row["role"],
            f"[{colors.get(state, 'white')}]{state}[/]"
            + (f" [yellow](accused by {row['suspected_by'][:12]}…)[/]" if row.get("suspected_by") else ""),
            f"{row['for_s']}s",
            str(row["seq"])[-6:],
            ",".join(map(str, row.get("checkpoints", []))) or "-",
            (row.get("addrs") or ["-"])[0],
        )
    console.print(table)
    rejected = member.get("rejected") or {}
    if rejected:
        console.print("rejected: " + ", ".join(f"{k}={v}" for k, v in sorted(rejected.items())))
    for peer, ban in sorted((status.get("ledger", {}).get("bans") or {}).items()):
        console.print(f"[red]banned[/red] {peer[:20]}…  {ban['seconds_left']}s left  {ban['reason']}  (by {ban['by'][:20]}…)")
    margins = (status.get("validator") or {}).get("proof_margins")
    if margins and margins.get("worst_passing"):
        console.print(_margins_line(margins))
    for name, value in status.items():
        if name in ("membership", "peer_id", "role", "run", "uptime_s", "time", "addrs", "stopped"):
            continue
        console.print(f"[bold]{name}[/bold]: {json.dumps(value)[:400]}")


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

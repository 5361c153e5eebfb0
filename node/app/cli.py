"""``swarm-node``: run a node in a role, or one of the tool commands (keygen, id, status, demo...).

Exit codes: 0 ok, 1 runtime failure, 2 bad input (flags, run file, environment, key file).
Bad input is one line on stderr naming the field, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

from .. import __version__
from ..atomic import DataDirError, data_dir_holder, hold_data_dir
from ..bootstrap_list import read_bootstrap_list
from ..config import (DEFAULT_LISTEN, LOG_LEVELS, ROLES, RUN_FILE_ENV, ConfigError, NodeConfig, load_config,
                      write_run_record)
from ..identity import KEY_FILE, IdentityError, load_identity, load_or_create_identity, save_identity
from ..log import setup_logging
from ..net.ports import PortUnavailable, check_listen_ports, check_port_free
from ..rl.sandbox import SandboxUnavailable
from ..rollouts.config import CHEATS
from .commands import COMMANDS
from .errors import RuntimeFailure, UsageError

# Imported inside the commands on purpose: trio and libp2p (roles, status, status_view's remote
# fetch) and the demo's swarm cost start-up time that ``--help``, ``keygen`` and ``id`` should not pay.


EPILOG = """\
examples:
  swarm-node --role inference --run run.toml --bootstrap    join with the packaged bootstrap list
  swarm-node --role relay --run run.toml --listen /ip4/0.0.0.0/tcp/4001
  swarm-node --role trainer --run run.toml                  trusted operator
  swarm-node id --addr --data-dir relay                     addresses to pass as --bootstrap
  swarm-node status                                         member table of the local node
  swarm-node demo --duration 60                             local swarm on loopback

environment: SWARM_RUN names the run file; SWARM_<FIELD> sets a node field (SWARM_ROLE, SWARM_LISTEN=a,b, SWARM_LOG_LEVEL...),
SWARM_RUN_<FIELD> a run field (SWARM_RUN_NAME). Precedence: defaults < run file < env < flags.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + exits 2; keep it to one clear line
        if message.startswith("unrecognized arguments:"):
            message += _suggestion(self, message.split(":", 1)[1].split())
        self.exit(2, f"{self.prog}: error: {message}\n")


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every --flag of ``parser`` and of its subcommands (a flag given to the wrong one lands here)."""
    out = {s for s in parser._option_string_actions if s.startswith("--")}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _option_strings(sub)
    return out


def _suggestion(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    known = sorted(_option_strings(parser))
    for word in unknown:
        close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.6)
        if word.startswith("-") and close:
            return f" (did you mean {close[0]}?)"
    return ""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", help="node data dir (key, checkpoints, ledger); default ~/.local/share/swarm-node/<run>")
    p.add_argument("--run", metavar="FILE", type=Path,
                   help="run file (TOML): run name, trusted peers, component tables (default $SWARM_RUN)")
    p.add_argument("--log-level", choices=LOG_LEVELS, help="log verbosity (default info)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="swarm-node",
        description="One peer of a swarm that post-trains a language model with reinforcement learning.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"swarm-node {__version__}")
    parser.add_argument("--role", choices=ROLES, help="what this node does (default relay)")
    parser.add_argument(
        "--bootstrap",
        nargs="*",
        metavar="MULTIADDR",
        help="peers to join through; with no value, the packaged list (bootstrap/peers.txt)",
    )
    parser.add_argument("--listen", nargs="+", metavar="MULTIADDR", help=f"listen addresses (default {DEFAULT_LISTEN})")
    parser.add_argument(
        "--relay-via", nargs="+", metavar="MULTIADDR",
        help="behind NAT: reserve a slot on these relays and advertise the relayed address",
    )
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on PORT (127.0.0.1 unless --metrics-listen)")
    parser.add_argument("--metrics-listen", metavar="IP", help="address the metrics endpoint binds (default 127.0.0.1)")
    parser.add_argument("--http-port", type=int,
                        help="serve the web status page, /status.json, /metrics and /healthz on PORT (default off)")
    parser.add_argument("--http-listen", metavar="IP", help="address the status page binds (default 127.0.0.1)")
    parser.add_argument("--log-json", action="store_true", default=None, help="log one JSON object per line")
    _common(parser)
    sub = parser.add_subparsers(dest="command", metavar="[COMMAND]", required=False)

    p = sub.add_parser("keygen", help="create the node key in the data dir (if absent) and print the peer id")
    _common(p)
    p.add_argument("--from", dest="from_dir", metavar="DIR",
                   help="copy the key of data dir DIR instead of making one: the same peer id for another run's "
                        "data dir (never run both dirs in one run: one author, two logs)")
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser("id", help="print the peer id and the addresses other peers can dial")
    _common(p)
    p.add_argument("--listen", nargs="+", metavar="MULTIADDR")
    p.add_argument("--create", action="store_true", help="create the key if the data dir has none (as keygen)")
    p.add_argument("--addr", action="store_true",
                   help="print only the addresses, one per line (for --bootstrap $(swarm-node id --addr ...))")
    p.set_defaults(func=cmd_id)

    p = sub.add_parser("status", help="member table of a running node")
    _common(p)
    p.add_argument("--connect", metavar="MULTIADDR", help="ask the node at this address (else the local node's status.json)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("demo", help="run a local swarm on loopback with a live table")
    p.add_argument("--duration", type=float, default=0.0, help="stop after SECONDS (default: until Ctrl-C)")
    p.add_argument("--extra", type=int, default=0, help="extra inference nodes beyond the default two")
    p.add_argument("--cheat", choices=_cheats(), help="add a dishonest inference node of this kind")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                   help="vllm: the second inference node runs vLLM (its CPU build without a GPU) and the run accepts it")
    p.add_argument("--model", default="", metavar="DIR|FILE.gguf",
                   help="post-train this model on reasoning-gym's chain_sum instead of the tiny model on digit "
                        "reversal (make smollm2 writes .models/smollm2-135m-instruct)")
    p.add_argument("--data-root", type=Path, default=Path("demo-data"), help="folder for the nodes' data dirs")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
    p.add_argument("--http-port", type=int, default=8080,
                   help="port of the trainer's web status page on 127.0.0.1 (default 8080; 0 = off)")
    p.set_defaults(func=cmd_demo)

    for module in COMMANDS:
        module.add_commands(sub)
    return parser


def _cheats() -> tuple[str, ...]:
    return tuple(c for c in CHEATS if c)  # "" is honest


def flags_of(args: argparse.Namespace) -> dict:
    flags = {
        "role": getattr(args, "role", None),
        "listen": getattr(args, "listen", None),
        "data_dir": getattr(args, "data_dir", None),
        "log_level": getattr(args, "log_level", None),
        "log_json": getattr(args, "log_json", None),
        "metrics_port": getattr(args, "metrics_port", None),
        "metrics_listen": getattr(args, "metrics_listen", None),
        "http_port": getattr(args, "http_port", None),
        "http_listen": getattr(args, "http_listen", None),
        "relay_via": getattr(args, "relay_via", None),
    }
    bootstrap = getattr(args, "bootstrap", None)
    if bootstrap is not None:
        flags["bootstrap"] = bootstrap if bootstrap else packaged_bootstrap()
    return flags


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    return load_config(getattr(args, "run", None), dict(os.environ), flags_of(args))


def packaged_bootstrap() -> list[str]:
    peers = read_bootstrap_list()
    if not peers:
        raise UsageError(
            "bootstrap: the packaged list (bootstrap/peers.txt) is empty; pass addresses: --bootstrap /ip4/.../tcp/4001/p2p/<id>"
        )
    return peers


# ------------------------------------------------------------------------------ commands


def cmd_run(args: argparse.Namespace) -> int:
    import trio

    from ..ledger.store import check_run_of
    from ..roles.core import check_code_sandbox, run_node

    config = config_from_args(args)
    require_run(config, args)
    check_code_sandbox(config)  # before a key is made: a node that cannot start should leave nothing
    if config.role == "inference":  # nor an inference node that cannot run the engine its run selects
        from ..inference.generate import choose_engine
        from ..roles.sections import RunSections

        choose_engine(RunSections.of(config.run).inference)
    check_trusted_role(config)
    check_model(config)
    setup_logging(config.log_level, config.log_json)  # what opening the data dir logs is formatted too
    with hold_data_dir(config.resolved_data_dir()):  # for the node's life: one process per data dir
        check_ports(config)
        check_run_of(config.resolved_data_dir(), config.run.name)
        write_run_record(config.resolved_data_dir(), config.run)
        identity = load_or_create_identity(config.resolved_data_dir())[0]
        setup_logging(config.log_level, config.log_json, identity.peer_id[-8:])
        try:
            trio.run(run_node, config)
        except BaseExceptionGroup as group:  # a service's nursery wraps what stopped it
            bad_input, _ = group.split((DataDirError, ConfigError, PortUnavailable))
            if bad_input is None:
                raise
            raise _first_leaf(bad_input) from None
    return 0


def require_run(config: NodeConfig, args: argparse.Namespace) -> None:
    """A node serves one run: its gossip topics, protocols, ledger and checkpoints are the run's, and
    peers of any other run refuse it. Without a run file a node would join run 'demo' unnoticed
    (issue 39: a relay started as the README said served nobody), so it must be named."""
    if getattr(args, "run", None) or os.environ.get(RUN_FILE_ENV) or os.environ.get("SWARM_RUN_NAME"):
        return
    raise UsageError(f"--run: a {config.role} serves one run; name its run file: "
                     f"swarm-node --role {config.role} --run run.toml ... (or set ${RUN_FILE_ENV})")


def check_model(config: NodeConfig) -> None:
    """The trainer's ``[run] model`` names a local model folder or GGUF file (checked before anything starts)."""
    if config.role != "trainer" or not config.run.model:
        return
    from ..engines.gguf_folder import check_model_source

    try:
        check_model_source(config.run.model)
    except ValueError as e:  # GGUFError, ModelFolderError
        raise ConfigError(f"run.model: {e}") from None


def check_ports(config: NodeConfig) -> None:
    """Every port the node will listen on is free: one line now, not a traceback or a half-started
    node later (the bind sites check again, for a port taken in between)."""
    from ..net.host import parse_multiaddr

    check_listen_ports([parse_multiaddr(a) for a in config.listen])
    check_port_free(config.http_listen, config.http_port, "--http-port")
    check_port_free(config.metrics_listen, config.metrics_port, "--metrics-port")


def check_trusted_role(config: NodeConfig) -> None:
    """A trainer or validator whose peer id is not in the run's list would run without effect
    (peers refuse its checkpoints or verdicts): stop before starting, exit 2, saying how to fix it.
    Checked before any key is created, so a misconfigured start leaves nothing behind."""
    listed = {"trainer": config.run.trainers, "validator": config.run.validators}.get(config.role)
    if listed is None:
        return
    field = f"run.{config.role}s"
    data_dir = config.resolved_data_dir()
    if not (data_dir / KEY_FILE).exists():
        raise UsageError(f"{field}: this {config.role} has no key yet in {data_dir}, so it cannot be listed; "
                         f"run `swarm-node keygen --data-dir {data_dir}` and add the peer id it prints to {field}")
    peer_id = load_identity(data_dir / KEY_FILE).peer_id
    if peer_id not in listed:
        where = f"the run file's [run] {config.role}s" if listed else f"{field} (empty in this run)"
        raise UsageError(f"{field}: this node ({peer_id}) is not a {config.role} of run {config.run.name!r}; "
                         f"peers would refuse its {'checkpoints' if config.role == 'trainer' else 'verdicts'}: "
                         f"add it to {where}")


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def cmd_keygen(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    data_dir = config.resolved_data_dir()
    where = data_dir / KEY_FILE
    source = load_identity(Path(args.from_dir).expanduser() / KEY_FILE) if args.from_dir else None
    if where.exists():  # reading a key writes nothing: no lock, also while the node runs
        identity, created = load_identity(where), False
        if source is not None and source.peer_id != identity.peer_id:
            raise UsageError(f"{where} already holds another key ({identity.peer_id}); "
                             "--from copies a key only into a data dir without one")
    else:
        with hold_data_dir(data_dir, min_free=0):  # a key is a few hundred bytes
            identity, created = (source, True) if source else load_or_create_identity(data_dir)
            if source is not None:
                save_identity(source, where)
    print(identity.peer_id)
    print(f"{'created' if created else 'already present'}: {where}", file=sys.stderr)
    return 0


def cmd_id(args: argparse.Namespace) -> int:
    """The peer id, then the addresses to give other peers (``--bootstrap``): the running node's
    own (node.json, read while a node holds the data dir) or, when none runs, the configured listen
    addresses; wildcards expanded. ``--addr``: the addresses only."""
    config = config_from_args(args)
    data_dir = config.resolved_data_dir()
    if not (data_dir / KEY_FILE).exists() and not args.create:
        raise UsageError(f"no key in {data_dir}: create one with `swarm-node keygen --data-dir {data_dir}` "
                         "(or `swarm-node id --create`)")
    if (data_dir / KEY_FILE).exists():
        identity = load_identity(data_dir / KEY_FILE)
    else:
        with hold_data_dir(data_dir, min_free=0):  # a key is a few hundred bytes
            identity = load_or_create_identity(data_dir)[0]
        print(f"created: {data_dir / KEY_FILE}", file=sys.stderr)
    if not args.addr:
        print(identity.peer_id)
    from .addresses import NAT_NOTE, dialable

    shown, expanded = dialable(running_addrs(data_dir) or list(config.listen), identity.peer_id)
    for a in shown:
        print(a)
    if expanded:
        print(NAT_NOTE, file=sys.stderr)
    return 0


def running_addrs(data_dir: Path) -> list[str]:
    """The listen addresses of the node running on ``data_dir`` (its node.json), [] when none runs:
    a node that was killed leaves its node.json behind, so only a held data dir counts."""
    from ..status_files import NODE_FILE

    if data_dir_holder(data_dir) is None:
        return []
    try:
        return list(json.loads((data_dir / NODE_FILE).read_text())["addrs"])
    except (ValueError, KeyError, OSError, TypeError):
        return []


def cmd_status(args: argparse.Namespace) -> int:
    from .status_view import fetch_status, render_status

    config = config_from_args(args)
    status = fetch_status(config, args.connect)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        render_status(status)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    # transformers' and the hub's progress bars are noise in a node's log and a tool's output
    # (init-model, rl-local, rollout); read when huggingface_hub is first imported, so set first.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        func = getattr(args, "func", None) or cmd_run
        return int(func(args) or 0)
    except (ConfigError, UsageError, IdentityError, SandboxUnavailable, DataDirError, PortUnavailable) as e:
        print(f"swarm-node: error: {e}", file=sys.stderr)
        return 2
    except RuntimeFailure as e:
        print(f"swarm-node: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`swarm-node status | head`): stop quietly
        _silence_stdout()
        return 1
    except OSError as e:
        print(f"swarm-node: error: {e}", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again
    (the recipe of Python's ``signal`` documentation, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())

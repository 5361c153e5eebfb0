"""``swarm-node``: run a node in a role, or one of the tool commands (node/app/commands/ holds every one).

Exit codes: 0 ok, 1 runtime failure, 2 bad input (flags, run file, environment, key file).
Bad input is one line on stderr naming the field, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from .. import __version__
from ..atomic import DataDirError, hold_data_dir
from ..config import DEFAULT_LISTEN, ROLES, RUN_FILE_ENV, ConfigError, NodeConfig, write_run_record
from ..identity import KEY_FILE, IdentityError, load_identity, load_or_create_identity
from ..log import setup_logging
from ..net.ports import PortUnavailable, check_listen_ports, check_port_free
from ..rl.sandbox import SandboxUnavailable
from .commands import COMMANDS
from .errors import RuntimeFailure, UsageError
from .options import add_common, config_from_args

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
    add_common(parser)
    sub = parser.add_subparsers(dest="command", metavar="[COMMAND]", required=False)
    for module in COMMANDS:
        module.add_commands(sub)
    return parser


# ------------------------------------------------------------------------------ starting a node


def cmd_run(args: argparse.Namespace) -> int:
    import trio

    from ..ledger.store import check_run_of
    from ..roles.core import check_code_sandbox, run_node

    config = config_from_args(args)
    require_run(config, args)
    check_code_sandbox(config)  # before a key is made: a node that cannot start should leave nothing
    from ..roles.sections import RunSections

    sections = RunSections.of(config.run)
    sections.cross_check()  # nor one whose run tables contradict each other
    if config.role == "inference":  # nor an inference node that cannot run the engine its run selects
        from ..inference.generate import choose_engine

        choose_engine(sections.inference)
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

"""One typed configuration, merged from the run file (TOML), the environment (SWARM_*) and flags.

Precedence, lowest to highest: dataclass defaults < run file < environment < command-line flags.

* ``NodeConfig`` is how *this* node runs (role, addresses, data dir, logging, metrics).
* ``RunConfig`` is what the whole swarm agrees on (run name, trusted trainer and validator peer ids,
  and one table per component: ``[shards]``, ``[proofs]``, ``[ledger]``, ...). Each component owns a
  small dataclass for its table, registered in :data:`SECTIONS` by import path so this module stays
  light (no torch, no libp2p); :meth:`RunConfig.section` builds and checks it.

Every value is checked against its field's type by :func:`build`; a bad value raises
:class:`ConfigError` naming the field (``run.shards.piece_size: expected int, got 'big'``), which
the CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import dataclasses
import importlib
import ipaddress
import json
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .atomic import write_atomic
from .net.multiaddrs import MultiaddrError, check_multiaddr

ROLES = ("trainer", "inference", "relay", "validator")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_PORT = 4001
DEFAULT_LISTEN = f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}"
RUN_FILE_ENV = "SWARM_RUN"  # path of the run file when --run is not given (the one place it is read)

# Component tables of the run file: name -> "module:Class". Imported only when asked for.
SECTIONS: dict[str, str] = {
    "membership": "node.gossip.membership:MembershipConfig",
    "shards": "node.shards.config:ShardsConfig",
    "ledger": "node.ledger.config:LedgerConfig",
    "trainer": "node.trainer.config:TrainerConfig",
    "validator": "node.validator.config:ValidatorConfig",
    "worker": "node.rollouts.config:WorkerConfig",
    "quota": "node.rollouts.quota:QuotaConfig",
    "rl": "node.rl.config:RLConfig",
    "grpo": "node.rl.config:GRPOConfig",
    "inference": "node.rl.config:InferenceConfig",
    "proofs": "node.proofs.config:ProofsConfig",
    "streams": "node.net.budget:StreamsConfig",
}

T = TypeVar("T")


class ConfigError(Exception):
    """A configuration value is invalid; the message names the field."""


@dataclass
class RunConfig:
    """What every peer of a run agrees on (the run file)."""

    name: str = "demo"  # run name; scopes gossip topics and the data dir
    trainers: list[str] = field(default_factory=list)  # peer ids allowed to publish checkpoints
    validators: list[str] = field(default_factory=list)  # peer ids allowed to sign verdicts
    model: str = ""  # a Hugging Face model folder or a .gguf file (the trainer converts it once); "" = the embedded tiny default
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)  # raw component tables

    def section(self, name: str, cls: type[T] | None = None) -> T:
        """The typed config of component ``name`` (its table in the run file, or defaults)."""
        if cls is None:
            if name not in SECTIONS:
                raise ConfigError(f"run.{name}: unknown section")
            mod, _, attr = SECTIONS[name].partition(":")
            cls = getattr(importlib.import_module(mod), attr)
        return build(cls, self.tables.get(name, {}), f"run.{name}")

    def check_sections(self) -> None:
        """Build every table once so a bad value fails at start, not when a service reaches it."""
        for name in self.tables:
            if name not in SECTIONS:
                raise ConfigError(f"run.{name}: unknown section (known: {', '.join(sorted(SECTIONS))})")
            self.section(name)


@dataclass
class NodeConfig:
    """How this node runs."""

    role: str = "relay"  # trainer | inference | relay | validator
    listen: list[str] = field(default_factory=lambda: [DEFAULT_LISTEN])  # multiaddrs to listen on
    bootstrap: list[str] = field(default_factory=list)  # full multiaddrs (with /p2p/<id>) to dial
    relay_via: list[str] = field(default_factory=list)  # relays to reserve a slot on when not dialable (NAT)
    data_dir: str = ""  # "" = the user's data dir, scoped by run
    log_level: str = "info"  # debug | info | warning | error
    log_json: bool = False  # one JSON object per log line (for log shippers)
    metrics_port: int = 0  # Prometheus metrics on <metrics_listen>:<port>; 0 = off
    metrics_listen: str = "127.0.0.1"  # address the metrics endpoint binds (0.0.0.0 = every interface)
    http_port: int = 0  # web status page (/, /status.json, /metrics, /healthz) on <http_listen>:<port>; 0 = off
    http_listen: str = "127.0.0.1"  # address the status page binds (0.0.0.0 = every interface)
    summary_interval: float = 60.0  # seconds between one-line summaries in the log; 0 = off
    run: RunConfig = field(default_factory=RunConfig)

    def resolved_data_dir(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        return Path(base) / "swarm-node" / self.run.name

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role: must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level: must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        for name in ("metrics_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name}: must be 0..65535, got {getattr(self, name)}")
        for name in ("metrics_listen", "http_listen"):
            check_bind_host(getattr(self, name), name)
        if self.summary_interval < 0:
            raise ConfigError(f"summary_interval: must be >= 0 seconds, got {self.summary_interval}")
        if not self.listen:
            raise ConfigError("listen: at least one address is required")
        for a in self.listen:
            check_addr(a, "listen", need_peer_id=False)
        for a in self.bootstrap:
            check_addr(a, "bootstrap", need_peer_id=True)
        for a in self.relay_via:
            check_addr(a, "relay_via", need_peer_id=True)
        if len(self.relay_via) > 8:
            raise ConfigError(f"relay_via: at most 8 relays, got {len(self.relay_via)}")
        if self.relay_via and self.role == "relay":
            raise ConfigError("relay_via: a relay is dialable itself; drop --relay-via or pick another role")
        if not self.run.name or "/" in self.run.name or len(self.run.name) > 64:
            raise ConfigError(f"run.name: 1..64 characters without '/', got {self.run.name!r}")
        from .identity import public_key_of

        for kind in ("trainers", "validators"):
            for pid in getattr(self.run, kind):
                try:
                    public_key_of(pid)
                except ValueError:
                    raise ConfigError(f"run.{kind}: {pid!r} is not an Ed25519 peer id") from None
        self.run.check_sections()
        rl, grpo = self.run.section("rl"), self.run.section("grpo")
        if rl.temperature != grpo.temperature:
            # The trainer divides logits by the sampling temperature; another value trains on a
            # distribution the rollouts were not sampled from.
            raise ConfigError(f"grpo.temperature ({grpo.temperature}) must equal rl.temperature ({rl.temperature})")


def check_addr(text: str, field: str, *, need_peer_id: bool) -> None:
    """:func:`~node.net.multiaddrs.check_multiaddr`, its error as a ConfigError naming ``field``."""
    try:
        check_multiaddr(text, field, need_peer_id=need_peer_id)
    except MultiaddrError as e:
        raise ConfigError(str(e)) from None


RUN_RECORD = "run.json"  # in a data dir: the run its node last served (for tools given no --run)


def write_run_record(data_dir: Path, run: RunConfig) -> None:
    """Keep the run a node serves in its data dir, so that tools reading the dir without a run file
    (``swarm-node ledger``) judge its entries with the same trainers, validators and limits."""
    write_atomic(Path(data_dir) / RUN_RECORD, json.dumps(dataclasses.asdict(run), sort_keys=True).encode(),
                 durable=False)


def read_run_record(data_dir: Path) -> RunConfig | None:
    """The run last served from ``data_dir`` (None when no node ran there, or the record is unusable)."""
    try:
        return build(RunConfig, json.loads((Path(data_dir) / RUN_RECORD).read_text()), "run")
    except (OSError, ValueError, ConfigError):
        return None


def check_bind_host(host: str, field: str) -> None:
    """An IP address to bind a local HTTP endpoint to (not a name: nothing to resolve at start)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"{field}: expected an IP address such as 127.0.0.1 or 0.0.0.0, got {host!r}") from None


def check_connect_addr(addr: str) -> None:
    """A full multiaddr with a peer id (for --connect and --bootstrap)."""
    check_addr(addr, "connect", need_peer_id=True)


# --------------------------------------------------------------------------------------------
# Building dataclasses from untyped mappings


def build(cls: type[T], data: dict[str, Any], path: str) -> T:
    """Instantiate dataclass ``cls`` from ``data``, checking every value's type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{_join(path, unknown[0])}: unknown setting")
    kwargs = {k: _coerce(hints[k], v, _join(path, k)) for k, v in data.items()}
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None
    check = getattr(obj, "validate", None)
    if callable(check):
        try:
            check()
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
    return obj


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _coerce(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if origin is list:
        if isinstance(value, str):  # env vars and flags give comma-separated lists
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table")
        return value
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint in (int, float):
        return _number(hint, value, path)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    if origin in (typing.Union,) or type(hint).__name__ == "UnionType":
        if value is None and type(None) in args:
            return None
        return _coerce([a for a in args if a is not type(None)][0], value, path)
    return value


def _number(kind: type, value: Any, path: str) -> Any:
    """An int or float from TOML (numbers) or from env/flags (strings); bools are not numbers."""
    what = "an integer" if kind is int else "a number"
    accepted = (int,) if kind is int else (int, float)
    if isinstance(value, str):
        try:
            value = kind(value)
        except ValueError:
            raise ConfigError(f"{path}: expected {what}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise ConfigError(f"{path}: expected {what}, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{path}: expected a finite number, got {value!r}")
    return kind(value)


def read_run_file(path: Path) -> dict[str, Any]:
    """Parse a run file; ConfigError (one line) if it cannot be read or is not TOML."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"run file {path}: {e.strerror or e}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"run file {path}: not valid TOML ({e})") from None


def split_run_table(doc: dict[str, Any]) -> dict[str, Any]:
    """A run file's [run] keys plus component tables -> RunConfig's mapping."""
    run_keys = {f.name for f in dataclasses.fields(RunConfig)} - {"tables"}
    out: dict[str, Any] = {}
    tables: dict[str, Any] = {}
    for key, value in doc.items():
        if key == "run":
            if not isinstance(value, dict):
                raise ConfigError("run: expected a table")
            out.update(value)
        elif key == "node":
            continue
        elif key in run_keys:
            out[key] = value
        else:
            tables[key] = value
    out["tables"] = tables
    return out


def env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """SWARM_<FIELD> for node fields, SWARM_RUN_<FIELD> for run fields."""
    node: dict[str, Any] = {}
    run: dict[str, Any] = {}
    node_fields = {f.name for f in dataclasses.fields(NodeConfig)} - {"run"}
    run_fields = {f.name for f in dataclasses.fields(RunConfig)} - {"tables"}
    for key, value in environ.items():
        if not key.startswith("SWARM_"):
            continue
        name = key[len("SWARM_"):].lower()
        if name.startswith("run_") and name[4:] in run_fields:
            run[name[4:]] = value
        elif name in node_fields:
            node[name] = value
    if run:
        node["run"] = run
    return node


def load_config(
    run_file: Path | None,
    environ: dict[str, str],
    flags: dict[str, Any],
) -> NodeConfig:
    """Merge defaults < run file < environment < flags into a validated NodeConfig.

    The run file is ``run_file`` (``--run``), else the path in ``$SWARM_RUN``, else none."""
    merged: dict[str, Any] = {}
    run: dict[str, Any] = {"tables": {}}
    if run_file is None and environ.get(RUN_FILE_ENV):
        run_file = Path(environ[RUN_FILE_ENV])  # containers and units name the run file here
    if run_file is not None:
        doc = read_run_file(run_file)
        node_table = doc.get("node", {})
        if not isinstance(node_table, dict):
            raise ConfigError("node: expected a table")
        merged.update(node_table)
        run = split_run_table(doc)
    env = env_overrides(environ)
    run.update(env.pop("run", {}))
    merged.update(env)
    merged.update({k: v for k, v in flags.items() if v is not None})
    merged["run"] = run
    cfg = build(NodeConfig, merged, "")
    cfg.validate()
    return cfg

"""``swarm-node config``: every run-file table with its defaults and the comment of each field.

Generated from the dataclasses themselves (field defaults, and the ``# comment`` on or just above
each field in the source), so the reference cannot drift from the code; docs/configuration.md embeds
this output and a test checks that it is current.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
from pathlib import Path

from ...config import SECTIONS, NodeConfig, RunConfig

_FIELD = re.compile(r"^\s+(\w+)\s*:\s*[^=]+?(?:=\s*(.*?))?\s*(?:#\s*(.*))?$")
_COMMENT = re.compile(r"^\s+#\s?(.*)$")


def field_comments(cls: type) -> dict[str, str]:
    """name -> comment, from a trailing ``# ...`` or the comment lines just above the field."""
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        m_comment = _COMMENT.match(line)
        if m_comment:
            pending.append(m_comment.group(1).strip())
            continue
        m = _FIELD.match(line)
        if m and not line.strip().startswith(("def ", "@", "return", "if ", "raise")):
            trailing = m.group(3)
            out.setdefault(m.group(1), trailing.strip() if trailing else " ".join(pending))
        pending = []
    return out


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table (reasoning-gym's generators), so the reference stays a run file
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in value.items()) + "}"
    if value is None:
        return "# (unset)"
    return json.dumps(str(value))


def _table(name: str, cls: type, skip: set[str] = frozenset(), obj=None) -> list[str]:
    comments = field_comments(cls)
    lines = [f"[{name}]"]
    obj = cls() if obj is None else obj
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        value = getattr(obj, f.name)
        text = f"{f.name} = {_toml(value)}" if value is not None else f"# {f.name} ="
        comment = comments.get(f.name, "")
        lines.append(f"{text:<40} # {comment}" if comment else text)
    return lines


def reference() -> str:
    """The whole run file with defaults, one table per component, in SECTIONS order."""
    blocks = [_table("node", NodeConfig, skip={"run"}), _table("run", RunConfig, skip={"tables"})]
    for name, path in SECTIONS.items():
        module, _, attr = path.partition(":")
        blocks.append(_table(name, getattr(importlib.import_module(module), attr)))
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"


def effective(config: NodeConfig) -> str:
    """The settings that apply to a node started with ``config`` (run file < environment < flags
    already merged), in the reference's layout: one table per component, every field, with its
    meaning; values that differ from the default are marked ``(set)``."""
    blocks = [_marked("node", NodeConfig, config, skip={"run"}), _marked("run", RunConfig, config.run, skip={"tables"})]
    for name, path in SECTIONS.items():
        module, _, attr = path.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        blocks.append(_marked(name, cls, config.run.section(name, cls)))
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"


def _marked(name: str, cls: type, obj, skip: set[str] = frozenset()) -> list[str]:
    lines = _table(name, cls, skip, obj)
    default = cls()
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    for i, field_name in enumerate(names, start=1):
        if getattr(obj, field_name) != getattr(default, field_name):
            lines[i] = lines[i].replace(" # ", " # (set) ", 1) if " # " in lines[i] else lines[i] + "  # (set)"
    return lines


def cmd_config(args) -> int:
    if args.run is None and not args.effective:
        print(reference(), end="")
        return 0
    from ..options import config_from_args

    print(effective(config_from_args(args)), end="")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("config", help="print every run-file setting with its default and meaning; "
                                      "with --run FILE, the settings that would apply")
    p.add_argument("--run", metavar="FILE", type=Path,
                   help="show the settings a node started with this run file (and this environment) would use")
    p.add_argument("--effective", action="store_true",
                   help="show the settings that would apply from the environment alone (SWARM_*)")
    p.add_argument("--data-dir")
    p.set_defaults(func=cmd_config)

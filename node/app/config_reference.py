"""``swarm-node config``: every run-file table with its defaults and the comment of each field.

Generated from the dataclasses themselves (field defaults, and the ``# comment`` on or just above
each field in the source), so the reference cannot drift from the code; the README embeds this
output and a test checks that it is current.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re

from ..config import SECTIONS, NodeConfig, RunConfig

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
    if value is None:
        return "# (unset)"
    return json.dumps(str(value))


def _table(name: str, cls: type, skip: set[str] = frozenset()) -> list[str]:
    comments = field_comments(cls)
    lines = [f"[{name}]"]
    obj = cls()
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


def add_commands(sub) -> None:
    p = sub.add_parser("config", help="print every run-file setting with its default and meaning")
    p.set_defaults(func=lambda args: print(reference(), end="") or 0)

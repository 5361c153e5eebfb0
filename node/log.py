"""Structured logging: ``time level logger message key=value...`` or one JSON object per line.

Extra fields passed as ``log.info("msg", extra={"peer": p})`` are printed as key=value pairs, so
logs stay greppable by peer, topic or reason. py-libp2p is loud at INFO; it is held at WARNING
unless the node runs at DEBUG.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class _Formatter(logging.Formatter):
    def __init__(self, as_json: bool, node: str) -> None:
        super().__init__()
        self.as_json = as_json
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        extra = {k: v for k, v in vars(record).items() if k not in _STD}
        msg = record.getMessage()
        if self.as_json:
            obj = {
                "ts": round(record.created, 3),
                "level": record.levelname.lower(),
                "logger": record.name,
                "node": self.node,
                "msg": msg,
                **{k: _plain(v) for k, v in extra.items()},
            }
            if record.exc_info:
                obj["exc"] = self.formatException(record.exc_info)
            return json.dumps(obj)
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        kv = " ".join(f"{k}={_plain(v)}" for k, v in extra.items())
        line = f"{stamp} {record.levelname[:4]} {self.node} {record.name}: {msg}" + (f" {kv}" if kv else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _plain(v):
    return v if isinstance(v, (int, float, bool, type(None))) else str(v)


def setup_logging(level: str, as_json: bool = False, node: str = "-") -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(as_json, node))
    root.addHandler(handler)
    root.setLevel(level.upper())
    noisy = logging.DEBUG if level == "debug" else logging.ERROR
    for name in ("libp2p", "multiaddr", "async_service", "trio-websocket"):
        logging.getLogger(name).setLevel(noisy)

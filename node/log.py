"""Structured logging: ``time level node logger message key=value...`` or one JSON object per line.

Extra fields passed as ``log.info("msg", extra={"peer": p})`` are printed as key=value pairs, so
logs stay greppable by peer, topic or reason.

One formatter for every line the process writes (issue 19): libraries that install their own
handler or turn propagation off (py-libp2p sets ``propagate = False`` on ``libp2p`` at import, so
its records reached stderr raw through ``logging.lastResort``; transformers adds a StreamHandler of
its own) are *adopted*: their logger keeps no handler, always propagates to ours, and its level is
ours to set, whether the library is imported before or after :func:`setup_logging`. Their
progress bars (tqdm, through huggingface_hub and transformers) are turned off by environment
variables set before they are imported, since a bar is not a log line (they put 9 non-JSON lines
into one trainer's ``--log-json`` log). py-libp2p is loud at INFO: it is held at ERROR,
transformers at WARNING, unless the node runs at DEBUG.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_STD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}

# Library loggers routed through our handler: name -> level when the node is not at DEBUG.
ADOPTED = {"libp2p": logging.ERROR, "multiaddr": logging.ERROR, "async_service": logging.ERROR,
           "trio-websocket": logging.ERROR, "transformers": logging.WARNING, "huggingface_hub": logging.WARNING,
           "torch": logging.WARNING, "urllib3": logging.WARNING, "filelock": logging.WARNING}
# py-libp2p's ERROR lines for a peer that is down or refuses a protocol (a TCP connect refused, a
# stream it could not open, a connection that broke): the node's own code reports each such failure
# once, at INFO, with the batch or session it cost, so the library's copy is kept for DEBUG. In a
# 30-minute soak with restarts and partitions they were 531 of the run's ERROR lines, and every one.
PEER_FAILURE_LOGGERS = ("libp2p.transport.tcp.tcp", "libp2p.host.basic_host", "libp2p.protocol_muxer.multiselect_client",
                        "libp2p.stream_muxer.yamux.yamux", "libp2p.network.swarm")
# Read by huggingface_hub / transformers / tqdm at import (and by tqdm at each bar).
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
             "TOKENIZERS_PARALLELISM": "false"}


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


class _AdoptedLogger(logging.Logger):
    """A library's top logger that stays on our handler: what the library does to it later
    (add a handler, stop propagation, change the level) is ignored; :func:`setup_logging` sets
    the level with ``logging.Logger.setLevel`` directly."""

    @property
    def propagate(self) -> bool:  # type: ignore[override]
        return True

    @propagate.setter
    def propagate(self, value: bool) -> None:
        pass

    def addHandler(self, hdlr: logging.Handler) -> None:  # noqa: N802 (logging's name)
        pass

    def setLevel(self, level) -> None:  # noqa: N802
        pass


def quiet_third_party() -> None:
    """Progress bars off for libraries not imported yet (and for those already imported)."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    hub = sys.modules.get("huggingface_hub")
    if hub is not None:
        hub.utils.disable_progress_bars()
    tf_logging = sys.modules.get("transformers.utils.logging")
    if tf_logging is not None:
        tf_logging.disable_progress_bar()


def setup_logging(level: str, as_json: bool = False, node: str = "-") -> None:
    quiet_third_party()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(as_json, node))
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.lastResort = handler  # a record no handler takes still gets our format
    logging.captureWarnings(True)  # warnings.warn from libraries: a log line, not raw stderr
    for name, quiet in ADOPTED.items():
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.__class__ = _AdoptedLogger
        logging.Logger.setLevel(lg, logging.DEBUG if level == "debug" else quiet)
    for name in PEER_FAILURE_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if level == "debug" else logging.CRITICAL)

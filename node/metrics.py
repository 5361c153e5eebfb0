"""Prometheus metrics, one registry per node (so several nodes can share a process in tests).

Components get-or-create their own series with :meth:`Metrics.counter` / :meth:`Metrics.gauge` /
:meth:`Metrics.histogram`; names are prefixed ``swarm_`` and follow Prometheus' naming
conventions (https://prometheus.io/docs/practices/naming/): counters end in ``_total``, units are
in the name in base units (``_bytes``, ``_seconds``), and no ``*_created`` series are exported
(prometheus_client's ``disable_created_metrics``: they double the series count and no dashboard
here reads them). The process collector adds ``process_resident_memory_bytes``,
``process_cpu_seconds_total``, open fds and start time. Served only when the operator opts in
(``--metrics-port``, or ``/metrics`` of ``--http-port``), on 127.0.0.1 unless
``--metrics-listen`` / ``--http-listen`` says otherwise.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

prometheus_client.disable_created_metrics()  # process-wide; see the module docstring

# The byte counts the py-libp2p patches fill (node/net/patches/counting.py); that module imports no
# libp2p, so metrics stay importable without the network stack.
from .counters import PubsubDrops, StreamBytes, TcpBytes


PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)  # seconds: tiny model to a big one on a CPU


class _ByteCounters:
    """``swarm_stream_bytes_total{protocol,direction}``, ``swarm_tcp_bytes_total{direction}`` and
    ``swarm_tcp_calls_total{direction}`` (writes, one Noise message each, and reads), and
    ``swarm_pubsub_dropped_total{reason,topic}``: counters read from ``StreamBytes`` / ``TcpBytes`` /
    ``PubsubDrops`` at scrape time (the protocols are only known
    as streams open, and the counts are kept by the py-libp2p patches, not by prometheus_client)."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        streams = CounterMetricFamily("swarm_stream_bytes", "Payload bytes on libp2p streams by protocol",
                                      labels=["protocol", "direction"])
        for direction, counts in (("sent", StreamBytes.sent), ("received", StreamBytes.received)):
            for proto, n in sorted(counts.items()):
                streams.add_metric([proto, direction], n)
        yield streams
        tcp = CounterMetricFamily("swarm_tcp_bytes", "Bytes moved over libp2p TCP connections by this process",
                                  labels=["direction"])
        tcp.add_metric(["sent"], TcpBytes.sent)
        tcp.add_metric(["received"], TcpBytes.received)
        yield tcp
        calls = CounterMetricFamily("swarm_tcp_calls", "Writes (one Noise message each) and reads of libp2p TCP "
                                    "connections by this process", labels=["direction"])
        for direction, n in TcpBytes.calls.items():
            calls.add_metric([direction], n)
        yield calls
        drops = CounterMetricFamily("swarm_pubsub_dropped", "Gossip messages and RPCs py-libp2p dropped silently, by "
                                    "reason and topic (node/counters.py PubsubDrops)", labels=["reason", "topic"])
        for (reason, topic), n in sorted(PubsubDrops.counts.items()):
            drops.add_metric([reason, topic], n)
        yield drops


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._series: dict[str, object] = {}
        self.rejected = self.counter(
            "rejected_total", "Messages or requests refused, by source and reason", ["source", "reason"]
        )
        self.messages_in = self.counter("messages_in_total", "Gossip messages accepted", ["topic"])
        self.messages_out = self.counter("messages_out_total", "Gossip messages published", ["topic"])
        self.bytes_out = self.counter("gossip_bytes_out_total", "Gossip payload bytes published", ["topic"])
        self.bytes_in = self.counter("gossip_bytes_in_total", "Gossip payload bytes received", ["topic"])
        self.connections = self.gauge("connections", "Open peer connections")
        self.registry.register(_ByteCounters())
        ProcessCollector(registry=self.registry)  # process_* (Linux /proc; absent elsewhere)

    def _get(self, kind, name: str, doc: str, labels: list[str] | tuple[str, ...] = (), **kw):
        full = f"swarm_{name}"
        if full not in self._series:
            self._series[full] = kind(full, doc, list(labels), registry=self.registry, **kw)
        return self._series[full]

    def counter(self, name: str, doc: str, labels: list[str] | tuple[str, ...] = ()) -> Counter:
        if not name.endswith("_total"):  # ours to fix: the convention is checked where series are made
            raise ValueError(f"counter {name!r}: counter names end in _total")
        return self._get(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: list[str] | tuple[str, ...] = ()) -> Gauge:
        return self._get(Gauge, name, doc, labels)

    def histogram(self, name: str, doc: str, labels: list[str] | tuple[str, ...] = (), buckets=None) -> Histogram:
        kw = {"buckets": buckets} if buckets else {}
        return self._get(Histogram, name, doc, labels, **kw)

    def phase_seconds(self):
        """An observer for node/steptime.py's ``PhaseTimes``: ``swarm_phase_seconds{phase}``, the
        seconds of each unit of work (a batch, a step, a version) by phase."""
        h = self.histogram("phase_seconds", "Seconds of one batch, step or checkpoint version by phase "
                           "(node/steptime.py)", ["phase"], buckets=PHASE_BUCKETS)
        return lambda phase, seconds: h.labels(phase=phase).observe(seconds)

    def reject(self, source: str, reason: str) -> None:
        """Count one refused input; ``source`` is the topic or protocol it came on."""
        self.rejected.labels(source=source, reason=reason).inc()

    def rejections(self) -> dict[str, int]:
        """{"source/reason": count} for status views."""
        out: dict[str, int] = {}
        for metric in self.rejected.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[f"{s.labels['source']}/{s.labels['reason']}"] = int(s.value)
        return out

    def totals(self) -> dict:
        """A few headline counters for status views (bytes, connections, gossip dropped by reason)."""
        tcp, streams = TcpBytes, StreamBytes
        dropped: dict[str, int] = {}
        for (reason, _topic), n in PubsubDrops.counts.items():
            dropped[reason] = dropped.get(reason, 0) + n
        return {"tcp_bytes_sent": tcp.sent, "tcp_bytes_received": tcp.received,
                "stream_bytes_sent": dict(streams.sent), "stream_bytes_received": dict(streams.received),
                "pubsub_dropped": dropped}

    def render(self) -> bytes:
        return generate_latest(self.registry)

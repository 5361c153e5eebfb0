"""Metrics follow Prometheus conventions (issue 19): counters end in _total, units in names, no
*_created series, the process collector, and the trainer's and inference node's figures."""

from __future__ import annotations

import urllib.request

import pytest

from prometheus_client.parser import text_string_to_metric_families

from node.metrics import Metrics
from node.counters import StreamBytes


def families(body: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(body)}


def test_byte_counts_are_counters_and_nothing_exports_created():
    m = Metrics()
    m.counter("things_total", "Things", ["kind"]).labels(kind="a").inc()
    m.histogram("step_seconds", "Step time").observe(0.3)
    StreamBytes.sent["/swarm/test/1.0.0"] = StreamBytes.sent.get("/swarm/test/1.0.0", 0) + 10
    body = m.render().decode()
    fams = families(body)
    assert fams["swarm_tcp_bytes"].type == "counter" and fams["swarm_stream_bytes"].type == "counter"
    assert "swarm_tcp_bytes_total{direction=\"sent\"}" in body
    assert fams["swarm_tcp_calls"].type == "counter" and 'swarm_tcp_calls_total{direction="received"}' in body
    assert 'swarm_stream_bytes_total{direction="sent",protocol="/swarm/test/1.0.0"}' in body
    assert "_created" not in body
    for fam in fams.values():  # every counter's samples end in _total
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples), fam.name


def test_a_counter_without_total_is_our_bug():
    with pytest.raises(ValueError, match="_total"):
        Metrics().counter("things", "Things")


def test_process_collector_reports_memory_and_cpu():
    fams = families(Metrics().render().decode())
    assert fams["process_resident_memory_bytes"].samples[0].value > 0
    assert "process_cpu_seconds" in fams and fams["process_cpu_seconds"].type == "counter"


async def test_metrics_endpoint_binds_where_configured(tmp_path):
    """--metrics-listen: the endpoint answers on the configured address only (127.0.0.2, another
    loopback address on Linux), not on the default 127.0.0.1."""
    import socket

    import trio

    from node.config import load_config
    from node.roles.core import start_metrics

    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    cfg = load_config(None, {}, {"data_dir": str(tmp_path), "metrics_port": port, "metrics_listen": "127.0.0.2"})

    class Node:
        config = cfg
        metrics = Metrics()

    stop = start_metrics(Node)
    try:
        body = await trio.to_thread.run_sync(
            lambda: urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=10).read().decode())
        assert "process_resident_memory_bytes" in body
        with pytest.raises(OSError):  # nothing listens on the default address
            await trio.to_thread.run_sync(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10))
    finally:
        stop()

"""A worker's HTTP port answers before it serves: /ready is 503 with each rank's loading
progress, /metrics has it per rank; once serving /ready is 200; a taken port is named."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from common.rpc.status import Status
from common.runtime.load_meter import LoadMeter, RankLoad
from common.runtime.ports import PortInUse, PortUse, free_port, port_in_use

HOST = "127.0.0.1"
GIB = 2**30


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_ready_says_which_rank_loads_then_serving() -> None:
    meter = LoadMeter()
    meter.expect(8 * GIB)
    meter.add(2 * GIB)
    meter.follow(lambda: [RankLoad(1, 6 * GIB, 8 * GIB), RankLoad(2, 8 * GIB, 8 * GIB, True)])
    use = PortUse(free_port(), "the test's metrics", "TPLA_TEST_METRICS_PORT")
    status = Status.open(HOST, use, CollectorRegistry(), meter, "prefill worker")
    try:
        code, body = _get(use.port, "/ready")
        assert code == 503
        assert body.strip() == (
            "prefill worker loading: rank 0 2.00 GiB of ~8.00 GiB (25%), "
            "rank 1 6.00 GiB of ~8.00 GiB (75%), rank 2 loaded (8.00 GiB)"
        )
        code, metrics = _get(use.port, "/metrics")
        assert code == 200
        assert 'tpla:loading_read_bytes{rank="1"} 6.442450944e+09' in metrics
        assert 'tpla:loading_share_bytes{rank="0"} 8.589934592e+09' in metrics
        assert 'tpla:loading_done{rank="2"} 1.0' in metrics
        meter.finish()
        meter.follow(lambda: [RankLoad(1, 8 * GIB, 8 * GIB, True)])
        assert status.not_ready_reason() == (
            "prefill worker starting: every rank loaded "
            "(rank 0 loaded (2.00 GiB), rank 1 loaded (8.00 GiB))"
        )
        status.serving()
        assert _get(use.port, "/ready") == (200, "serving\n")
    finally:
        status.stop()
    assert not port_in_use(HOST, use.port)


def test_a_taken_port_is_named() -> None:
    use = PortUse(free_port(), "the test's metrics", "TPLA_TEST_METRICS_PORT")
    holder = socket.socket()
    holder.bind((HOST, use.port))
    holder.listen()
    try:
        with pytest.raises(PortInUse, match="TPLA_TEST_METRICS_PORT"):
            Status.open(HOST, use, CollectorRegistry(), LoadMeter(), "decode leader")
    finally:
        holder.close()

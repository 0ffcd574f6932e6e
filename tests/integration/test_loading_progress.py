"""A group's leader shows its loading before it serves: its metrics port is open from the
start, /ready there says which rank has joined and how far each has read of its share, the
registry holds a record that says it loads (unhealthy, so no router sends it work, and the
router's /ready reason names it); once every rank has loaded, the log says so, /ready is 200,
the metrics hold each rank's bytes read and the record is the serving one.

A prefill group of two ranks each started on its own (`tpla prefill --rank K`), the second
started late, as a slow pod would be; and a spawned decode group of two in this process."""

from __future__ import annotations

import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common.parallel import ParallelConfig
from common.rpc.server import Lifetime
from common.runtime.ports import SERVICE_PORT_OFFSETS, free_port, kv_port_offsets
from common.runtime.redis_state import WorkerRegistry, WorkerRole
from services.decode.config import EngineConfig
from services.decode.service import serve_decode
from services.router.policy import WorkerSnapshot
from services.stack.embedded_redis import EmbeddedRedis
from tests.joined_ranks import rank_starter
from tests.tiny import save_hf

METRICS_OFFSET = 1000  # common/runtime/metrics: a worker's HTTP port is its gRPC port + 1000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("loading-model")
    save_hf("v2-greedy", path, vocab_size=321)
    return path


@pytest.fixture
def redis_url() -> Iterator[str]:
    with EmbeddedRedis(free_port()) as server:
        yield server.url


@pytest.fixture
def start_rank(model_dir: Path, tmp_path: Path, redis_url: str) -> Iterator:
    base = {"REPARAM": "", "PREFILL_TP": "2", "HEARTBEAT_S": "0.5"}
    yield from rank_starter("prefill", model_dir, tmp_path, base)


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def _wait(check, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while (value := check()) is None:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return value


def _metric(text: str, name: str, rank: int) -> float:
    prefix = f'{name}{{rank="{rank}"}} '
    return float(next(line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)))


def test_a_prefill_group_shows_a_rank_that_has_not_joined_then_its_progress(
    start_rank, redis_url: str
) -> None:
    port, rendezvous = free_port(SERVICE_PORT_OFFSETS), free_port()
    status_port = port + METRICS_OFFSET
    leader = start_rank(0, rendezvous, PREFILL_PORT=str(port), REDIS_URL=redis_url)

    def waiting() -> str | None:
        code, body = _get(status_port, "/ready")
        return body if code == 503 and "rank 1 not joined yet" in body else None

    assert _wait(waiting).startswith("prefill worker loading: rank 0 ")
    registry = WorkerRegistry(redis.Redis.from_url(redis_url))
    (record,) = _wait(
        lambda: [r for r in registry.list(WorkerRole.PREFILL) if "not joined" in r.loading] or None
    )
    assert not record.healthy and record.loading.endswith("rank 1 not joined yet")
    reason = WorkerSnapshot.from_records([record]).not_ready_reason()
    assert reason == (
        "no healthy decode group or prefill worker is registered "
        f"({record.worker_id} loading: {record.loading})"
    )
    follower = start_rank(1, rendezvous, REDIS_URL=redis_url)
    leader.wait_for("a group of 2 ranks")
    assert _get(status_port, "/ready") == (200, "serving\n")
    log = leader.text()
    assert "prefill worker loaded: rank 0 loaded (" in log and "rank 1 loaded (" in log
    _, metrics = _get(status_port, "/metrics")
    for rank in (0, 1):
        assert _metric(metrics, "tpla:loading_done", rank) == 1.0
        read = _metric(metrics, "tpla:loading_read_bytes", rank)
        share = _metric(metrics, "tpla:loading_share_bytes", rank)
        assert 0.5 * share < read < 2.0 * share, (rank, read, share)
    (record,) = _wait(lambda: [r for r in registry.list(WorkerRole.PREFILL) if r.healthy] or None)
    assert record.loading == ""
    leader.proc.send_signal(signal.SIGINT)
    assert leader.wait(30) == 0, leader.text()
    assert follower.wait(30) in (0, 1), follower.text()


def test_a_decode_leader_reports_every_rank_loaded(model_dir: Path) -> None:
    port, stop, ready = free_port(SERVICE_PORT_OFFSETS), threading.Event(), threading.Event()
    cfg = EngineConfig(
        model=str(model_dir),
        master_port=free_port(),
        kv_budget_mb=2,
        kv_port_base=free_port(kv_port_offsets(2)),
        parallel=ParallelConfig(tp=2, latent_groups=2),
    )
    thread = threading.Thread(
        target=serve_decode,
        args=(cfg, port, Lifetime()),
        kwargs={"ready": ready, "stop": stop},
        daemon=True,
    )
    thread.start()
    try:
        assert ready.wait(180)
        assert _get(port + METRICS_OFFSET, "/ready") == (200, "serving\n")
        _, metrics = _get(port + METRICS_OFFSET, "/metrics")
        for rank in (0, 1):
            assert _metric(metrics, "tpla:loading_done", rank) == 1.0
            read = _metric(metrics, "tpla:loading_read_bytes", rank)
            share = _metric(metrics, "tpla:loading_share_bytes", rank)
            assert 0.5 * share < read < 2.0 * share, (rank, read, share)
    finally:
        stop.set()
        thread.join(60)

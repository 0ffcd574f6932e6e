"""`tpla prefill`: a prefill worker serving the Prefill gRPC API, or (with --rank K > 0) one
follower rank of a prefill group whose ranks are started on their own.

Lifecycle: open its metrics port (/metrics, /ready: each rank's loading progress) -> load
the model in the decode group's latent basis (or start the prefill group it leads), its
progress logged and published as a record that says it loads -> serve Prefill / GetLoad ->
publish a registry record (queued tokens) with heartbeats -> on SIGTERM drain: report itself
draining (routers send nothing new here), refuse new prefills (a router tries another
worker), finish the queued and running ones with their KV pushes, for at most
TPLA_DRAIN_GRACE_S -> stop. SIGINT, or a second SIGTERM, skips
the drain; a failed group ends it with exit code 1. A port in use stops it before the model
loads, named with its setting. The parts live in services/prefill/server/; the serving loop
is common/rpc/server.py's.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
from prometheus_client import CollectorRegistry

from common.loading.loader import serving_dtype
from common.loading.serving_kernels import PrefillKernels
from common.rpc.clients import CHANNEL_OPTIONS
from common.rpc.drain import DrainGate
from common.rpc.gen import prefill_pb2_grpc
from common.rpc.server import Lifetime, Service, loading, serve
from common.rpc.status import Status
from common.runtime.device import rank_device
from common.runtime.kernel_choice import log_choices, summary
from common.runtime.load_meter import LoadMeter
from common.runtime.metrics import PrefillMetrics, kernel_info
from common.runtime.ports import check_ports, prefill_worker_ports
from common.runtime.redis_state import WorkerRecord
from common.runtime.tracing import setup_tracing
from services.prefill.config import PrefillConfig
from services.prefill.group.follower import follower_main
from services.prefill.group.rank_loader import load_group_rank
from services.prefill.server.records import loading_record, worker_record
from services.prefill.server.servicer import PrefillServicer
from services.prefill.server.start import start_worker
from services.prefill.worker import PrefillWorker


def serve_prefill(
    cfg: PrefillConfig,
    port: int,
    life: Lifetime,
    *,
    ready: threading.Event | None = None,
    stop: threading.Event | None = None,
    drain: threading.Event | None = None,
) -> int:
    """Run one prefill worker until SIGINT/SIGTERM (or `stop`, or `drain` and its drain);
    blocks. The exit code: 0 after a requested stop or a drain, 1 when its prefill group
    failed. PortInUse (a ValueError) if its gRPC or metrics port is taken."""
    grpc_use, metrics_use = prefill_worker_ports(port)
    host = cfg.group.host
    check_ports(host, [grpc_use, metrics_use])  # before the model loads
    spans = setup_tracing("tpla-prefill")
    worker_id = f"prefill-{uuid.uuid4().hex[:8]}"
    cfg = replace(cfg, group=replace(cfg.group, worker_id=worker_id))
    group = cfg.group
    # Rank 0's, as its load chooses them (each rank chooses alike), before anything loads:
    # a kernel named that cannot run here stops the worker now.
    kernels = PrefillKernels.select(
        group.kernels, rank_device(group.device, 0), serving_dtype(group.dtype)
    )
    registry = CollectorRegistry()
    kernel_info(registry, kernels.choices)
    address = f"{host}:{port}"
    status = Status.open(host, metrics_use, registry, LoadMeter(), "prefill worker")

    def loading_records() -> list[WorkerRecord]:
        return [loading_record(group, address, status.meter.summary())]

    try:
        with loading(status, life, loading_records):
            worker = start_worker(cfg, PrefillMetrics(registry))
    except BaseException:
        status.stop()
        raise
    server = grpc.server(ThreadPoolExecutor(max_workers=64), options=CHANNEL_OPTIONS)
    gate = DrainGate(f"prefill worker {worker_id}")
    prefill_pb2_grpc.add_PrefillServicer_to_server(
        PrefillServicer(worker, cfg.group.token, spans, gate), server
    )
    service = Service(
        name="prefill worker",
        work="prefills queued or running",
        server=server,
        host=host,
        grpc_port=grpc_use,
        status=status,
        records=lambda: [worker_record(worker, cfg.group, address, gate.closed)],
        failure=lambda: _failure(worker),
        close_admission=gate.close,
        running=lambda: gate.inside,
        close=worker.close,
    )
    tp = f", a group of {cfg.group.tp} ranks" if cfg.group.tp > 1 else ""
    log_choices(kernels.choices)
    banner = (
        f"prefill worker {worker_id} serving on {address} ({cfg.group.transport} KV transport"
        f"{tp}; kernels: {summary(kernels.choices)})"
    )
    return serve(service, life, banner, ready=ready, stop=stop, drain=drain)


def _failure(worker: PrefillWorker) -> BaseException | None:
    """Why the worker can serve no more: its prefill group failed (a rank died, also one that
    died while the group was idle)."""
    worker.runner.check()
    return worker.runner.failed


def serve_rank(cfg: PrefillConfig, rank: int) -> int:
    """`tpla prefill --rank K` with K > 0: one follower rank of a prefill group whose ranks are
    started on their own, until its group ends (services/prefill/group/follower.py)."""
    return follower_main(cfg.group, rank, load_group_rank)

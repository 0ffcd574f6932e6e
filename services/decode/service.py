"""`tpla decode`: the decode group's leader process, serving the Decode gRPC API, or (with
--rank K > 0) one follower rank of a group whose ranks are started on their own.

Leader lifecycle: open its metrics port (/metrics, /ready: each rank's loading progress) ->
start the rank group (followers are child processes, or ranks that join over the network),
its progress logged and published as a record that says it loads -> serve Reserve /
Generate / Abort / GetLoad and its KV receiver ->
publish one registry record per rank with heartbeats -> on SIGTERM drain: report itself
draining (routers place nothing new here), refuse Reserve (a router tries another group),
let the admitted requests run to their end, for at most TPLA_DRAIN_GRACE_S -> stop
accepting, abort what is left (its routers migrate it), shut the group down. SIGINT, or a
second SIGTERM, skips the drain. A port in use stops it before it starts, named with its
setting; SIGTERM/SIGINT during start-up end it at once, leaving no shared-memory file behind.
A follower runs until its group ends (services/decode/group/follower.py): a spawned one
ignores signals (its leader ends it), one started on its own waits out its leader's drain on
SIGTERM and ends at once on SIGINT. The parts live in services/decode/server/.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client import CollectorRegistry

from common.rpc.clients import CHANNEL_OPTIONS
from common.rpc.gen import decode_pb2_grpc
from common.rpc.server import Lifetime, Service, loading, serve
from common.rpc.status import Status
from common.runtime.kernel_choice import log_choices, summary
from common.runtime.load_meter import LoadMeter
from common.runtime.ports import PortUse, check_ports, decode_group_ports
from common.runtime.redis_state import WorkerRecord
from common.runtime.tracing import setup_tracing
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from services.decode.group.follower import follower_main
from services.decode.server.metrics import register_decode_metrics
from services.decode.server.records import loading_record, rank_records
from services.decode.server.servicer import DecodeServicer
from services.decode.server.signals import FOLLOWER_SHUTDOWN_S, signals_end_at_once
from services.decode.stream import EngineError


def serve_decode(
    cfg: EngineConfig,
    port: int,
    life: Lifetime,
    *,
    ready: threading.Event | None = None,
    stop: threading.Event | None = None,
    drain: threading.Event | None = None,
) -> int:
    """Run the leader until SIGINT/SIGTERM (or `stop`, or `drain` and its drain); blocks.
    Returns the exit code: 0 after a requested stop or a drain, 1 when the group failed (a
    rank died or a collective timed out), so a supervisor restarts the whole group. PortInUse
    (a ValueError) if a port of the group is taken: checked before the group starts, so
    nothing is loaded or spawned."""
    # Ranks that join from elsewhere bind their own ports; the rendezvous is the group's.
    local_ranks = cfg.per_host
    ports = decode_group_ports(port, cfg.kv_port_base, cfg.master_port, local_ranks)
    if local_ranks < cfg.parallel.tp:
        ports.append(PortUse(cfg.master_port, "decode rendezvous", "TPLA_GROUP_ADDR"))
    check_ports(cfg.host, ports)
    spans = setup_tracing("tpla-decode")  # the leader's alone: the other ranks add nothing
    address = f"{cfg.advertise_host or cfg.host}:{port}"
    group_id = f"decode-{uuid.uuid4().hex[:8]}"
    registry = CollectorRegistry()
    status = Status.open(cfg.host, ports[1], registry, LoadMeter(), "decode leader")

    def loading_records() -> list[WorkerRecord]:
        return [loading_record(cfg, address, group_id, status.meter.summary())]

    try:
        with signals_end_at_once(), loading(status, life, loading_records):
            engine = DecodeEngine(cfg)
    except BaseException:
        status.stop()
        raise
    register_decode_metrics(engine, registry)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=cfg.max_batch * 2 + 16), options=CHANNEL_OPTIONS
    )
    decode_pb2_grpc.add_DecodeServicer_to_server(
        DecodeServicer(engine, cfg.internal_token, spans), server
    )

    def live() -> int | None:
        try:
            return engine.live(timeout=1.0)
        except EngineError:  # a long step: ask again; a failed loop: nothing left to wait for
            return None if engine.failed is None else 0

    service = Service(
        name="decode leader",
        work="live requests",
        server=server,
        host=cfg.host,
        grpc_port=ports[0],
        status=status,
        records=lambda: rank_records(engine, address, group_id, cfg.model),
        failure=lambda: engine.failed,
        close_admission=engine.drain,
        running=live,
        close=engine.shutdown,
        poll_s=0.2,
    )
    log_choices(engine.runtime.kernels)
    banner = (
        f"decode leader serving on {address} (tp={cfg.parallel.tp}, "
        f"r={cfg.parallel.latent_groups}, {engine.pool.num_blocks} KV blocks; kernels: "
        f"{summary(engine.runtime.kernels)})"
    )
    return serve(service, life, banner, ready=ready, stop=stop, drain=drain)


def serve_rank(cfg: EngineConfig, rank: int, drain_grace_s: float = 25.0) -> int:
    """`tpla decode --rank K` with K > 0: one follower rank, started on its own, until its
    group ends. The exit code: 0 when the leader ended the group, 2 after a start-up error
    it printed (and reported to the leader), 1 when the leader or a collective failed.

    Kubernetes sends SIGTERM to every pod of a group at once: this rank then keeps serving
    its leader's drain, ending with the group (or at once after the drain and the leader's
    shutdown would have ended)."""
    with signals_end_at_once(term_grace_s=drain_grace_s + FOLLOWER_SHUTDOWN_S):
        return follower_main(cfg, rank)

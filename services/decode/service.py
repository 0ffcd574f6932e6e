"""`tpla decode`: the decode group's leader process, serving the Decode gRPC API, or (with
--rank K > 0) one follower rank of a group whose ranks are started on their own.

Leader lifecycle: start the rank group (followers are child processes, or ranks that join
over the network) -> serve Reserve / Generate / Abort / GetLoad and its KV receiver ->
publish one registry record per rank with heartbeats -> on SIGTERM/SIGINT stop accepting,
abort live requests, shut the group down. A port in use stops it before it starts, named
with its setting; SIGTERM/SIGINT during start-up end it at once, leaving no shared-memory
file behind. A follower runs until its group ends (services/decode/group/follower.py);
SIGTERM/SIGINT end it at once.
The servicer only translates protocol types; the engine holds all the logic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import redis
from prometheus_client import CollectorRegistry

from common.kv.block_pool import OutOfBlocks
from common.kv.prefix_cache import PUBLISHED_HASHES, format_hashes
from common.rpc.auth import require_token
from common.rpc.clients import CHANNEL_OPTIONS
from common.rpc.convert import (
    ReservationInfo,
    load_to_pb,
    params_from_pb,
    reservation_to_pb,
    token_from_pb,
    token_to_pb,
)
from common.rpc.gen import common_pb2, decode_pb2, decode_pb2_grpc
from common.runtime import group_files
from common.runtime.errors import InvalidRequest, Overloaded, TplaError, Unavailable
from common.runtime.metrics import (
    PREFIX_CACHE_HELP,
    CounterCallback,
    DecodeMetrics,
    GaugeCallback,
    serve_metrics,
)
from common.runtime.ports import PortUse, bind_grpc, check_ports, decode_group_ports
from common.runtime.redis_state import Heartbeat, WorkerRecord, WorkerRegistry, WorkerRole
from common.sampling.sampler import SamplingError
from services.decode.config import EngineConfig, Launch
from services.decode.engine import DecodeEngine
from services.decode.group.follower import follower_main
from services.decode.scheduler import SchedulerError
from services.decode.stream import EngineError

T = TypeVar("T")


def as_tpla_error(exc: Exception) -> TplaError:
    """Engine exceptions as the typed errors that map to gRPC codes in one place."""
    if isinstance(exc, TplaError):
        return exc
    if isinstance(exc, OutOfBlocks):
        return Overloaded(f"KV cache full: {exc}")
    if isinstance(exc, SchedulerError | SamplingError | ValueError):
        return InvalidRequest(str(exc))
    if isinstance(exc, EngineError):
        return Unavailable(str(exc))
    return TplaError(str(exc))


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: DecodeEngine, token: str | None = None) -> None:
        self.engine = engine
        self.token = token

    def _guard(self, context: grpc.ServicerContext) -> None:
        require_token(context, self.token)

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        """Check the caller, run an engine call; any failure aborts with its typed status."""
        self._guard(context)
        try:
            return fn()
        except Exception as exc:  # every failure becomes a typed status
            err = as_tpla_error(exc)
            context.abort(err.grpc_code, err.message)
            raise  # unreachable: abort raises; kept so the type checker sees no fall-through

    def Reserve(
        self, request: decode_pb2.ReserveRequest, context: grpc.ServicerContext
    ) -> decode_pb2.ReserveResponse:
        res = self._call(
            context,
            lambda: self.engine.reserve(
                request.request_id,
                request.prompt_len,
                request.max_tokens,
                request.prompt_ids,
                request.n or 1,
            ),
        )
        cfg = self.engine.cfg
        layout = self.engine.runtime.layout
        info = ReservationInfo(
            request_id=res.request_id,
            block_size=res.block_size,
            num_layers=layout.num_layers,
            rope_width=layout.rope_width,
            dtype=cfg.dtype,
            lease_seconds=cfg.lease_seconds,
            targets=tuple(self.engine.kv_targets(res, request.prompt_len)),
            cached_tokens=res.cached_tokens,
        )
        return reservation_to_pb(info)

    def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.GenerateEvent]:
        rid = request.request_id
        firsts = list(request.first_tokens) or [request.first_token]
        stream = self._call(
            context,
            lambda: self.engine.generate(
                rid,
                [token_from_pb(t).token_id for t in firsts],
                params_from_pb(request.params),
                prompt_ids=request.prompt_ids,
                output_ids=request.output_ids,
            ),
        )
        # A client that goes away (router abort, disconnect) frees the request's blocks.
        context.add_callback(lambda: self._abort_quietly(rid))
        for event in stream:
            msg = decode_pb2.GenerateEvent(
                finish_reason=event.finish_reason or "", index=event.index
            )
            if event.token is not None:
                msg.token.CopyFrom(token_to_pb(event.token))
            yield msg

    def _abort_quietly(self, request_id: str) -> None:
        # The group may be gone; its requests then already ended with an error.
        with contextlib.suppress(EngineError):
            self.engine.abort(request_id)

    def Abort(
        self, request: decode_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> decode_pb2.AbortResponse:
        choices = frozenset(request.choices) or None
        found = self._call(context, lambda: self.engine.abort(request.request_id, choices))
        return decode_pb2.AbortResponse(found=found)

    def GetLoad(
        self, request: common_pb2.Empty, context: grpc.ServicerContext
    ) -> decode_pb2.DecodeLoad:
        load = self._call(context, self.engine.load)
        par = self.engine.cfg.parallel
        layout = {"tp": par.tp, "latent_groups": par.latent_groups, "parallel": par.name}
        return load_to_pb(dataclasses.replace(load, **layout))


# A decode step this long means a rank hangs (a step takes milliseconds to a second): the
# group reports unhealthy so routers stop sending it work while its collective times out.
STALLED_STEP_S = 10.0


def rank_records(
    engine: DecodeEngine, address: str, group_id: str, model: str
) -> list[WorkerRecord]:
    """One registry record per rank process of the group (the leader reports for all)."""
    stalled = engine.step_running_for() >= STALLED_STEP_S
    try:
        # Bounded: a loop stuck in a collective must not stop the heartbeat that reports it.
        load = engine.load(timeout=1.0)
        used, total, cached = load.blocks_used, load.blocks_total, load.blocks_cached
        hashes = engine.cached_hashes(PUBLISHED_HASHES, 1.0) if engine.cfg.prefix_cache else []
    except EngineError:
        used, total, cached, stalled = 0, engine.pool.num_blocks, 0, True
        hashes = []
    par = engine.cfg.parallel
    pids = [os.getpid(), *engine.follower_pids]
    alive = engine.follower_alive()
    return [
        WorkerRecord(
            worker_id=f"{group_id}/rank{rank}",
            role=WorkerRole.DECODE,
            address=address,
            rank=rank,
            pid=pid,
            group_id=group_id,
            healthy=ok and engine.failed is None and not stalled,
            kv_blocks_used=used,
            kv_blocks_total=total,
            tp=par.tp,
            latent_groups=par.latent_groups,
            parallel=par.name,
            model=model,
            kv_blocks_cached=cached,
            block_size=engine.cfg.block_size,
            # The leader's record carries the group's prefix (the router reads rank 0's).
            prefix_root=f"{engine.prefix_root:x}" if rank == 0 and engine.cfg.prefix_cache else "",
            prefix_hashes=format_hashes(hashes) if rank == 0 else "",
        )
        for rank, (pid, ok) in enumerate(zip(pids, alive, strict=True))
    ]


def _serve_decode_metrics(engine: DecodeEngine, host: str, port: int) -> None:
    registry = CollectorRegistry()
    histogram = DecodeMetrics(registry).step_seconds
    engine.on_step = lambda seconds, _batch: histogram.observe(seconds)

    def read() -> dict[str, float]:
        load = engine.load()
        steps = list(engine.step_seconds)[-20:]
        return {
            "tpla:num_requests_running": load.running,
            "tpla:num_requests_waiting": load.waiting,
            "tpla:kv_cache_usage_ratio": load.usage_ratio,
            "tpla:kv_blocks_total": load.blocks_total,
            "tpla:kv_blocks_used": load.blocks_used,
            "tpla:kv_blocks_cached": load.blocks_cached,
            "tpla:decode_step_seconds_recent": sum(steps) / len(steps) if steps else 0.0,
        }

    registry.register(
        GaugeCallback(
            read,
            {
                "tpla:kv_cache_usage_ratio": "fraction of KV blocks in use on each rank",
                "tpla:decode_step_seconds_recent": "mean time of the last 20 decode steps",
                "tpla:kv_blocks_used": "KV blocks live requests hold",
                "tpla:kv_blocks_cached": "cached prefix blocks no live request holds",
            },
        )
    )

    def counters() -> dict[str, float]:
        load = engine.load(timeout=1.0)
        return {
            "tpla:prefix_cache_queries": load.prefix_queried_tokens,
            "tpla:prefix_cache_hits": load.prefix_hit_tokens,
        }

    registry.register(CounterCallback(counters, PREFIX_CACHE_HELP))
    serve_metrics(registry, host, port)


@contextlib.contextmanager
def _signals_end_at_once() -> Iterator[None]:
    """Inside, SIGTERM / SIGINT end this process at once, after removing its group's
    shared-memory file (its followers then see it gone and exit): a leader while its group
    starts, a follower started on its own for its whole life.

    A Python signal handler would wait for the main thread, which may sit in the group's
    rendezvous or barrier for up to the collective timeout: longer than a pod's grace period,
    after which everything is SIGKILLed (and a pod's pid 1 ignores SIGTERM without a
    handler). The wake-up fd is written by the C-level handler at once; a thread acts on it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    ending = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in ending}
    previous_fd = signal.set_wakeup_fd(write_fd)

    def watch() -> None:
        while True:
            byte = os.read(read_fd, 1)
            if byte == _START_UP_DONE:
                return
            if byte[0] in ending:
                group_files.remove_files_of(os.getpid())
                os._exit(128 + byte[0])

    watcher = threading.Thread(target=watch, name="start-up-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.write(write_fd, _START_UP_DONE)
        watcher.join()
        os.close(read_fd)
        os.close(write_fd)


_START_UP_DONE = b"\0"  # no signal has number 0


def serve_decode(
    cfg: EngineConfig,
    port: int,
    redis_url: str | None,
    *,
    heartbeat_s: float = 2.0,
    worker_ttl_s: float = 10.0,
    ready: threading.Event | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Run the leader until SIGINT/SIGTERM (or `stop`); blocks. Returns the exit code: 0
    after a requested stop, 1 when the group failed (a rank died or a collective timed
    out), so a supervisor restarts the whole group. PortInUse (a ValueError) if a port of
    the group is taken: checked before the group starts, so nothing is loaded or spawned."""
    # Ranks that join from elsewhere bind their own ports; the rendezvous is the group's.
    local_ranks = cfg.parallel.tp if cfg.launch is Launch.SPAWN else 1
    ports = decode_group_ports(port, cfg.kv_port_base, cfg.master_port, local_ranks)
    if local_ranks < cfg.parallel.tp:
        ports.append(PortUse(cfg.master_port, "decode rendezvous", "TPLA_GROUP_ADDR"))
    check_ports(cfg.host, ports)
    with _signals_end_at_once():
        engine = DecodeEngine(cfg)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=cfg.max_batch * 2 + 16), options=CHANNEL_OPTIONS
    )
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(engine, cfg.internal_token), server)
    address = f"{cfg.advertise_host or cfg.host}:{port}"
    grpc_use, metrics_use = ports[:2]
    try:
        bind_grpc(server, cfg.host, grpc_use)
        server.start()
        try:
            _serve_decode_metrics(engine, cfg.host, metrics_use.port)
        except OSError:
            check_ports(cfg.host, [metrics_use])
            raise
    except BaseException:
        server.stop(grace=0)
        engine.shutdown()
        raise
    stop = stop or threading.Event()
    heartbeat = None
    if redis_url:
        group_id = f"decode-{uuid.uuid4().hex[:8]}"
        registry = WorkerRegistry(redis.Redis.from_url(redis_url), ttl_s=worker_ttl_s)
        heartbeat = Heartbeat(
            registry, lambda: rank_records(engine, address, group_id, cfg.model), heartbeat_s
        ).start()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    print(
        f"decode leader serving on {address} (tp={cfg.parallel.tp}, "
        f"r={cfg.parallel.latent_groups}, {engine.pool.num_blocks} KV blocks)",
        flush=True,
    )
    if ready is not None:
        ready.set()
    code = 0
    try:
        while not stop.wait(0.2):
            if engine.failed is not None:
                print(f"decode group failed: {engine.failed}", flush=True)
                code = 1
                break
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        server.stop(grace=2)
        engine.shutdown()
    return code


def serve_rank(cfg: EngineConfig, rank: int) -> int:
    """`tpla decode --rank K` with K > 0: one follower rank, started on its own, until its
    group ends. The exit code: 0 when the leader ended the group, 2 after a start-up error
    it printed (and reported to the leader), 1 when the leader or a collective failed."""
    with _signals_end_at_once():
        return follower_main(cfg, rank)

"""`tpla prefill`: a prefill worker serving the Prefill gRPC API.

Lifecycle: load the model in the decode group's latent basis -> serve Prefill / GetLoad ->
publish a registry record (queued tokens) with heartbeats -> on SIGTERM drain: report itself
draining (routers send nothing new here), refuse new prefills (a router tries another
worker), finish the queued and running ones with their KV pushes, for at most
TPLA_DRAIN_GRACE_S -> stop. SIGINT, or a second SIGTERM, skips the drain.
A port in use stops it before the model loads, named with its setting.
The servicer only translates protocol types; `PrefillWorker` does the work.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import grpc
import redis
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from common.kv.prefix_cache import PUBLISHED_HASHES, format_hashes, model_identity
from common.kv.transfer import TransferError, make_sender
from common.loading.loader import serving_dtype
from common.loading.serving_kernels import PrefillKernels
from common.loading.serving_model import load_prefill_model, load_prefill_mtp
from common.rpc.aborted import call_error
from common.rpc.auth import require_token
from common.rpc.clients import CHANNEL_OPTIONS
from common.rpc.convert import params_from_pb, reservation_from_pb, result_to_pb
from common.rpc.drain import DrainGate, wait_drained
from common.rpc.gen import common_pb2, prefill_pb2, prefill_pb2_grpc
from common.rpc.server import start_serving, stop_on_signals
from common.runtime.device import rank_device
from common.runtime.errors import (
    DeadlineExceeded,
    InvalidRequest,
    TplaError,
    TransferFailed,
    Unavailable,
)
from common.runtime.kernel_choice import KernelConfig, log_choices, summary
from common.runtime.metrics import PrefillMetrics, kernel_info, serve_metrics
from common.runtime.ports import check_ports, prefill_worker_ports
from common.runtime.redis_state import Heartbeat, WorkerRecord, WorkerRegistry, WorkerRole
from common.runtime.spans import Spans, end
from common.runtime.tracing import setup_tracing
from common.sampling.grammar import GrammarCompiler
from services.prefill.group.config import PrefillGroupConfig, prefix_cache
from services.prefill.group.leader import GroupRunner
from services.prefill.group.rank_model import load_group_rank
from services.prefill.job_trace import JobTrace
from services.prefill.latent_cache import LatentPrefixCache
from services.prefill.runner import LocalRunner, PrefillRunner
from services.prefill.threads import PrefillThreads
from services.prefill.worker import PrefillJob, PrefillWorker

MAX_CHOICES = 128  # OpenAI's limit on n
MAX_TOP_LOGPROBS = 20


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self,
        worker: PrefillWorker,
        token: str | None = None,
        spans: Spans | None = None,
        gate: DrainGate | None = None,
    ) -> None:
        self.worker = worker
        self.token = token
        self.spans = spans or Spans()
        # Closed when the worker drains: a prefill inside it runs to its last KV push.
        self.gate = gate or DrainGate("the prefill worker")

    def _guard(self, context: grpc.ServicerContext) -> None:
        require_token(context, self.token)

    def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        if not self.spans.on:
            return self._prefill(request, context, None)
        parent = self.spans.parent_from(context.invocation_metadata() or ())
        attributes = {
            "tpla.request_id": request.request_id,
            "tpla.prompt_tokens": len(request.prompt_ids),
            "tpla.n": request.n or 1,
        }
        span = self.spans.start("prefill", parent, attributes, kind=SpanKind.SERVER)
        trace, error = JobTrace(), None
        try:
            return self._prefill(request, context, trace)
        except BaseException as exc:
            error = exc
            raise
        finally:
            trace.record(self.spans, span)
            end(span, error=call_error(context, error))

    def _prefill(
        self,
        request: prefill_pb2.PrefillRequest,
        context: grpc.ServicerContext,
        trace: JobTrace | None,
    ) -> prefill_pb2.PrefillResponse:
        self._guard(context)
        try:
            self.gate.enter()
        except Unavailable as exc:
            context.abort(exc.grpc_code, exc.message)
        try:
            return self._run(request, context, trace)
        finally:
            self.gate.leave()

    def _run(
        self,
        request: prefill_pb2.PrefillRequest,
        context: grpc.ServicerContext,
        trace: JobTrace | None,
    ) -> prefill_pb2.PrefillResponse:
        deadline = request.deadline_seconds or 60.0
        try:
            job = PrefillJob(
                request.request_id,
                list(request.prompt_ids),
                params_from_pb(request.params),
                reservation_from_pb(request.reservation),
                deadline,
                request.num_output_tokens,
                n=request.n or 1,
                prompt_logprobs=(
                    request.prompt_logprobs if request.HasField("prompt_logprobs") else None
                ),
                trace=trace,
            )
            if not 1 <= job.n <= MAX_CHOICES:
                raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}], got {job.n}")
            if job.prompt_logprobs is not None and job.prompt_logprobs > MAX_TOP_LOGPROBS:
                raise InvalidRequest(
                    f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {job.prompt_logprobs}"
                )
            if not job.reservation.targets:
                raise InvalidRequest("no KV targets: reserve on a decode group first")
            pending = self.worker.submit(job)
            # A caller that goes away (the client left, the router gave up) cancels the
            # prompt: the worker computes none of its remaining chunks.
            context.add_callback(pending.cancel)
            try:
                done = pending.result(timeout=deadline)
            finally:
                pending.cancel()
        except CancelledError:
            context.abort(grpc.StatusCode.CANCELLED, f"the prefill of {request.request_id} ended")
        except TimeoutError:
            err: TplaError = DeadlineExceeded(f"prefill of {request.request_id} timed out")
            context.abort(err.grpc_code, err.message)
        except TransferError as exc:
            err = TransferFailed(str(exc))
            context.abort(err.grpc_code, err.message)
        # Unavailable: this worker stopped, or its prefill group failed (another may not).
        except (InvalidRequest, Unavailable, ValueError) as exc:
            err = exc if isinstance(exc, TplaError) else InvalidRequest(str(exc))
            context.abort(err.grpc_code, err.message)
        return result_to_pb(done)

    def GetLoad(
        self, request: common_pb2.Empty, context: grpc.ServicerContext
    ) -> prefill_pb2.PrefillLoad:
        self._guard(context)  # the load is internal state too (the router sends the token)
        return prefill_pb2.PrefillLoad(
            queued_requests=self.worker.queued_requests, queued_tokens=self.worker.queued_tokens
        )


def _published(cache: LatentPrefixCache | None) -> dict[str, Any]:
    """The registry record's prefix fields: the latent cache's root, block size and most
    recently used block hashes, for KV-aware routing of prefills."""
    if cache is None:
        return {}
    return {
        "prefix_root": f"{cache.root:x}",
        "block_size": cache.block_size,
        "prefix_hashes": format_hashes(cache.recent(PUBLISHED_HASHES)),
    }


def serve_prefill(
    model_dir: str,
    reparam: str | None,
    host: str,
    port: int,
    redis_url: str | None,
    *,
    transport: str = "grpc",
    token: str | None = None,
    dtype: str = "float32",
    weight_dtype: str = "auto",
    device: str = "cpu",
    heartbeat_s: float = 2.0,
    worker_ttl_s: float = 10.0,
    drain_grace_s: float = 25.0,
    transfer_timeout_s: float = 30.0,
    kernels: KernelConfig | None = None,
    threads: PrefillThreads | None = None,
    max_batch_tokens: int = 2048,
    chunk_tokens: int | None = None,
    prefix_cache_mb: float = 0.0,
    stop: threading.Event | None = None,
    drain: threading.Event | None = None,
    group: PrefillGroupConfig | None = None,
    mtp: bool = False,
) -> int:
    """Run one prefill worker until SIGINT/SIGTERM (or `stop`, or `drain` and its drain);
    blocks; the exit code (1: its prefill group failed). `group`: run its batches on a
    prefill group of `group.tp` ranks (its model settings are the group's). `mtp`: the
    decode groups run MTP drafts (TPLA_SPECULATIVE=mtp): the MTP layer's prompt latents go
    with the others, the last hidden state with the first token. PortInUse (a ValueError) if
    its gRPC or metrics port is taken."""
    grpc_use, metrics_use = prefill_worker_ports(port)
    check_ports(host, [grpc_use, metrics_use])  # before the model loads
    spans = setup_tracing("tpla-prefill")
    worker_id = f"prefill-{uuid.uuid4().hex[:8]}"
    runner: PrefillRunner
    if group is not None and (group.tp > 1 or not group.spawned):
        group = replace(group, worker_id=worker_id, mtp=mtp)
        # Rank 0's, as its load chooses them (each rank chooses alike).
        rank0 = rank_device(group.device, 0)
        chosen = PrefillKernels.select(group.kernels, rank0, serving_dtype(group.dtype))
        runner = GroupRunner.start(group, load_group_rank)
        cache = prefix_cache(group)
    else:
        chosen = PrefillKernels.select(kernels or KernelConfig(), device, serving_dtype(dtype))
        model = load_prefill_model(model_dir, reparam, dtype, kernels, device, weight_dtype)
        layer = None
        if mtp:
            layer = load_prefill_mtp(model_dir, reparam, model, dtype, device, weight_dtype)
        runner = LocalRunner(model, make_sender(transport, worker_id, token), layer)
        budget = int(prefix_cache_mb * 2**20)
        identity = model_identity(model_dir, reparam)
        cache = LatentPrefixCache(identity, budget) if budget > 0 else None
    registry = CollectorRegistry()
    kernel_info(registry, chosen.choices)
    config = runner.config
    worker = PrefillWorker(
        runner,
        metrics=PrefillMetrics(registry),
        transfer_timeout_s=transfer_timeout_s,
        threads=threads,
        max_batch_tokens=max_batch_tokens,
        chunk_tokens=chunk_tokens,
        grammars=GrammarCompiler.from_model_dir(model_dir, config.vocab_size, config.eos_token_ids),
        prefix_cache=cache,
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=64), options=CHANNEL_OPTIONS)
    gate = DrainGate(f"prefill worker {worker_id}")
    prefill_pb2_grpc.add_PrefillServicer_to_server(
        PrefillServicer(worker, token, spans, gate), server
    )
    address = f"{host}:{port}"
    try:
        start_serving(
            server,
            host,
            grpc_use,
            metrics_use,
            lambda metrics_port: serve_metrics(registry, host, metrics_port),
        )
    except BaseException:
        worker.close()
        raise
    stop = stop or threading.Event()
    drain = drain or threading.Event()
    heartbeat = None
    if redis_url:
        registry = WorkerRegistry(redis.Redis.from_url(redis_url), ttl_s=worker_ttl_s)
        heartbeat = Heartbeat(
            registry,
            lambda: [
                WorkerRecord(
                    worker_id=worker_id,
                    role=WorkerRole.PREFILL,
                    address=address,
                    pid=os.getpid(),
                    queued_tokens=worker.queued_tokens,
                    model=model_dir,
                    draining=gate.closed,
                    healthy=runner.failed is None,
                    tp=group.tp if group is not None else 1,
                    **_published(worker.prefix_cache),
                )
            ],
            heartbeat_s,
        ).start()
    stop_on_signals(stop, drain)
    tp = f", a group of {group.tp} ranks" if group is not None and group.tp > 1 else ""
    log_choices(chosen.choices)
    print(
        f"prefill worker {worker_id} serving on {address} ({transport} KV transport{tp}; "
        f"kernels: {summary(chosen.choices)})",
        flush=True,
    )
    code = 0
    try:
        while not stop.wait(0.1):
            runner.check()
            if runner.failed is not None:
                # Unhealthy in the registry at once, then gone: its supervisor restarts it.
                if heartbeat is not None:
                    heartbeat.beat_now()
                print(
                    f"prefill worker {worker_id}: its group failed ({runner.failed}); exiting",
                    file=sys.stderr,
                    flush=True,
                )
                code = 1
                break
            if drain.is_set():
                _drain(gate, heartbeat, drain_grace_s, stop)
                break
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        server.stop(grace=2)
        worker.close()
    return code


def _drain(
    gate: DrainGate, heartbeat: Heartbeat | None, grace_s: float, stop: threading.Event
) -> None:
    """Turn new prefills away and wait (up to `grace_s`, or until `stop`) for the admitted
    ones: queued, running or pushing their KV, each ends when its last shard is acknowledged."""
    inside = gate.close()
    if heartbeat is not None:
        heartbeat.beat_now()  # the routers' next refresh sees the worker draining
    print(
        f"prefill worker draining: {inside} prefills queued or running, up to {grace_s:g} s",
        flush=True,
    )
    if wait_drained(lambda: gate.inside == 0, grace_s, stop):
        print("prefill worker drained", flush=True)
    else:
        print(f"prefill worker: ending {gate.inside} prefills", flush=True)

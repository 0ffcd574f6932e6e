"""The router's HTTP shell: an OpenAI-compatible FastAPI app over the request pipeline.

Lifecycle of the app: `create_app` loads the tokenizer, context limit and the model's
sampling defaults (GET /v1/models shows them) and wires Redis,
the worker directory, the routing policy and the metrics; startup loads the registry and
starts its background refresh; shutdown stops it and closes every channel and connection.
Routes only translate: body -> GenerationRequest (prepare.py) -> Pipeline.run -> OpenAI
bodies or SSE (chat_format.py, completion_format.py). Every error leaves as an OpenAI error
body (common.runtime.errors).
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

import anyio
import redis
import redis.asyncio as aioredis
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.runtime.errors import NotFound, TplaError
from common.runtime.ports import PortInUse, PortUse, router_port
from common.runtime.redis_state import (
    RequestLog,
    WorkerRecord,
    WorkerRegistry,
    WorkerRole,
    async_client,
    sync_client,
)
from common.runtime.settings import Settings
from common.runtime.spans import Spans
from common.runtime.tracing import setup_tracing
from common.sampling.defaults import load_defaults
from common.sampling.grammar import GrammarCompiler, JsonWhitespace
from common.sampling.grammar_limits import GrammarLimits
from common.text.tokenizer import Tokenizer
from services.router import batch, prepare, response_schemas
from services.router.body_parts import DONE_LINE, sse_error
from services.router.chat_format import REASONING_FIELDS, ChatFormat
from services.router.chat_schemas import ChatCompletionRequest
from services.router.completion_format import CompletionFormat
from services.router.completion_schemas import CompletionRequest
from services.router.config import PipelineConfig
from services.router.disagg_policy import DisaggConfig
from services.router.edge import (
    MAX_BODY_BYTES,
    GuardMiddleware,
    SSEResponse,
    install_error_handlers,
    require_json,
)
from services.router.metrics import RouterMetrics
from services.router.openapi import document_responses
from services.router.pipeline import Pipeline
from services.router.policy import RoutingPolicy, make_policy
from services.router.request import Done, GenerationRequest, Output
from services.router.worker_health import WorkerHealth
from services.router.workers import WorkerDirectory

log = logging.getLogger(__name__)


@dataclass
class RouterState:
    settings: Settings
    info: prepare.ModelInfo
    pipeline: Pipeline
    directory: WorkerDirectory
    requests: RequestLog
    metrics: RouterMetrics
    aredis: aioredis.Redis
    sync_redis: redis.Redis


def _state(request: Request) -> RouterState:
    return request.app.state.router


async def _serve(
    request: Request, reqs: list[GenerationRequest], fmt: ChatFormat | CompletionFormat
) -> Response:
    """Run the requests (one, or a completions batch's prompts) through the pipeline and
    answer with one response: JSON, or SSE when they stream."""
    st = _state(request)
    parent = st.pipeline.spans.parent_from(request.headers)  # the client's traceparent
    runs = [st.pipeline.run(req, parent) for req in reqs]
    await batch.start(runs)  # admission, routing and Reserve succeeded (or raised)
    outputs = batch.merged(runs)

    async def close() -> None:
        await outputs.aclose()
        await batch.close(runs)  # also when the body never started

    if reqs[0].stream:
        return SSEResponse(_sse_body(outputs, fmt), on_close=close)
    collected: list[list[Output]] = [[] for _ in runs]
    finished = False
    error: TplaError | None = None
    try:
        async with anyio.create_task_group() as tg:
            # The client may leave while we wait for the whole completion: watch for it.
            tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
            try:
                async for k, out in outputs:
                    collected[k].append(out)
                finished = True
            except TplaError as exc:  # caught here so it is not wrapped in an ExceptionGroup
                error = exc
            tg.cancel_scope.cancel()
    finally:
        await close()
    if error is not None:
        raise error
    if not finished:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(fmt.full(collected).model_dump(mode="json"))


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _sse_body(
    outputs: AsyncIterator[tuple[int, Output]], fmt: ChatFormat | CompletionFormat
) -> AsyncIterator[str]:
    for line in fmt.opening():
        yield line
    dones: list[Done] = []
    try:
        async for k, out in outputs:
            if isinstance(out, Done):
                dones.append(out)
            for line in fmt.event(k, out):
                yield line
        for line in fmt.closing(dones):
            yield line
    except TplaError as exc:
        yield sse_error(exc)
    yield DONE_LINE


def _worker_json(r: WorkerRecord, quarantined: str | None) -> dict[str, Any]:
    """`quarantined`: why this router quarantined the worker (or its group), if it did."""
    entry: dict[str, Any] = {
        "worker_id": r.worker_id,
        "role": r.role.value,
        "rank": r.rank,
        "pid": r.pid,
        "healthy": r.healthy,
        "quarantined": quarantined,
        "draining": r.draining,
        "address": r.address,
        "group_id": r.group_id,
        "updated_at": r.updated_at,
    }
    if r.role is WorkerRole.DECODE:
        entry |= {
            "kv_blocks_used": r.kv_blocks_used,
            "kv_blocks_cached": r.kv_blocks_cached,
            "kv_blocks_total": r.kv_blocks_total,
        }
    else:
        entry |= {"queued_tokens": r.queued_tokens, "tp": r.tp}  # tp: its prefill group's ranks
    return entry


def _sampling_defaults(info: prepare.ModelInfo) -> response_schemas.SamplingDefaults:
    d = info.defaults
    return response_schemas.SamplingDefaults(
        **asdict(d.sampling()),
        max_tokens=d.max_tokens_for(info.max_model_len - 1),
        source=d.source,
    )


def reasoning_fields(setting: str) -> tuple[str, ...]:
    """`TPLA_REASONING_FIELDS` (both, or one name) as the response fields to fill."""
    return REASONING_FIELDS if setting == "both" else (setting,)


def _readiness(state: RouterState) -> JSONResponse:
    """Ready while a decode group can serve; without a prefill worker to use, its groups
    prefill every prompt: ready, and `degraded` says why."""
    directory = state.directory
    reason = directory.snapshot.not_ready_reason()
    if reason is None:
        degraded = state.pipeline.prefilling.degraded.describe(directory.snapshot)
        if degraded is not None:
            return JSONResponse({"status": "ready", "degraded": degraded})
        return JSONResponse({"status": "ready"})
    if directory.last_error:
        reason = f"{reason} ({directory.last_error})"
    return JSONResponse({"status": "not_ready", "reason": reason}, status_code=503)


def _routes() -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions", dependencies=[Depends(require_json)])
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        st, arrival = _state(request), time.monotonic()
        req = await anyio.to_thread.run_sync(prepare.prepare_chat, body, st.info, arrival)
        fmt = ChatFormat(
            req.request_id,
            st.info.served_name,
            body.logprobs,
            body.include_usage,
            n=req.n,
            calling=req.tools,
            thinking=req.thinking,
            reasoning_fields=reasoning_fields(st.settings.reasoning_fields),
        )
        return await _serve(request, [req], fmt)

    @api.post("/v1/completions", dependencies=[Depends(require_json)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        st, arrival = _state(request), time.monotonic()
        response_id, reqs = await anyio.to_thread.run_sync(
            prepare.prepare_completion, body, st.info, arrival
        )
        want = body.logprobs is not None
        fmt = CompletionFormat(
            response_id, st.info.served_name, want, body.include_usage, reqs[0].n
        )
        return await _serve(request, reqs, fmt)

    @api.get("/v1/models")
    async def models(request: Request) -> response_schemas.ModelList:
        info = _state(request).info
        card = response_schemas.ModelCard(
            id=info.served_name,
            max_model_len=info.max_model_len,
            sampling_defaults=_sampling_defaults(info),
        )
        return response_schemas.ModelList(data=[card])

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        return _readiness(_state(request))

    @api.get("/metrics")
    async def metrics(request: Request) -> Response:
        m = _state(request).metrics
        return Response(m.render(), media_type=m.CONTENT_TYPE)

    @api.get("/admin/requests/{request_id}")
    async def request_record(request_id: str, request: Request) -> dict[str, Any]:
        record = await _state(request).requests.get(request_id)
        if record is None:
            raise NotFound(f"no request {request_id!r}", param="request_id")
        return {"request_id": request_id, **record}

    @api.get("/admin/workers")
    async def workers(request: Request) -> list[dict[str, Any]]:
        directory = _state(request).directory
        records = await directory.refresh()
        quarantined = directory.quarantined()
        return [
            _worker_json(r, quarantined.get(r.group_id or r.worker_id)) for r in records.records
        ]

    return api


def create_app(
    settings: Settings,
    *,
    redis_url: str,
    policy: RoutingPolicy | None = None,
    refresh_s: float = 0.5,
    spans: Spans | None = None,
) -> FastAPI:
    """The router app. `policy` defaults to settings.routing_policy; `refresh_s` paces
    registry reads; `spans`: tracing (off when None)."""
    model_dir = settings.model
    tokenizer = Tokenizer.from_dir(model_dir)
    info = prepare.ModelInfo(
        served_name=settings.served_model_name,
        tokenizer=tokenizer,
        max_model_len=prepare.context_limit(model_dir, settings.max_model_len),
        log_prompts=settings.log_prompts,
        grammars=GrammarCompiler.from_model_dir(
            model_dir,
            tokenizer.vocab_size,
            sorted(tokenizer.eos_token_ids),
            GrammarLimits.from_settings(settings),
        ),
        json_whitespace=JsonWhitespace(settings.json_whitespace),
        defaults=load_defaults(model_dir, settings.generation_config),
        reasoning=prepare.model_reasoning(settings.reasoning_parser, model_dir, tokenizer),
        call_markup=prepare.call_markup(tokenizer),
    )
    log.info("%s", info.defaults.describe())
    token = settings.internal_token.get_secret_value() if settings.internal_token else None
    sync_redis = sync_client(redis_url)
    aredis = async_client(redis_url)
    directory = WorkerDirectory(
        WorkerRegistry(sync_redis, ttl_s=settings.worker_ttl_s), token=token, refresh_s=refresh_s
    )
    requests = RequestLog(aredis)
    metrics = RouterMetrics(settings.served_model_name)
    metrics.registry.register(WorkerHealth(directory))
    pipeline = Pipeline(
        pipeline_config(settings),
        info.tokenizer,
        directory,
        policy or make_policy(settings.routing_policy, settings.overlap_weight),
        requests,
        metrics,
        spans,
        DisaggConfig.parse(
            settings.disagg_policy,
            settings.local_prefill_max_tokens,
            settings.local_prefill_queue_tokens,
        ),
    )
    state = RouterState(settings, info, pipeline, directory, requests, metrics, aredis, sync_redis)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await directory.start()
        try:
            yield
        finally:
            await directory.stop()
            await aredis.aclose()
            sync_redis.close()

    app = FastAPI(title="tpla-serve router", lifespan=lifespan)
    app.state.router = state
    app.include_router(_routes())
    install_error_handlers(app)
    document_responses(app)
    raw_keys = settings.api_keys.get_secret_value() if settings.api_keys else ""
    keys = tuple(k.strip().encode() for k in raw_keys.split(",") if k.strip())
    app.add_middleware(GuardMiddleware, api_keys=keys, max_body=MAX_BODY_BYTES)
    return app


def pipeline_config(settings: Settings) -> PipelineConfig:
    """The request pipeline's limits and timeouts from the settings."""
    return PipelineConfig(
        model=settings.served_model_name,
        transport=settings.transport,
        max_inflight=settings.max_inflight,
        max_waiting=settings.max_waiting,
        queue_timeout_s=settings.queue_timeout_s,
        max_inflight_per_group=settings.max_inflight_per_group,
        request_timeout_s=settings.request_timeout_s,
        token_timeout_s=settings.token_timeout_s,
        migrate=settings.migrate,
        quarantine_s=settings.worker_ttl_s,
        log_prompts=settings.log_prompts,
        prefill_circuit_failures=settings.prefill_circuit_failures,
    )


def run_router(settings: Settings) -> None:
    """Serve the router on settings.host:settings.router_port until interrupted. PortInUse
    (a ValueError) if the port is taken, before the tokenizer loads."""
    if not settings.redis_url:
        raise ValueError("the router needs TPLA_REDIS_URL (or run `tpla serve`)")
    sock = _listen(settings.host, router_port(settings.router_port))
    spans = setup_tracing("tpla-router")
    app = create_app(settings, redis_url=settings.redis_url, spans=spans)
    print(app.state.router.info.defaults.describe(), flush=True)
    # Bound here, not by uvicorn, whose bind failure is a log line and exit 1 that name no
    # setting.
    config = uvicorn.Config(app, host=settings.host, port=settings.router_port, log_level="info")
    print(f"router serving on http://{settings.host}:{settings.router_port}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


def _listen(host: str, use: PortUse) -> socket.socket:
    """A socket bound as uvicorn binds it (SO_REUSEADDR); PortInUse if the port is taken."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, use.port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(host, use) from None
        raise
    return sock


__all__ = ["create_app", "run_router"]

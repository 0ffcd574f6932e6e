"""Router test rig: a real redis-server, real grpc.aio Decode/Prefill servers with scripted
tokens, and the router on a real uvicorn socket, all on 127.0.0.1 in the test's event loop.

The fake services are a deterministic token source, not models: prefill (a prefill worker's,
or a decode group's own) returns the script's first token, decode streams the rest; a
migrated request (its earlier tokens sent along) goes on from the script's next token. They
record what the router sent them (request ids, sampling params, aborts, the internal token)
so tests can check the router's protocol use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
import uvicorn

from common.rpc.clients import TOKEN_METADATA_KEY
from common.rpc.gen import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from common.runtime.ports import free_port
from common.runtime.redis_state import WorkerRecord, WorkerRegistry, WorkerRole
from common.runtime.settings import Settings
from common.text.tokenizer import Tokenizer
from services.router.app import create_app
from services.stack.embedded_redis import EmbeddedRedis
from tests.tiny import save_tokenizer

MAX_POSITIONS = 64
INTERNAL_TOKEN = "internal-secret"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer + chat template + a config.json with a small context (64 tokens)."""
    path = tmp_path_factory.mktemp("router-model")
    save_tokenizer(path, 400)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": MAX_POSITIONS}))
    return path


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(free_port()) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    redis.Redis.from_url(redis_server.url).flushdb()
    return redis_server.url


# What a choice's finishing event says its speculative steps fed it and kept.
SPEC_COUNTS = {"spec_drafted": 3, "spec_accepted": 2}


@dataclass
class Script:
    """The tokens the fake stack generates: ids[0] from prefill, the rest from decode."""

    ids: list[int]
    delay_s: float = 0.0  # between decode tokens
    final: str = ""  # decode's finish_reason after the last scripted token ("" = none)
    failure: int = 0  # with an "error: ..." final: whose failure (decode_pb2.FailureScope)
    per_message: int = 1  # decode tokens a Generate message holds (a speculative step's run)


def _token(token_id: int, top: int) -> common_pb2.TokenInfo:
    alts = [common_pb2.TopLogprob(token_id=token_id + k, logprob=-1.0 - k) for k in range(top)]
    return common_pb2.TokenInfo(token_id=token_id, logprob=-0.25, top_logprobs=alts)


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, script: Script) -> None:
        self.script = script
        self.reserved: list[decode_pb2.ReserveRequest] = []
        self.generated: list[decode_pb2.GenerateRequest] = []
        self.aborted: list[str] = []
        self.choice_aborts: list[tuple[str, tuple[int, ...]]] = []  # single choices ended
        self.tokens_seen: list[str | None] = []
        self.full_reserves = 0  # answer this many Reserves with "KV cache full" first
        self.abort_delay_s = 0.0  # how long an Abort takes (a leader whose loop is stuck)
        self.prefilled: list[decode_pb2.LocalPrefillRequest] = []  # prompts it prefilled itself
        # Its own prefills: "ok", "unavailable" (the group fails them), "off" (it does not).
        self.local = "ok"
        self.local_delay_s = 0.0  # how long its own prefill takes
        self.cached_tokens = 0  # what Reserve says it holds of every prompt already

    def _note_token(self, context: grpc.aio.ServicerContext) -> None:
        md = dict(context.invocation_metadata() or ())
        self.tokens_seen.append(md.get(TOKEN_METADATA_KEY))

    async def Reserve(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._note_token(context)
        if self.full_reserves > 0:
            self.full_reserves -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV cache full")
        self.reserved.append(request)
        target = common_pb2.KvTarget(rank=0, grpc_address="127.0.0.1:1", latent_width=16)
        return decode_pb2.ReserveResponse(
            request_id=request.request_id,
            block_size=16,
            num_layers=2,
            rope_width=8,
            dtype="float32",
            lease_seconds=30.0,
            targets=[target],
            cached_tokens=min(self.cached_tokens, request.prompt_len - 1),
        )

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._note_token(context)
        if self.local == "off":
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no local prefill")
        self.prefilled.append(request)
        await asyncio.sleep(self.local_delay_s)
        if self.local == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode group failed its prefill")
        return scripted_prefill(self.script, request)

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Every choice follows the script, the choices' events interleaved token by token."""
        self.generated.append(request)
        params, rid = request.params, request.request_id
        stops = set(params.stop_token_ids)
        firsts = list(request.first_tokens) or [request.first_token]
        live = {i for i, first in enumerate(firsts) if first.token_id not in stops}
        for i in sorted(set(range(len(firsts))) - live):
            yield _one(decode_pb2.GenerateEvent(finish_reason="stop", index=i))
        count, step = 1, []
        for tok in self.script.ids[1 + len(request.output_ids) :]:
            if count >= params.max_tokens or not live:
                break
            if not step:
                await asyncio.sleep(self.script.delay_s)
            if rid in self.aborted:
                return
            count += 1
            reason = "stop" if tok in stops else ("length" if count >= params.max_tokens else "")
            step += [
                decode_pb2.GenerateEvent(
                    token=_token(tok, params.logprobs),
                    finish_reason=reason,
                    index=i,
                    **(SPEC_COUNTS if reason else {}),
                )
                for i in sorted(live)
            ]
            if reason or len(step) >= self.script.per_message * len(live):
                yield decode_pb2.GenerateEvents(events=step)
                step = []
            if reason:
                return
        if step:
            yield decode_pb2.GenerateEvents(events=step)
        for i in sorted(live):
            yield _one(
                decode_pb2.GenerateEvent(
                    finish_reason=self.script.final or "length",
                    index=i,
                    failure=self.script.failure,
                    **SPEC_COUNTS,
                )
            )

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await asyncio.sleep(self.abort_delay_s)
        if request.choices:  # single choices: the script runs on for the others
            self.choice_aborts.append((request.request_id, tuple(request.choices)))
        else:
            self.aborted.append(request.request_id)
        return decode_pb2.AbortResponse(found=True)


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, script: Script, fail: bool = False) -> None:
        self.script = script
        self.fail = fail
        self.delay_s = 0.0  # how long a prefill takes
        self.calls: list[prefill_pb2.PrefillRequest] = []

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls.append(request)
        await asyncio.sleep(self.delay_s)
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is down")
        return scripted_prefill(self.script, request, transfer_bytes=4096)


def scripted_prefill(script: Script, request: Any, transfer_bytes: int = 0) -> Any:
    """A prefill's answer: the script's first token (a migrated request's next one is the
    script's after the ones it generated)."""
    ids = script.ids
    first = _token(ids[min(request.num_output_tokens, len(ids) - 1)], request.params.logprobs)
    prompt = [_token(t, request.prompt_logprobs) for t in request.prompt_ids[1:]]
    return common_pb2.PrefillResponse(
        first_token=first,
        first_tokens=[first] * max(request.n, 1),
        prompt_logprobs=prompt if request.HasField("prompt_logprobs") else [],
        prefill_seconds=0.01,
        transfer_seconds=0.002 if transfer_bytes else 0.0,
        transfer_bytes=transfer_bytes,
    )


@dataclass
class Stack:
    base_url: str
    client: httpx.AsyncClient
    script: Script
    decode: FakeDecode  # group g0's leader
    prefills: list[FakePrefill]
    registry: WorkerRegistry
    settings: Settings
    servers: list[grpc.aio.Server] = field(default_factory=list)
    decodes: list[FakeDecode] = field(default_factory=list)  # group gK's leader at K

    async def record(self, request_id: str) -> dict[str, Any]:
        resp = await self.client.get(f"/admin/requests/{request_id}")
        assert resp.status_code == 200, resp.text
        return resp.json()

    async def wait_state(self, request_id: str, state: str, timeout: float = 5.0) -> dict[str, Any]:
        for _ in range(int(timeout / 0.05)):
            record = await self.record(request_id)
            if record["state"] == state:
                return record
            await asyncio.sleep(0.05)
        raise AssertionError(f"{request_id} never reached {state}: {record}")


async def _grpc_server(servicer: Any, add: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def run_stack(
    model_dir: Path,
    redis_url: str,
    script: Script,
    *,
    prefill_fail: tuple[bool, ...] = (False, False),
    with_decode: bool = True,
    decode_groups: int = 1,
    api_keys: str | None = None,
    routing_policy: str = "least-loaded",
    **overrides: Any,
) -> AsyncIterator[Stack]:
    """Fake workers registered in Redis, and the router serving on a real socket.

    The tests assert which prefill worker a request goes to (prefill-0 first, a burst split
    evenly): that is least-loaded's choice, so the rig routes by it whatever the default."""
    registry = WorkerRegistry(redis.Redis.from_url(redis_url))
    decodes = [FakeDecode(script) for _ in range(decode_groups if with_decode else 0)]
    prefills = [FakePrefill(script, fail) for fail in prefill_fail]
    servers: list[grpc.aio.Server] = []
    for i, fake in enumerate(prefills):
        server, address = await _grpc_server(fake, prefill_pb2_grpc.add_PrefillServicer_to_server)
        servers.append(server)
        # Worker ids sort in list order and queued_tokens rise with it: least-loaded (the
        # rig's policy) tries prefill-0 first.
        registry.publish(WorkerRecord(f"prefill-{i}", WorkerRole.PREFILL, address, queued_tokens=i))
    for g, decode in enumerate(decodes):
        server, address = await _grpc_server(decode, decode_pb2_grpc.add_DecodeServicer_to_server)
        servers.append(server)
        for rank in (0, 1):  # a tp=2 group: the router must route to the leader only
            registry.publish(
                WorkerRecord(
                    f"decode-g{g}-r{rank}",
                    WorkerRole.DECODE,
                    address if rank == 0 else "127.0.0.1:9",
                    rank=rank,
                    group_id=f"g{g}",
                    # Later groups a little busier: least-loaded tries g0 first.
                    kv_blocks_used=10 + g,
                    kv_blocks_total=100,
                )
            )
    settings = Settings(
        model=str(model_dir),
        served_model_name="tpla-test",
        internal_token=INTERNAL_TOKEN,
        api_keys=api_keys,
        routing_policy=routing_policy,
        **overrides,
    )
    try:
        async with serve_router(settings, redis_url) as base:
            client = httpx.AsyncClient(base_url=base, timeout=10.0)
            try:
                decode = decodes[0] if decodes else FakeDecode(script)
                yield Stack(
                    base, client, script, decode, prefills, registry, settings, servers, decodes
                )
            finally:
                await client.aclose()
    finally:
        for s in servers:
            await s.stop(grace=None)
        registry.client.close()


@contextlib.asynccontextmanager
async def serve_router(settings: Settings, redis_url: str) -> AsyncIterator[str]:
    """The router app on a real socket of 127.0.0.1, in the test's event loop: its URL."""
    app = create_app(settings, redis_url=redis_url, refresh_s=0.1)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)
        sock.close()


UNUSED_REDIS = "redis://127.0.0.1:1/0"


@pytest.fixture
async def client(model_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The router app in process with no workers and an unreachable Redis: for requests that
    must be rejected before anything is routed."""
    app = create_app(
        Settings(model=str(model_dir), served_model_name="tpla-test"), redis_url=UNUSED_REDIS
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        yield c


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tpla-test", "messages": [{"role": "user", "content": "hi"}], **kw}


def _one(event: Any) -> Any:
    """A stream message holding one event (the real leader packs those ready together)."""
    return decode_pb2.GenerateEvents(events=[event])

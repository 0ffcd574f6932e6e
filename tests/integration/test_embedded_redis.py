"""The embedded redis-server, with and without `requirepass`, and the registry and router over
a password-protected Redis (real redis-server processes on 127.0.0.1)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from common.runtime.ports import free_port
from common.runtime.redis_state import WorkerRecord, WorkerRegistry, WorkerRole
from common.runtime.settings import Settings
from services.router.app import create_app
from services.stack.embedded_redis import EmbeddedRedis

# Characters that must be escaped in redis.conf and percent-encoded in a URL.
PASSWORD = 'p@ss:w/rd "q" \\ #%?'
DEMO_MODEL = Path(__file__).resolve().parents[2] / "models" / "demo"


@pytest.fixture(scope="module")
def locked() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(free_port(), password=PASSWORD) as server:
        yield server


def without_password(server: EmbeddedRedis) -> str:
    return f"redis://127.0.0.1:{server.port}/0"


def test_open_server_round_trip_and_cleanup() -> None:
    server = EmbeddedRedis(free_port())
    try:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
    finally:
        server.stop()
    assert server.proc.poll() is not None
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()


def test_password_is_required_and_kept_out_of_the_command_line(locked: EmbeddedRedis) -> None:
    assert locked.url.startswith("redis://:p%40ss%3Aw%2Frd%20%22q%22%20%5C%20%23%25%3F@127.0.0.1:")
    assert redis.Redis.from_url(locked.url).ping()
    assert redis.Redis(host="127.0.0.1", port=locked.port, password=PASSWORD).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(without_password(locked)).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(f"redis://:wrong@127.0.0.1:{locked.port}/0").ping()
    cmdline = Path(f"/proc/{locked.proc.pid}/cmdline").read_bytes()
    assert PASSWORD.encode() not in cmdline and b"requirepass" not in cmdline


def test_config_values_that_cannot_be_written_are_refused() -> None:
    for bad in ("two\nlines", "nul\0byte", ""):
        with pytest.raises(ValueError):
            EmbeddedRedis(free_port(), password=bad)


def test_worker_registry_over_a_password_url(locked: EmbeddedRedis) -> None:
    registry = WorkerRegistry(redis.Redis.from_url(locked.url))
    registry.publish(
        WorkerRecord("prefill-auth", WorkerRole.PREFILL, "127.0.0.1:1", pid=os.getpid())
    )
    assert [r.worker_id for r in registry.list(WorkerRole.PREFILL)] == ["prefill-auth"]
    registry.remove("prefill-auth")
    registry.client.close()

    # A worker started without the password fails loudly at its first publish.
    stranger = WorkerRegistry(redis.Redis.from_url(without_password(locked)))
    with pytest.raises(redis.AuthenticationError):
        stranger.publish(WorkerRecord("prefill-x", WorkerRole.PREFILL, "127.0.0.1:1"))
    stranger.client.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_router_registry_over_a_password_url(
    locked: EmbeddedRedis, anyio_backend: str
) -> None:
    registry = WorkerRegistry(redis.Redis.from_url(locked.url))
    for role, wid in ((WorkerRole.PREFILL, "prefill-r"), (WorkerRole.DECODE, "decode-r")):
        registry.publish(
            WorkerRecord(
                wid, role, "127.0.0.1:1", group_id="g" if role is WorkerRole.DECODE else ""
            )
        )
    settings = Settings(model=str(DEMO_MODEL), served_model_name="tpla-auth")
    try:
        for url, ok in ((locked.url, True), (without_password(locked), False)):
            app = create_app(settings, redis_url=url, refresh_s=0.05)
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
                    workers = (await client.get("/admin/workers")).json()
                    ready = await client.get("/ready")
                    record = await client.get("/admin/requests/cmpl-none")
            if ok:
                assert sorted(w["worker_id"] for w in workers) == ["decode-r", "prefill-r"]
                assert ready.status_code == 200, ready.text
                assert record.status_code == 404
            else:
                # The router stays up and says why it has no workers.
                assert workers == []
                assert ready.status_code == 503
                reason = ready.json()["reason"]
                assert "worker registry unreachable" in reason and "authenticat" in reason
                # Request records live in the same Redis: an unavailable store, not a crash.
                assert record.status_code == 503
                assert record.json()["error"]["type"] == "service_unavailable"
    finally:
        for wid in ("prefill-r", "decode-r"):
            registry.remove(wid)
        registry.client.close()

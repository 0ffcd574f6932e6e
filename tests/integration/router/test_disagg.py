"""Where the router has prompts prefilled (services/router/disagg_policy.py, prefilling.py),
through the rig: the policies' decisions and reasons in the request's record and
`tpla:prefill_route_total`, a group that prefills nothing sending its prompts to a worker,
degraded mode without a usable prefill worker (`/ready` ready and saying so, the gauge), a
request whose workers die prefilled by its group, the prefill circuit opening and closing
again, and a group that fails its own prefill left for another."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from common.text.tokenizer import Tokenizer
from tests.integration.router.test_metrics import MODEL, chat_body, scrape, script_for
from tests.router_rig import Stack, run_stack

pytestmark = pytest.mark.anyio


def routed(samples: dict, route: str, reason: str) -> float:
    return samples[("tpla:prefill_route_total", (*MODEL, ("reason", reason), ("route", route)))]


async def _chat(stack: Stack) -> dict[str, Any]:
    resp = await stack.client.post("/v1/chat/completions", json=chat_body())
    assert resp.status_code == 200, resp.text
    return await stack.record(resp.json()["id"])


def _routes(record: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Each prefill attempt's (route, reason, worker)."""
    return [
        (h["prefill_route"], h["prefill_route_reason"], h["prefill_worker"])
        for h in record["history"]
        if h["state"] == "PREFILLING"
    ]


async def test_auto_prefills_short_and_cached_prompts_on_their_group(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer)
    async with run_stack(
        model_dir, redis_url, script, disagg_policy="auto", local_prefill_max_tokens=3
    ) as stack:
        record = await _chat(stack)
        assert _routes(record) == [("remote", "long", "prefill-0")]
        stack.decode.cached_tokens = 1000  # the group holds all of the prompt but its last token
        record = await _chat(stack)
        assert _routes(record) == [("local", "short", "")]
        assert record["state"] == "FINISHED" and record["transfer_bytes"] == "0"
        assert len(stack.decode.prefilled) == 1 and len(stack.prefills[0].calls) == 1
        samples = await scrape(stack)
    assert routed(samples, "local", "short") == 1 and routed(samples, "remote", "long") == 1
    assert routed(samples, "local", "circuit_open") == 0  # every series exists from the start


async def test_a_busy_group_sends_prompts_to_workers(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer)
    async with run_stack(
        model_dir, redis_url, script, disagg_policy="auto", local_prefill_queue_tokens=1
    ) as stack:
        stack.decode.cached_tokens = 1000  # one token of each prompt to prefill
        stack.decode.local_delay_s = 0.5
        records = await asyncio.gather(_chat(stack), _chat(stack))
    routes = sorted(_routes(r)[0][:2] for r in records)
    assert routes == [("local", "short"), ("remote", "group_busy")]


async def test_never_and_a_group_that_does_not_prefill(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer)
    async with run_stack(model_dir, redis_url, script, disagg_policy="never") as stack:
        assert _routes(await _chat(stack)) == [("local", "policy", "")]
        stack.decode.local = "off"  # its answer sends the prompt to a worker
        tried = [("local", "policy", ""), ("remote", "local_off", "prefill-0")]
        assert _routes(await _chat(stack)) == tried
        assert (await stack.client.get("/ready")).json() == {"status": "ready"}


async def test_degraded_without_a_prefill_worker(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer)
    async with run_stack(model_dir, redis_url, script, prefill_fail=()) as stack:
        ready = await stack.client.get("/ready")
        assert ready.status_code == 200, ready.text
        assert "no healthy prefill worker" in ready.json()["degraded"]
        assert _routes(await _chat(stack)) == [("local", "no_prefill_worker", "")]
        samples = await scrape(stack)
    assert samples[("tpla:prefill_degraded", MODEL)] == 1


async def test_dead_workers_requests_prefill_on_their_group_and_the_circuit(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    """A request whose prefill workers both fail completes, prefilled by its group; the third
    failure in a row opens the circuit (no worker is tried), and once it has been open for
    worker_ttl_s one remote prefill that succeeds closes it."""
    script = script_for(tokenizer)
    async with run_stack(
        model_dir, redis_url, script, prefill_fail=(True, True), worker_ttl_s=1.0
    ) as stack:
        first = await _chat(stack)
        assert _routes(first) == [
            ("remote", "policy", "prefill-0"),
            ("remote", "policy", "prefill-1"),
            ("local", "remote_failed", ""),
        ]
        second = await _chat(stack)  # its first failure is the third: no other worker tried
        assert _routes(second) == [
            ("remote", "policy", "prefill-0"),
            ("local", "remote_failed", ""),
        ]
        calls = sum(len(p.calls) for p in stack.prefills)
        assert _routes(await _chat(stack)) == [("local", "circuit_open", "")]
        assert sum(len(p.calls) for p in stack.prefills) == calls
        assert "circuit is open" in (await stack.client.get("/ready")).json()["degraded"]
        assert (await scrape(stack))[("tpla:prefill_degraded", MODEL)] == 1
        for fake in stack.prefills:
            fake.fail = False  # the workers are back
        await asyncio.sleep(1.0)  # the circuit half opens: one remote prefill may try
        assert _routes(await _chat(stack)) == [("remote", "policy", "prefill-0")]
        assert _routes(await _chat(stack)) == [("remote", "policy", "prefill-0")]
        assert (await stack.client.get("/ready")).json() == {"status": "ready"}
        assert (await scrape(stack))[("tpla:prefill_degraded", MODEL)] == 0


async def test_a_group_failing_its_own_prefill_is_left(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer)
    async with run_stack(
        model_dir, redis_url, script, decode_groups=2, disagg_policy="never"
    ) as stack:
        stack.decodes[0].local = "unavailable"
        record = await _chat(stack)
        assert [h.get("decode_group") for h in record["history"] if h["state"] == "PREFILLING"] == [
            "g0",
            "g1",
        ]
        retried = [h["retry_reason"] for h in record["history"] if h.get("retry_reason")]
        assert retried == ["local prefill: decode group failed its prefill"]
        assert stack.decodes[0].aborted == [record["request_id"]]
        workers = (await stack.client.get("/admin/workers")).json()
        assert any(w.get("quarantined") == "local_prefill_failed" for w in workers), workers

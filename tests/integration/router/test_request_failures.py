"""Whose failure it was decides what the router does (services/router/faults.py): a request's
own failure ends that request alone; a group's failure quarantines the group, but never the
last healthy one, and a request that failed on two groups for the same reason is not moved
to a third."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.rpc.gen import decode_pb2
from common.text.tokenizer import Tokenizer
from tests.router_rig import Script, Stack, chat, run_stack

pytestmark = pytest.mark.anyio

GRAMMAR_FAILED = "error: structured output: the grammar cannot go on: too many items"
RANK_DIED = "error: rank 1 died"


def script(tok: Tokenizer, final: str, failure: int) -> Script:
    return Script(tok.encode("one two three"), final=final, failure=failure)


async def quarantines(stack: Stack) -> dict[str, str | None]:
    workers = (await stack.client.get("/admin/workers")).json()
    return {w["worker_id"]: w["quarantined"] for w in workers if w["role"] == "decode"}


async def health(stack: Stack) -> dict[str, tuple[float, str]]:
    """tpla:worker_healthy per decode worker: (value, reason)."""
    text = (await stack.client.get("/metrics")).text
    return {
        s.labels["worker_id"]: (s.value, s.labels["reason"])
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tpla:worker_healthy" and s.labels["role"] == "decode"
    }


def migrations(metrics: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "tpla:request_migrations_total"
    )


async def test_a_request_failure_ends_that_request_alone(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    failing = script(tokenizer, GRAMMAR_FAILED, decode_pb2.FAILURE_SCOPE_REQUEST)
    async with run_stack(model_dir, redis_url, failing, decode_groups=2) as stack:
        resp = await stack.client.post("/v1/chat/completions", json=chat(n=2))
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "request_failed"
        assert error["message"] == GRAMMAR_FAILED.removeprefix("error: ")
        rid = stack.decodes[0].generated[0].request_id
        record = await stack.record(rid)
        assert record["state"] == "FAILED" and record["error_type"] == "invalid_request_error"
        # Streamed: the tokens before the failure, then the error in-band.
        async with stack.client.stream(
            "POST", "/v1/chat/completions", json=chat(stream=True)
        ) as resp:
            assert resp.status_code == 200
            events = [
                line.removeprefix("data: ")
                async for line in resp.aiter_lines()
                if line.startswith("data: ")
            ]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_failed"
        text = "".join(
            json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2]
        )
        assert text == "one two three"
        # Neither group was blamed: nothing quarantined, nothing moved.
        assert [len(d.generated) for d in stack.decodes] == [2, 0]
        assert set((await quarantines(stack)).values()) == {None}
        assert set((await health(stack)).values()) == {(1.0, "")}
        assert migrations((await stack.client.get("/metrics")).text) == 0


async def test_the_last_healthy_group_is_never_quarantined(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    failing = script(tokenizer, RANK_DIED, decode_pb2.FAILURE_SCOPE_GROUP)
    async with run_stack(model_dir, redis_url, failing) as stack:
        for _ in range(2):
            resp = await stack.client.post("/v1/chat/completions", json=chat())
            assert resp.status_code == 503, resp.text
            assert "rank 1 died" in resp.json()["error"]["message"]
        # The second request still reached the group: one failure did not take it away.
        assert len(stack.decode.generated) == 2
        assert set((await quarantines(stack)).values()) == {None}


async def test_a_second_failure_for_the_same_reason_is_not_moved_again(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    failing = script(tokenizer, RANK_DIED, decode_pb2.FAILURE_SCOPE_GROUP)
    async with run_stack(model_dir, redis_url, failing, decode_groups=3) as stack:
        resp = await stack.client.post("/v1/chat/completions", json=chat())
        assert resp.status_code == 503, resp.text
        # g0 failed it and was quarantined (others were healthy); g1 failed it the same way,
        # so g2 was never tried, and g1 (not blamed past that) still takes requests.
        assert [len(d.generated) for d in stack.decodes] == [1, 1, 0]
        quarantined = await quarantines(stack)
        assert quarantined["decode-g0-r0"] == quarantined["decode-g0-r1"] == "group_error"
        assert quarantined["decode-g1-r0"] is None and quarantined["decode-g2-r0"] is None
        healthy = await health(stack)
        assert healthy["decode-g0-r0"] == (0.0, "group_error")
        assert healthy["decode-g1-r0"] == (1.0, "")
        assert migrations((await stack.client.get("/metrics")).text) == 1

"""The router's metrics through the rig: request sizes, queue wait, errors by type, and the
health of every registered worker, read back from `/metrics` as Prometheus parses them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.runtime.redis_state import WorkerRecord, WorkerRole
from common.text.tokenizer import Tokenizer
from tests.router_rig import Script, Stack, run_stack

pytestmark = pytest.mark.anyio

MODEL = (("model_name", "tpla-test"),)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def script_for(tok: Tokenizer, **kw: object) -> Script:
    return Script([*tok.encode("the quick brown fox"), min(tok.eos_token_ids)], **kw)  # type: ignore[arg-type]


def chat_body(**kw: object) -> dict[str, object]:
    return {"model": "tpla-test", "messages": [{"role": "user", "content": "hello"}], **kw}


async def scrape(stack: Stack) -> Samples:
    text = (await stack.client.get("/metrics")).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def bucket(samples: Samples, name: str, le: str) -> float:
    return samples[(f"{name}_bucket", tuple(sorted((*MODEL, ("le", le)))))]


async def test_request_sizes_are_histograms_of_finished_requests(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer)
    async with run_stack(model_dir, redis_url, script) as stack:
        usages = []
        for max_tokens in (2, 3, 40):
            resp = await stack.client.post(
                "/v1/chat/completions", json=chat_body(max_tokens=max_tokens)
            )
            assert resp.status_code == 200, resp.text
            usages.append(resp.json()["usage"])
        samples = await scrape(stack)
    prompt = usages[0]["prompt_tokens"]
    generated = [u["completion_tokens"] for u in usages]
    assert generated == [2, 3, len(script.ids)]  # the last one ran to the end of its script
    assert samples[("tpla:request_prompt_tokens_count", MODEL)] == 3
    assert samples[("tpla:request_prompt_tokens_sum", MODEL)] == 3 * prompt
    assert samples[("tpla:request_generation_tokens_sum", MODEL)] == sum(generated)
    # Powers-of-two buckets, cumulative.
    for k in range(5):
        expected = sum(g <= 2**k for g in generated)
        assert bucket(samples, "tpla:request_generation_tokens", f"{2.0**k}") == expected
    smallest_above = next(2.0**k for k in range(18) if 2**k >= prompt)
    assert bucket(samples, "tpla:request_prompt_tokens", str(smallest_above)) == 3
    assert bucket(samples, "tpla:request_prompt_tokens", str(smallest_above / 2)) == 0
    # Nobody waited for a slot: three zeros.
    assert samples[("tpla:request_queue_seconds_count", MODEL)] == 3
    assert samples[("tpla:request_queue_seconds_sum", MODEL)] == 0
    assert not any(name == "tpla:request_errors_total" for name, _ in samples)


async def test_queue_wait_is_observed_when_a_request_waits_for_its_slot(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer, delay_s=0.05)
    async with run_stack(model_dir, redis_url, script, max_inflight=1, max_waiting=1) as stack:
        first = asyncio.create_task(stack.client.post("/v1/chat/completions", json=chat_body()))
        while not stack.decode.generated:
            await asyncio.sleep(0.01)
        second = await stack.client.post("/v1/chat/completions", json=chat_body())
        assert second.status_code == 200 and (await first).status_code == 200
        samples = await scrape(stack)
    assert samples[("tpla:request_queue_seconds_count", MODEL)] == 2
    # The second waited for the first's remaining tokens (50 ms each).
    assert samples[("tpla:request_queue_seconds_sum", MODEL)] >= 0.05
    assert bucket(samples, "tpla:request_queue_seconds", "0.001") == 1


async def test_failed_requests_are_counted_by_error_type(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer)
    async with run_stack(model_dir, redis_url, script, prefill_fail=(True, True)) as stack:
        stack.decode.local = "off"
        resp = await stack.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code >= 500
        error_type = resp.json()["error"]["type"]
        samples = await scrape(stack)
    by_type = tuple(sorted((*MODEL, ("error_type", error_type))))
    assert samples[("tpla:request_errors_total", by_type)] == 1
    failed = tuple(sorted((*MODEL, ("outcome", "failed"))))
    assert samples[("tpla:requests_total", failed)] == 1
    assert samples[("tpla:request_prompt_tokens_count", MODEL)] == 0


async def test_every_registered_worker_has_a_health_series(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    async with run_stack(model_dir, redis_url, script_for(tokenizer)) as stack:

        def health(samples: Samples) -> dict[tuple[str, str, str, str], float]:
            return {
                (d["worker_id"], d["role"], d["rank"], d["group_id"]): value
                for (name, labels), value in samples.items()
                if name == "tpla:worker_healthy"
                for d in [dict(labels)]
            }

        samples = await scrape(stack)
        assert health(samples) == {
            ("prefill-0", "prefill", "0", ""): 1,
            ("prefill-1", "prefill", "0", ""): 1,
            ("decode-g0-r0", "decode", "0", "g0"): 1,
            ("decode-g0-r1", "decode", "1", "g0"): 1,
        }
        ages = [v for (n, _), v in samples.items() if n == "tpla:worker_heartbeat_age_seconds"]
        assert len(ages) == 4 and all(0 <= age < 30 for age in ages)
        address = (await stack.client.get("/admin/workers")).json()[0]["address"]
        stack.registry.publish(
            WorkerRecord("prefill-1", WorkerRole.PREFILL, address, healthy=False)
        )
        for _ in range(100):  # the directory refreshes every 0.1 s
            if health(await scrape(stack))[("prefill-1", "prefill", "0", "")] == 0:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("an unhealthy worker never showed as one")

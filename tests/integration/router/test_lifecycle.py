"""Router integration: real Redis, real gRPC fake workers, real uvicorn, httpx + openai."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.text.tokenizer import Tokenizer
from tests.router_rig import INTERNAL_TOKEN, Script, run_stack

pytestmark = pytest.mark.anyio

TEXT = "the quick brown fox jumps over the lazy dog"
LIFECYCLE = ["QUEUED", "PREFILLING", "TRANSFERRING", "DECODING", "FINISHED"]


def script_for(tok: Tokenizer, text: str = TEXT, **kw: object) -> Script:
    eos = min(tok.eos_token_ids)
    return Script([*tok.encode(text), eos], **kw)  # type: ignore[arg-type]


def chat_body(**kw: object) -> dict[str, object]:
    return {"model": "tpla-test", "messages": [{"role": "user", "content": "hello"}], **kw}


async def sse_events(resp: object) -> list[str]:
    lines = []
    async for line in resp.aiter_lines():  # type: ignore[attr-defined]
        if line.startswith("data: "):
            lines.append(line.removeprefix("data: "))
    return lines


async def test_chat_walks_the_state_machine(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    async with run_stack(model_dir, redis_url, script_for(tokenizer)) as stack:
        resp = await stack.client.post("/v1/chat/completions", json=chat_body(seed=7))
        assert resp.status_code == 200, resp.text
        body = resp.json()
        rid = body["id"]
        assert rid.startswith("chatcmpl-")
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": TEXT}
        assert choice["finish_reason"] == "stop"
        n_completion = len(stack.script.ids)  # the EOS token counts, but is not text
        prompt_len = stack.decode.reserved[0].prompt_len
        assert prompt_len > 0
        # The prompt's ids go with Reserve, so the group can reuse a cached prefix.
        assert len(stack.decode.reserved[0].prompt_ids) == prompt_len
        assert body["usage"] == {
            "prompt_tokens": prompt_len,
            "completion_tokens": n_completion,
            "total_tokens": prompt_len + n_completion,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        # The id the client sees is the id on every gRPC call and in Redis.
        assert stack.decode.reserved[0].request_id == rid
        assert stack.prefills[0].calls[0].request_id == rid
        gen = stack.decode.generated[0]
        assert gen.request_id == rid and gen.first_token.token_id == stack.script.ids[0]
        assert set(gen.params.stop_token_ids) == set(tokenizer.eos_token_ids)
        assert gen.params.seed == 7
        assert stack.decode.tokens_seen == [INTERNAL_TOKEN]
        assert stack.decode.aborted == []  # decode finished it: nothing to free

        record = await stack.record(rid)
        assert [h["state"] for h in record["history"]] == LIFECYCLE
        assert record["state"] == "FINISHED"
        assert record["finish_reason"] == "stop"
        assert record["completion_tokens"] == str(n_completion)
        # The choice's drafts and kept drafts, as its finishing event reported them.
        assert (record["spec_draft_tokens"], record["spec_accepted_tokens"]) == ("3", "2")
        assert record["transfer_bytes"] == "4096"
        assert record["prefill_worker"] == "prefill-0" and record["decode_group"] == "g0"
        assert record["stream"] == "0"


async def test_streaming_stop_string_across_tokens(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    async with run_stack(model_dir, redis_url, script_for(tokenizer)) as stack:
        # " brown f" spans the tokens " brown" and " fox".
        body = chat_body(stream=True, stop=[" brown f"], stream_options={"include_usage": True})
        async with stack.client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = await sse_events(resp)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        rid = chunks[0]["id"]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        assert text == "the quick"
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == "stop"
        usage_chunk = chunks[-1]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == 5  # the, qu, ick, brown, fox
        # The leader was still generating: the router must free its blocks.
        assert stack.decode.aborted == [rid]
        record = await stack.record(rid)
        assert record["state"] == "FINISHED" and record["finish_reason"] == "stop"


async def test_a_message_of_several_tokens_streams_each(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    """The leader sends a speculative step's kept run in one message: the client gets each
    token's text and logprobs as from one token a message, and a stop string inside the run
    cuts where it did."""
    script = script_for(tokenizer, per_message=4)
    async with run_stack(model_dir, redis_url, script) as stack:
        body = chat_body(stream=True, logprobs=True, stream_options={"include_usage": True})
        async with stack.client.stream("POST", "/v1/chat/completions", json=body) as resp:
            chunks = [json.loads(e) for e in (await sse_events(resp))[:-1]]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        assert "".join(c["delta"].get("content") or "" for c in choices) == TEXT
        logprobs = [lp for c in choices for lp in (c.get("logprobs") or {}).get("content") or []]
        assert len(logprobs) == chunks[-1]["usage"]["completion_tokens"] == len(script.ids)
        assert choices[-1]["finish_reason"] == "stop"

        body = chat_body(stream=True, stop=[" brown f"], stream_options={"include_usage": True})
        async with stack.client.stream("POST", "/v1/chat/completions", json=body) as resp:
            chunks = [json.loads(e) for e in (await sse_events(resp))[:-1]]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        assert "".join(c["delta"].get("content") or "" for c in choices) == "the quick"
        # The message of qu, ick, brown, fox: the stop string ends in fox, which counts.
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        assert stack.decode.aborted == [chunks[0]["id"]]


async def test_openai_client_streaming_and_not(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    async with run_stack(model_dir, redis_url, script_for(tokenizer)) as stack:
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        done = await client.chat.completions.create(
            model="tpla-test", messages=messages, max_tokens=4, temperature=0
        )
        assert done.choices[0].message.content == "the quick brown"
        assert done.choices[0].finish_reason == "length"
        assert done.usage is not None and done.usage.completion_tokens == 4

        stream = await client.chat.completions.create(
            model="tpla-test",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=2,
        )
        parts, usage, logprobs = [], None, []
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                if choice.logprobs and choice.logprobs.content:
                    logprobs.extend(choice.logprobs.content)
        assert "".join(parts) == TEXT
        assert usage is not None and usage.completion_tokens == len(stack.script.ids)
        assert len(logprobs) == len(stack.script.ids)
        assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tpla-test"]
        await client.close()


async def test_completions_token_prompt_logprobs(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    async with run_stack(model_dir, redis_url, script_for(tokenizer)) as stack:
        body = {"model": "tpla-test", "prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 1}
        resp = await stack.client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
        choice = out["choices"][0]
        assert choice["text"] == "the quick"
        assert choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == 3
        assert all(len(t) == 1 for t in choice["logprobs"]["top_logprobs"])
        assert out["usage"]["prompt_tokens"] == 3
        assert list(stack.prefills[0].calls[0].prompt_ids) == [5, 6, 7]


async def test_client_disconnect_aborts(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer, TEXT * 3, delay_s=0.05)
    async with run_stack(model_dir, redis_url, script) as stack:
        async with stack.client.stream(
            "POST", "/v1/chat/completions", json=chat_body(stream=True, max_tokens=40)
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if '"content":"the"' in line or '"content":" qu' in line:
                    rid = json.loads(line.removeprefix("data: "))["id"]
                    break
        # Leaving the `stream` block closed the connection mid-stream.
        record = await stack.wait_state(rid, "ABORTED")
        assert [h["state"] for h in record["history"]][-1] == "ABORTED"
        assert stack.decode.aborted == [rid]
        metrics = await stack.client.get("/metrics")
        assert 'tpla:requests_total{model_name="tpla-test",outcome="aborted"} 1.0' in metrics.text


async def test_client_disconnect_non_streaming_aborts(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer, TEXT * 3, delay_s=0.05)
    async with run_stack(model_dir, redis_url, script) as stack:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
            await stack.client.post(
                "/v1/chat/completions", json=chat_body(max_tokens=40), timeout=0.4
            )
        rid = stack.decode.reserved[0].request_id
        await stack.wait_state(rid, "ABORTED")
        assert stack.decode.aborted == [rid]


async def test_prefill_retried_on_another_worker(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer)
    async with run_stack(model_dir, redis_url, script, prefill_fail=(True, False)) as stack:
        resp = await stack.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == TEXT
        assert len(stack.prefills[0].calls) == 1 and len(stack.prefills[1].calls) == 1
        record = await stack.record(resp.json()["id"])
        states = [h["state"] for h in record["history"]]
        assert states == ["QUEUED", "PREFILLING", "QUEUED", *LIFECYCLE[1:]]
        workers = [h.get("prefill_worker") for h in record["history"] if h["state"] == "PREFILLING"]
        assert workers == ["prefill-0", "prefill-1"]


async def test_a_burst_spreads_over_the_prefill_workers(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    """Requests arriving together split evenly between two prefill workers whose registry
    reports are stale (both idle). Each request's tokens must count against its worker from
    the moment it is chosen: counted only after the request's first await (as before), a
    whole burst chose the same worker."""
    script = script_for(tokenizer)
    async with run_stack(model_dir, redis_url, script) as stack:
        for fake in stack.prefills:
            fake.delay_s = 0.3  # the burst's prefills overlap
        responses = await asyncio.gather(
            *(stack.client.post("/v1/chat/completions", json=chat_body()) for _ in range(8))
        )
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        assert sorted(len(fake.calls) for fake in stack.prefills) == [4, 4]


async def test_all_prefill_workers_fail(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer)
    async with run_stack(model_dir, redis_url, script, prefill_fail=(True, True)) as stack:
        stack.decode.local = "off"  # nor does the group prefill (router/test_disagg.py)
        # Non-streaming: nothing was sent yet, so the failure is the HTTP status.
        resp = await stack.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 503
        assert resp.json()["error"]["type"] == "service_unavailable"
        rid = stack.decode.reserved[0].request_id
        record = await stack.record(rid)
        assert record["state"] == "FAILED" and "prefill worker is down" in record["error"]
        assert stack.decode.aborted == [rid]  # the reservation is freed at once
        # Streaming: the 200 headers are gone, so the error arrives in-band before [DONE].
        async with stack.client.stream(
            "POST", "/v1/chat/completions", json=chat_body(stream=True)
        ) as resp:
            events = await sse_events(resp)
        assert resp.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
        assert len(stack.decode.aborted) == 2


async def test_a_hung_abort_still_ends_the_request_with_its_error(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    # A leader whose loop waits on a stopped rank answers no Abort: the cleanup gives up on
    # it (the lease frees the blocks) and the client still gets its 503, not a 500.
    script = script_for(tokenizer)
    async with run_stack(model_dir, redis_url, script, prefill_fail=(True, True)) as stack:
        stack.decode.local = "off"
        stack.decode.abort_delay_s = 30.0
        t0 = time.monotonic()
        resp = await stack.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["type"] == "service_unavailable"
        assert time.monotonic() - t0 < 10.0
        record = await stack.record(stack.decode.reserved[0].request_id)
        assert record["state"] == "FAILED" and "prefill worker is down" in record["error"]


async def test_decode_failure_mid_stream(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = Script(tokenizer.encode("hello world"), final="error: rank 1 died")
    async with run_stack(model_dir, redis_url, script) as stack:
        async with stack.client.stream(
            "POST", "/v1/completions", json={"model": "tpla-test", "prompt": "x", "stream": True}
        ) as resp:
            events = await sse_events(resp)
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
        assert text == "hello world"  # what was generated before the failure still arrived
        error = json.loads(events[-2])["error"]
        assert "rank 1 died" in error["message"]
        record = await stack.record(stack.decode.reserved[0].request_id)
        assert record["state"] == "FAILED" and "rank 1 died" in record["error"]
        assert stack.decode.aborted == []  # the leader ended it itself


async def test_no_workers_gives_503(model_dir: Path, redis_url: str, tokenizer: Tokenizer) -> None:
    script = script_for(tokenizer)
    async with run_stack(model_dir, redis_url, script, prefill_fail=(), with_decode=False) as stack:
        assert (await stack.client.get("/health")).status_code == 200
        ready = await stack.client.get("/ready")
        assert ready.status_code == 503 and "prefill" in ready.json()["reason"]
        for stream in (False, True):
            resp = await stack.client.post("/v1/chat/completions", json=chat_body(stream=stream))
            assert resp.status_code == 503
            assert resp.json()["error"]["type"] == "service_unavailable"


async def test_ready_with_workers(model_dir: Path, redis_url: str, tokenizer: Tokenizer) -> None:
    async with run_stack(model_dir, redis_url, script_for(tokenizer)) as stack:
        assert (await stack.client.get("/ready")).status_code == 200
        workers = (await stack.client.get("/admin/workers")).json()
        roles = sorted((w["role"], w["rank"]) for w in workers)
        assert roles == [("decode", 0), ("decode", 1), ("prefill", 0), ("prefill", 0)]
        leader = next(w for w in workers if w["role"] == "decode" and w["rank"] == 0)
        assert (leader["kv_blocks_used"], leader["kv_blocks_total"]) == (10, 100)
        assert (await stack.client.get("/admin/requests/chatcmpl-nope")).status_code == 404


async def _until_generating(stack) -> None:
    for _ in range(100):
        if stack.decode.generated:
            return
        await asyncio.sleep(0.02)


async def test_max_inflight_without_queue_gives_429(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer, delay_s=0.05)
    async with run_stack(model_dir, redis_url, script, max_inflight=1, max_waiting=0) as stack:
        first = asyncio.create_task(stack.client.post("/v1/chat/completions", json=chat_body()))
        await _until_generating(stack)
        resp = await stack.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 429
        assert resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["type"] == "rate_limit_error"
        metrics = (await stack.client.get("/metrics")).text
        assert 'tpla:requests_total{model_name="tpla-test",outcome="rejected"} 1.0' in metrics
        assert (await first).status_code == 200
        assert (
            await stack.client.post("/v1/chat/completions", json=chat_body())
        ).status_code == 200


async def test_waiting_queue_is_bounded_in_size_and_time(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    """One runs, one waits for its slot and is served; a third finds the queue full (429
    at once); with the runner slow, a waiter gives up after queue_timeout_s (429)."""
    script = script_for(tokenizer, delay_s=0.05)
    async with run_stack(
        model_dir, redis_url, script, max_inflight=1, max_waiting=1, queue_timeout_s=30
    ) as stack:
        first = asyncio.create_task(stack.client.post("/v1/chat/completions", json=chat_body()))
        await _until_generating(stack)
        second = asyncio.create_task(stack.client.post("/v1/chat/completions", json=chat_body()))
        for _ in range(100):
            if (
                'tpla:num_requests_waiting{model_name="tpla-test"} 1.0'
                in (await stack.client.get("/metrics")).text
            ):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the second request never waited")
        third = await stack.client.post("/v1/chat/completions", json=chat_body())
        assert third.status_code == 429
        assert "waiting" in third.json()["error"]["message"]
        assert (await first).status_code == 200
        assert (await second).status_code == 200
    slow = script_for(tokenizer, delay_s=0.5)
    async with run_stack(
        model_dir, redis_url, slow, max_inflight=1, max_waiting=4, queue_timeout_s=0.3
    ) as stack:
        first = asyncio.create_task(stack.client.post("/v1/chat/completions", json=chat_body()))
        await _until_generating(stack)
        late = await stack.client.post("/v1/chat/completions", json=chat_body())
        assert late.status_code == 429
        assert "within 0.3 s" in late.json()["error"]["message"]
        assert (await first).status_code == 200


async def test_full_kv_pool_waits_for_room_then_serves_or_429s(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    """A decode group whose pool is full answers Reserve RESOURCE_EXHAUSTED: the request waits
    for room (re-trying) and is served once blocks free up, or gets 429 after the timeout."""
    async with run_stack(model_dir, redis_url, script_for(tokenizer), queue_timeout_s=5) as stack:
        stack.decode.full_reserves = 3
        resp = await stack.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200, resp.text
        assert stack.decode.full_reserves == 0 and len(stack.decode.reserved) == 1
    async with run_stack(model_dir, redis_url, script_for(tokenizer), queue_timeout_s=0.5) as stack:
        stack.decode.full_reserves = 10**6
        resp = await stack.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 429
        assert resp.headers["retry-after"] == "1"
        assert "no decode group had room" in resp.json()["error"]["message"]


async def test_per_group_limit_queues_the_next_request(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = script_for(tokenizer, delay_s=0.05)
    async with run_stack(
        model_dir, redis_url, script, max_inflight_per_group=1, queue_timeout_s=30
    ) as stack:
        first = asyncio.create_task(stack.client.post("/v1/chat/completions", json=chat_body()))
        await _until_generating(stack)
        second = asyncio.create_task(stack.client.post("/v1/chat/completions", json=chat_body()))
        await asyncio.sleep(0.3)
        assert len(stack.decode.reserved) == 1  # the second waits for the group's slot
        assert (await first).status_code == 200
        assert (await second).status_code == 200
        assert len(stack.decode.reserved) == 2


async def test_api_keys(model_dir: Path, redis_url: str, tokenizer: Tokenizer) -> None:
    async with run_stack(model_dir, redis_url, script_for(tokenizer), api_keys="k1,k2") as stack:
        good = {"Authorization": "Bearer k2"}
        assert (await stack.client.get("/v1/models", headers=good)).status_code == 200
        for auth in ("", "Bearer wrong", "Basic k2", "Bearer k1,k2"):
            resp = await stack.client.post(
                "/v1/chat/completions", json=chat_body(), headers={"Authorization": auth}
            )
            assert resp.status_code == 401, auth
            assert resp.json()["error"]["type"] == "authentication_error"
        assert (await stack.client.get("/health", headers={"Authorization": ""})).status_code == 200
        resp = await stack.client.post("/v1/chat/completions", json=chat_body(), headers=good)
        assert resp.status_code == 200
        # Request records and worker pids are behind the same keys.
        assert (await stack.client.get("/admin/workers")).status_code == 401
        assert (await stack.client.get("/admin/workers", headers=good)).status_code == 200


async def test_metrics_count_ttft(model_dir: Path, redis_url: str, tokenizer: Tokenizer) -> None:
    async with run_stack(model_dir, redis_url, script_for(tokenizer)) as stack:
        for _ in range(3):
            resp = await stack.client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
            assert resp.status_code == 200
        text = (await stack.client.get("/metrics")).text
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
        model = (("model_name", "tpla-test"),)
        assert samples[("tpla:time_to_first_token_seconds_count", model)] == 3
        assert samples[("tpla:e2e_request_latency_seconds_count", model)] == 3
        assert samples[("tpla:inter_token_latency_seconds_count", model)] == 6
        assert samples[("tpla:generation_tokens_total", model)] == 9
        finished = (*model, ("outcome", "finished"))
        assert samples[("tpla:requests_total", tuple(sorted(finished)))] == 3
        assert samples[("tpla:num_requests_running", model)] == 0

"""n > 1 choices and completions' echo / prompt batches through the router: real Redis,
real gRPC fake workers (every choice follows the script), real uvicorn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.text.tokenizer import Tokenizer
from tests.integration.router.test_lifecycle import TEXT, chat_body, script_for, sse_events
from tests.router_rig import run_stack

pytestmark = pytest.mark.anyio


async def test_n_choices_share_one_reservation_and_prefill(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    async with run_stack(model_dir, redis_url, script_for(tokenizer)) as stack:
        resp = await stack.client.post("/v1/chat/completions", json=chat_body(n=3, seed=4))
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert {c["message"]["content"] for c in body["choices"]} == {TEXT}
        # One Reserve and one Prefill for all choices; Generate forks them.
        [reserve] = stack.decode.reserved
        [prefill] = stack.prefills[0].calls
        [generate] = stack.decode.generated
        assert (reserve.n, prefill.n, len(generate.first_tokens)) == (3, 3, 3)
        prompt_len = reserve.prompt_len
        per_choice = len(stack.script.ids)
        assert body["usage"] == {
            "prompt_tokens": prompt_len,
            "completion_tokens": 3 * per_choice,
            "total_tokens": prompt_len + 3 * per_choice,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        record = await stack.record(body["id"])
        assert record["state"] == "FINISHED" and record["finish_reason"] == "stop,stop,stop"


async def test_a_stop_string_ends_one_choice_and_the_last_ends_the_request(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    async with run_stack(model_dir, redis_url, script_for(tokenizer)) as stack:
        body = chat_body(
            n=2, stream=True, stop=[" brown f"], stream_options={"include_usage": True}
        )
        async with stack.client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            events = await sse_events(resp)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        rid = chunks[0]["id"]
        texts, reasons = ["", ""], {}
        for chunk in chunks:
            for c in chunk["choices"]:
                texts[c["index"]] += c["delta"].get("content") or ""
                if c["finish_reason"]:
                    reasons[c["index"]] = c["finish_reason"]
        assert texts == ["the quick"] * 2 and reasons == {0: "stop", 1: "stop"}
        assert chunks[-1]["usage"]["completion_tokens"] == 2 * 5
        # Choice 0 stopped first: aborted alone; then the last one ends the whole request.
        assert stack.decode.choice_aborts == [(rid, (0,))]
        assert stack.decode.aborted == [rid]


async def test_completions_batch_with_echo_and_prompt_logprobs(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    async with run_stack(model_dir, redis_url, script_for(tokenizer)) as stack:
        prompts = ["hello there", "the lazy dog"]
        body = {
            "model": "tpla-test",
            "prompt": prompts,
            "n": 2,
            "echo": True,
            "logprobs": 1,
            "max_tokens": 3,
        }
        resp = await stack.client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
        for c in out["choices"]:
            prompt = prompts[c["index"] // 2]
            assert c["text"].startswith(prompt) and len(c["text"]) > len(prompt)
            lp = c["logprobs"]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert len(lp["tokens"]) == len(tokenizer.encode(prompt)) + 3
        # Each prompt its own request <id>-<k>, each asking the prefill for prompt logprobs.
        calls = sorted((c for p in stack.prefills for c in p.calls), key=lambda c: c.request_id)
        assert [c.request_id for c in calls] == [f"{out['id']}-0", f"{out['id']}-1"]
        assert all(c.n == 2 and c.prompt_logprobs == 1 for c in calls)
        prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
        assert out["usage"]["prompt_tokens"] == prompt_tokens
        assert out["usage"]["completion_tokens"] == 4 * 3
        for k in (0, 1):
            record = await stack.record(f"{out['id']}-{k}")
            assert record["state"] == "FINISHED"


async def test_echo_with_zero_max_tokens_scores_the_prompt_only(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    async with run_stack(model_dir, redis_url, script_for(tokenizer)) as stack:
        body = {"model": "tpla-test", "prompt": "hello there", "echo": True, "max_tokens": 0}
        resp = await stack.client.post("/v1/completions", json={**body, "logprobs": 2})
        assert resp.status_code == 200, resp.text
        out = resp.json()
        [choice] = out["choices"]
        assert choice["text"] == "hello there" and choice["finish_reason"] == "length"
        prompt_len = len(tokenizer.encode("hello there"))
        assert len(choice["logprobs"]["tokens"]) == prompt_len
        assert out["usage"]["completion_tokens"] == 0
        # Prefilled and scored, never decoded: the reservation is given back at once.
        assert stack.decode.generated == [] and stack.decode.aborted == [out["id"]]
        assert (await stack.record(out["id"]))["state"] == "FINISHED"
        resp = await stack.client.post("/v1/completions", json={**body, "echo": False})
        assert resp.status_code == 400 and "needs echo" in resp.json()["error"]["message"]

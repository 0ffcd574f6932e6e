"""A reasoning model through the router on the rig (tests/router_rig.py): a V3.1-style template
switched by chat_template_kwargs, the scripted workers writing reasoning, </think> and an
answer. The reasoning comes back apart from the content, under both names, streamed and not,
for every choice, read by the official openai client from `model_extra`; the workers are told
the think-end token and the budget; tools and structured outputs after the thinking, a
cut-off inside it, a migration in the middle of it; DeepSeek-V3.2's DSML calls inside its
thinking."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from common.rpc.gen import decode_pb2
from common.text.deepseek_v32 import dsml_calls
from common.text.tokenizer import Tokenizer
from tests.integration.router.test_tools import DEEPSEEK_MARKERS, deepseek_call
from tests.router_rig import Script, chat, run_stack
from tests.tiny import save_reasoning_tokenizer
from tests.unit.services.router.test_tools import TOOLS

pytestmark = pytest.mark.anyio

THINK = {"chat_template_kwargs": {"thinking": True}}
REASONING = "Two and two make four"
ANSWER = "It is 4."


@pytest.fixture(scope="module")
def reasoning_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_reasoning_tokenizer(tmp_path_factory.mktemp("v31-like"), 400, DEEPSEEK_MARKERS)


@pytest.fixture(scope="module")
def tok(reasoning_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(reasoning_dir)


def _ids(tok: Tokenizer, reasoning: str, answer: str | list[int]) -> list[int]:
    end = tok.encode("</think>")
    tail = tok.encode(answer) if isinstance(answer, str) else answer
    return [*tok.encode(reasoning), *end, *tail, *tok.eos_token_ids]


def _events(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: {")
    ]


def _assembled(events: list[dict[str, Any]], n: int = 1) -> list[dict[str, Any]]:
    out = [{"reasoning": "", "content": "", "reason": None} for _ in range(n)]
    for e in events:
        for c in e["choices"]:
            got, delta = out[c["index"]], c["delta"]
            assert delta.get("reasoning") == delta.get("reasoning_content"), delta
            got["reasoning"] += delta.get("reasoning") or ""
            got["content"] += delta.get("content") or ""
            got["reason"] = c["finish_reason"] or got["reason"]
    return out


async def test_thinking_switch_reasoning_apart_n_choices_and_usage(
    reasoning_dir: Path, tok: Tokenizer, redis_url: str
) -> None:
    ids = _ids(tok, REASONING, ANSWER)
    (end,) = tok.encode("</think>")
    async with run_stack(reasoning_dir, redis_url, Script(ids)) as stack:
        body = chat(max_tokens=64, n=2, **THINK)
        resp = await stack.client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        for c in out["choices"]:
            message = c["message"]
            assert message["reasoning_content"] == message["reasoning"] == REASONING
            assert message["content"] == ANSWER and c["finish_reason"] == "stop"
        thought = len(tok.encode(REASONING))
        assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * thought}
        # The template opened <think>; the workers end the thinking at </think>.
        prefill = stack.prefills[0].calls[-1]
        assert tok.decode(prefill.prompt_ids[-1:], skip_special_tokens=False) == "<think>"
        assert list(prefill.params.think_end_ids) == [end]
        assert not prefill.params.HasField("thinking_budget")
        assert list(stack.decode.generated[-1].params.think_end_ids) == [end]
        # Streamed: every choice's reasoning, then its content.
        resp = await stack.client.post(
            "/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        )
        events = _events(resp.text)
        for got in _assembled(events, 2):
            assert got == {"reasoning": REASONING, "content": ANSWER, "reason": "stop"}
        usage = events[-1]["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 2 * thought}
        # Not thinking (the template's default): the prompt closed </think>, no reasoning.
        resp = await stack.client.post("/v1/chat/completions", json=chat(max_tokens=64))
        message = resp.json()["choices"][0]["message"]
        assert "reasoning" not in message and "reasoning_content" not in message
        assert message["content"] == f"{REASONING}</think>{ANSWER}"
        assert "completion_tokens_details" not in resp.json()["usage"]
        prefill = stack.prefills[0].calls[-1]
        assert tok.decode(prefill.prompt_ids[-1:], skip_special_tokens=False) == "</think>"
        assert list(prefill.params.think_end_ids) == []


async def test_the_openai_client_reads_reasoning_and_content(
    reasoning_dir: Path, tok: Tokenizer, redis_url: str
) -> None:
    async with run_stack(reasoning_dir, redis_url, Script(_ids(tok, REASONING, ANSWER))) as stack:
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
        messages: Any = [{"role": "user", "content": "2+2?"}]
        resp = await client.chat.completions.create(
            model="tpla-test", messages=messages, max_tokens=64, extra_body=THINK
        )
        message = resp.choices[0].message
        assert message.content == ANSWER
        assert message.model_extra == {"reasoning_content": REASONING, "reasoning": REASONING}
        stream = await client.chat.completions.create(
            model="tpla-test", messages=messages, max_tokens=64, extra_body=THINK, stream=True
        )
        reasoning = content = ""
        async for chunk in stream:
            for c in chunk.choices:
                extra = c.delta.model_extra or {}
                assert extra.get("reasoning") == extra.get("reasoning_content")
                reasoning += extra.get("reasoning_content") or ""
                content += c.delta.content or ""
        assert (reasoning, content) == (REASONING, ANSWER)
        await client.close()


async def test_cut_off_in_the_reasoning_and_a_budget(
    reasoning_dir: Path, tok: Tokenizer, redis_url: str
) -> None:
    ids = _ids(tok, REASONING, ANSWER)
    async with run_stack(reasoning_dir, redis_url, Script(ids)) as stack:
        body = chat(max_tokens=3, thinking_token_budget=5, **THINK)
        for stream in (False, True):
            resp = await stack.client.post("/v1/chat/completions", json={**body, "stream": stream})
            if stream:
                [got] = _assembled(_events(resp.text))
            else:
                [c] = resp.json()["choices"]
                got = {
                    "reasoning": c["message"]["reasoning"],
                    "content": c["message"]["content"],
                    "reason": c["finish_reason"],
                }
            assert got == {"reasoning": tok.decode(ids[:3]), "content": "", "reason": "length"}
        assert stack.prefills[0].calls[-1].params.thinking_budget == 5


async def test_tools_and_structured_outputs_after_the_thinking(
    reasoning_dir: Path, tok: Tokenizer, redis_url: str
) -> None:
    ids = _ids(tok, "I should call it", deepseek_call(tok, "get_weather", '{"city": "Rome"}'))
    async with run_stack(reasoning_dir, redis_url, Script(ids)) as stack:
        body = chat(max_tokens=64, tools=TOOLS, **THINK)
        resp = await stack.client.post("/v1/chat/completions", json=body)
        [c] = resp.json()["choices"]
        assert c["finish_reason"] == "tool_calls"
        assert c["message"]["reasoning_content"] == "I should call it"
        [called] = c["message"]["tool_calls"]
        assert called["function"]["name"] == "get_weather"
        assert json.loads(called["function"]["arguments"]) == {"city": "Rome"}
    ids = _ids(tok, "a JSON object", '{"a": 1}')
    async with run_stack(reasoning_dir, redis_url, Script(ids)) as stack:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        resp = await stack.client.post(
            "/v1/chat/completions", json=chat(max_tokens=64, response_format=fmt, **THINK)
        )
        message = resp.json()["choices"][0]["message"]
        assert message["reasoning"] == "a JSON object"
        assert json.loads(message["content"]) == {"a": 1}
        # The grammar and the think-end token both go to the workers: it starts after it.
        params = stack.prefills[0].calls[-1].params
        assert params.HasField("grammar") and list(params.think_end_ids) == tok.encode("</think>")


@pytest.mark.parametrize("stream", [True, False])
async def test_a_migration_in_the_middle_of_the_reasoning(
    reasoning_dir: Path, tok: Tokenizer, redis_url: str, stream: bool
) -> None:
    ids = _ids(tok, REASONING, ANSWER)
    k = len(tok.encode(REASONING)) // 2
    async with run_stack(reasoning_dir, redis_url, Script(ids), decode_groups=2) as stack:
        # The first group streams half the reasoning and dies; the second goes on from there.
        stack.decodes[0].script = Script(
            ids[:k], final="error: rank 1 died", failure=decode_pb2.FAILURE_SCOPE_GROUP
        )
        resp = await stack.client.post(
            "/v1/chat/completions", json=chat(max_tokens=64, stream=stream, **THINK)
        )
        assert resp.status_code == 200, resp.text
        if stream:
            [got] = _assembled(_events(resp.text))
            assert got == {"reasoning": REASONING, "content": ANSWER, "reason": "stop"}
        else:
            message = resp.json()["choices"][0]["message"]
            assert (message["reasoning"], message["content"]) == (REASONING, ANSWER)
            details = resp.json()["usage"]["completion_tokens_details"]
            assert details == {"reasoning_tokens": len(tok.encode(REASONING))}
        moved = stack.decodes[1].generated[-1]
        assert list(moved.output_ids) == ids[:k]  # the thinking so far goes along
        assert list(moved.params.think_end_ids) == tok.encode("</think>")


@pytest.fixture(scope="module")
def v32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_reasoning_tokenizer(tmp_path_factory.mktemp("v32-like"), model_type="deepseek_v32")


async def test_deepseek_v32_dsml_calls_inside_and_after_the_thinking(
    v32_dir: Path, redis_url: str
) -> None:
    tok = Tokenizer.from_dir(v32_dir)
    thinking = f"Time first.\n\n{dsml_calls([('get_time', '{}')])}\nNow the weather."
    answer = f"Here:\n\n{dsml_calls([('get_weather', json.dumps({'city': 'Oslo'}))])}"
    async with run_stack(v32_dir, redis_url, Script(_ids(tok, thinking, answer))) as stack:
        body = chat(max_tokens=400, tools=TOOLS, **THINK)
        resp = await stack.client.post("/v1/chat/completions", json=body)
        [c] = resp.json()["choices"]
        assert c["finish_reason"] == "tool_calls"
        message = c["message"]
        assert message["reasoning"] == "Time first.\nNow the weather."
        assert message["content"] == "Here:"
        calls = [(t["function"]["name"], t["function"]["arguments"]) for t in message["tool_calls"]]
        assert calls == [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]
        # The prompt: V3.2's format, thinking opened, the tools described in DSML.
        prompt = tok.decode(stack.prefills[0].calls[-1].prompt_ids, skip_special_tokens=False)
        assert "<｜DSML｜function_calls>" in prompt and prompt.endswith("<｜Assistant｜><think>")
        resp = await stack.client.post("/v1/chat/completions", json={**body, "stream": True})
        events = _events(resp.text)
        [got] = _assembled(events)
        assert got == {
            "reasoning": message["reasoning"],
            "content": "Here:",
            "reason": "tool_calls",
        }
        streamed = [
            (t["function"]["name"], t["function"]["arguments"])
            for e in events
            for ch in e["choices"]
            for t in ch["delta"].get("tool_calls") or []
        ]
        assert streamed == calls


async def test_template_variables_the_router_sets_itself_are_refused(client: Any) -> None:
    body = chat(chat_template_kwargs={"messages": [], "thinking": True})
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "chat_template_kwargs"
    resp = await client.post("/v1/chat/completions", json=chat(thinking_token_budget=-1))
    assert resp.status_code == 400 and "thinking_token_budget" in resp.text
    bad = {"role": "user", "content": "q", "reasoning_content": "r"}
    resp = await client.post("/v1/chat/completions", json=chat(messages=[bad]))
    assert resp.status_code == 400 and "reasoning_content" in resp.text

"""A reasoning model end to end on real parts: a tiny random DeepSeek-V3 checkpoint with a
V3.1-style template (tests/tiny.py), its decode group and prefill worker serving gRPC from
threads (tests/stack.py), the router on a socket, the official openai client. The random
model never closes its thinking by itself, so a thinking budget does: the prefill worker and
the decode leader force </think> when it is spent, and the grammar (a structured output, a
named or required tool) holds from there on; the reasoning comes back apart from the
content, streamed and not, for every choice; a cut-off inside the reasoning ends `length`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from common.runtime.settings import Settings
from common.text.tokenizer import Tokenizer
from tests.router_rig import anyio_backend, redis_server, redis_url, serve_router
from tests.stack import one_rank_group, services_in_threads
from tests.tiny import save_hf, save_reasoning_tokenizer

__all__ = ["anyio_backend", "redis_server", "redis_url"]  # the rig's fixtures, used here

pytestmark = pytest.mark.anyio

MODEL = "tiny-reasoning"
THINK = {"chat_template_kwargs": {"thinking": True}}
MESSAGES: Any = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reasoning-model")
    save_hf("v3-qnull-halfrope", out, vocab_size=320, std=0.08)
    return save_reasoning_tokenizer(out, 320)


@pytest.fixture(scope="module")
def workers(model_dir: Path, redis_server: Any) -> Iterator[None]:
    cfg = one_rank_group(model_dir)
    with services_in_threads(cfg, redis_server.url, start_timeout_s=120, heartbeat_s=0.2):
        yield


@pytest.fixture
async def client(model_dir: Path, workers: None, redis_server: Any) -> AsyncIterator[Any]:
    settings = Settings(model=str(model_dir), served_model_name=MODEL)
    async with serve_router(settings, redis_server.url) as base:
        c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        yield c
        await c.close()


async def _both(client: Any, **kw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each choice's reasoning, content, calls and finish reason, non-streamed then streamed;
    the reasoning read from `model_extra` under both names."""
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0.0, **kw}
    resp = await client.chat.completions.create(**body)
    whole = []
    for c in resp.choices:
        extra = c.message.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        calls = [
            (t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []
        ]
        whole.append(
            {
                "reasoning": extra.get("reasoning"),
                "content": c.message.content or "",
                "calls": calls,
                "reason": c.finish_reason,
            }
        )
    streamed: list[dict[str, Any]] = [
        {"reasoning": "", "content": "", "calls": {}, "reason": None} for _ in whole
    ]
    async for chunk in await client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            got, extra = streamed[c.index], c.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            got["reasoning"] += extra.get("reasoning") or ""
            got["content"] += c.delta.content or ""
            got["reason"] = c.finish_reason or got["reason"]
            for t in c.delta.tool_calls or []:
                name, args = got["calls"].get(t.index, (None, ""))
                got["calls"][t.index] = (
                    name or t.function.name,
                    args + (t.function.arguments or ""),
                )
    for got in streamed:
        got["calls"] = [
            (n, json.loads(a)) for n, a in (got["calls"][k] for k in sorted(got["calls"]))
        ]
        got["reasoning"] = got["reasoning"] or None
    return whole, streamed


async def test_a_budget_ends_the_thinking_and_the_grammar_holds_after_it(
    client: Any, model_dir: Path
) -> None:
    tok = Tokenizer.from_dir(model_dir)
    choice = {"structured_outputs": {"choice": ["alpha", "beta"]}}
    # min_tokens: the random model may not end before its answer (EOS is its own choice).
    kw = {**THINK, **choice, "thinking_token_budget": 3, "min_tokens": 4, "max_tokens": 24}
    whole, streamed = await _both(client, n=2, extra_body=kw)
    assert streamed == whole
    for got in whole:
        assert got["content"] in ("alpha", "beta") and got["reason"] == "stop", got
        assert got["reasoning"], got
    resp = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0.0, extra_body=kw
    )
    # Three thinking tokens (the random model did not end its thinking before), </think>,
    # the answer's tokens.
    [got] = [c.message for c in resp.choices]
    assert resp.usage.completion_tokens_details.reasoning_tokens == 3
    assert resp.usage.completion_tokens == 3 + 1 + len(tok.encode(got.content or "")) + 1


# A tool whose arguments the grammar bounds: the random model's call always completes.
SWITCH = {
    "type": "function",
    "function": {
        "name": "switch",
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}},
            "required": ["on"],
            "additionalProperties": False,
        },
    },
}


async def test_tool_calls_after_the_thinking(client: Any) -> None:
    named = {"type": "function", "function": {"name": "switch"}}
    kw = {**THINK, "thinking_token_budget": 2, "min_tokens": 3, "max_tokens": 64}
    for tool_choice in (named, "required"):
        whole, streamed = await _both(
            client,
            tools=[SWITCH],
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            extra_body=kw,
        )
        assert streamed == whole
        [got] = whole
        assert got["reasoning"] and got["reason"] == "tool_calls", got
        [(name, arguments)] = got["calls"]
        assert name == "switch" and arguments in ({"on": True}, {"on": False})


async def test_cut_off_inside_the_reasoning(client: Any) -> None:
    kw = {**THINK, "max_tokens": 3, "min_tokens": 3}
    whole, streamed = await _both(client, n=2, extra_body=kw)
    assert streamed == whole
    for got in whole:
        assert got["reason"] == "length" and got["content"] == "" and got["reasoning"], got
    # Not thinking: no reasoning, the same tokens are content.
    plain, _ = await _both(client, extra_body={"max_tokens": 3, "min_tokens": 3})
    assert plain[0]["reasoning"] is None and plain[0]["content"]

"""Each family's own chat template, special tokens and tool-call markup through the router on
the rig (tests/router_rig.py): Kimi K2 (its tiktoken vocabulary, its call section), GLM-4.7
(<tool_call> with <arg_key>/<arg_value>), Mistral ([TOOL_CALLS]NAME[ARGS]JSON). The scripted
workers write the family's markup; the router picks the markup by the template, keeps the
special tokens, and answers tool_calls whole and streamed; an earlier turn's calls render
back through the template in the family's markup; an image in a message is a 400."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.text.tokenizer import Tokenizer
from tests.router_rig import Script, chat, run_stack
from tests.tiny_families import save_family_tokenizer, save_kimi_tokenizer
from tests.unit.services.router.test_tools import TOOLS

pytestmark = pytest.mark.anyio

ARGS = {"city": "Rome", "days": 3}


def _kimi(tok: Tokenizer) -> list[int]:
    return tok.encode(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        f"<|tool_call_argument_begin|>{json.dumps(ARGS)}<|tool_call_end|>"
        "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>"
    )


def _glm(tok: Tokenizer) -> list[int]:
    return tok.encode(
        "\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
        "<tool_call>get_time</tool_call>"
    )


def _mistral(tok: Tokenizer) -> list[int]:
    return tok.encode(
        f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(ARGS)}[TOOL_CALLS]get_time[ARGS]{{}}"
    )


# family -> (model directory writer, the model's call tokens, how its template renders a call)
FAMILIES: dict[str, tuple[Callable[[Path], Path], Callable[[Tokenizer], list[int]], str]] = {
    "kimi_k25": (
        lambda p: save_kimi_tokenizer(p, "kimi_k25"),
        _kimi,
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Rome"}',
    ),
    "glm4_moe_lite": (
        lambda p: save_family_tokenizer(p, "glm4_moe_lite"),
        _glm,
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>",
    ),
    "mistral3": (
        lambda p: save_family_tokenizer(p, "mistral3"),
        _mistral,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(request.param)


def _events(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: {")
    ]


async def test_a_familys_calls_become_tool_calls(
    family: str, tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> None:
    save, call_tokens, rendered = FAMILIES[family]
    model_dir = save(tmp_path_factory.mktemp(family))
    tok = Tokenizer.from_dir(model_dir)
    ids = [*tok.encode("Sure."), *call_tokens(tok), *tok.eos_token_ids]
    expected = [("get_weather", ARGS), ("get_time", {})]
    async with run_stack(model_dir, redis_url, Script(ids)) as stack:
        body = chat(tools=TOOLS, max_tokens=len(ids) + 4)
        resp = await stack.client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Sure."
        calls = choice["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == (
            expected
        )
        if family == "kimi_k25":  # Kimi's own ids, which its template writes back
            assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
        # The tools reached the prompt through the family's template.
        prompt = tok.decode(stack.prefills[0].calls[-1].prompt_ids, skip_special_tokens=False)
        assert "get_weather" in prompt
        resp = await stack.client.post("/v1/chat/completions", json={**body, "stream": True})
        events = _events(resp.text)
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == "Sure."
        streamed = [c for d in deltas for c in d.get("tool_calls") or []]
        assert [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed
        ] == (expected)
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # An earlier turn's call goes back to the model in its own markup.
        call = {
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
        }
        history = [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
        ]
        resp = await stack.client.post("/v1/chat/completions", json={**body, "messages": history})
        assert resp.status_code == 200, resp.text
        prompt = tok.decode(stack.prefills[0].calls[-1].prompt_ids, skip_special_tokens=False)
        assert rendered in prompt


async def test_an_image_is_a_clear_400(
    family: str, tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> None:
    model_dir = FAMILIES[family][0](tmp_path_factory.mktemp(family))
    async with run_stack(model_dir, redis_url, Script([1])) as stack:
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        content = [{"type": "text", "text": "What is this?"}, image]
        resp = await stack.client.post(
            "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": content}])
        )
        assert resp.status_code == 400
        assert "image_url" in resp.text and "text" in resp.text

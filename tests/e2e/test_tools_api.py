"""Tool calling through the served stack with the official `openai` client: a named function
and `required` give parseable tool_calls whose arguments validate against the function's
parameters (the tiny random model only manages that because decoding is constrained),
streaming sends tool_calls deltas, a conversation with tool results is served, and the KV
blocks are all free afterwards."""

from __future__ import annotations

import json

import jsonschema
import openai

from services.local_stack import LocalStack
from tests.e2e.test_sampling_api import _assert_blocks_free
from tests.stack import MODEL_NAME

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _create(stack: LocalStack, **kw: object):
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("max_tokens", 200)
    return _client(stack).chat.completions.create(model=MODEL_NAME, tools=TOOLS, **kw)


def test_named_and_required_tool_calls_validate(stack: LocalStack) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(2):
        resp = _create(stack, tool_choice=named, temperature=1.0, seed=seed)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    for seed in range(2):
        resp = _create(
            stack, tool_choice="required", temperature=1.0, seed=seed, parallel_tool_calls=False
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("call_")
    _assert_blocks_free(stack)


def test_streamed_tool_call_deltas_assemble(stack: LocalStack) -> None:
    for choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        chunks = list(
            _create(
                stack,
                tool_choice=choice,
                temperature=0.8,
                seed=4,
                stream=True,
                parallel_tool_calls=False,
            )
        )
        calls: dict[int, dict[str, str]] = {}
        for chunk in chunks:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert calls and all(c["id"].startswith("call_") for c in calls.values())
        for c in calls.values():
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    _assert_blocks_free(stack)


def test_conversation_with_tool_results_and_auto(stack: LocalStack) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    resp = _create(stack, messages=history, temperature=0, max_tokens=12)
    choice = resp.choices[0]
    # `auto`: the tiny model decides; either way the answer is well formed.
    if choice.finish_reason == "tool_calls":
        assert all(c.function.name in SCHEMAS for c in choice.message.tool_calls)
    else:
        assert choice.message.tool_calls is None and choice.message.content is not None
    none = _create(stack, tool_choice="none", temperature=0, max_tokens=6)
    assert none.choices[0].message.tool_calls is None
    _assert_blocks_free(stack)

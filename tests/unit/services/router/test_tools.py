"""Tool calling's pure parts: the constraining grammars (through the real grammar compiler),
parsing DeepSeek-V3 markers and the JSON format, the chat stream's tool_calls deltas, the
prompt when the template renders no tools, and tool_choice validation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from common.sampling.grammar import GrammarCompiler
from common.text.tokenizer import Tokenizer
from services.router import tools
from services.router.chat_format import ChatFormat
from services.router.chat_schemas import ChatCompletionRequest
from services.router.prepare import ModelInfo, prepare_chat
from services.router.request import ChoiceEnd, Delta, Done
from services.router.text import TokenLogprob
from tests.router_rig import chat

WEATHER = tools.Tool(
    "get_weather",
    "Weather in a city",
    json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        }
    ),
)
TIME = tools.Tool("get_time", "", json.dumps({"type": "object", "properties": {}}))
TOOLS = [
    {"type": "function", "function": {"name": t.name, "parameters": t.schema}}
    for t in (WEATHER, TIME)
]


def _calling(mode: tools.ToolMode, named: str | None = None) -> tools.ToolCalling:
    return tools.ToolCalling(mode, (WEATHER, TIME), named)


def test_parse_deepseek_markers_both_variants_and_json() -> None:
    auto = _calling(tools.ToolMode.AUTO)
    v3 = (
        "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
        "<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    parsed = tools.parse(v3, auto)
    assert parsed is not None
    content, calls = parsed
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    v31 = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
        '{"tz": "UTC"}<｜tool▁call▁end｜>'
    )
    [call] = tools.parse(v31, auto)[1]  # type: ignore[index]
    assert (call.name, call.arguments) == ("get_time", '{"tz": "UTC"}')
    [call] = tools.parse('[{"name": "get_time", "parameters": {}}]', auto)[1]  # type: ignore[index]
    assert call.name == "get_time" and call.id.startswith("call_")
    for plain in ("hello", '[{"name": "nope", "parameters": {}}]', "[1, 2]", "[oops"):
        assert tools.parse(plain, auto) is None


def test_grammars_accept_valid_calls_only(tokenizer: Tokenizer, model_dir: Path) -> None:
    compiler = GrammarCompiler.from_model_dir(
        model_dir, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids)
    )
    assert compiler is not None

    def accepts(calling: tools.ToolCalling, text: str) -> bool:
        spec = tools.grammar(calling)
        assert spec is not None
        m = compiler.matcher(spec)
        return all(m.accept(t) for t in tokenizer.encode(text)) and m.accepting

    named = _calling(tools.ToolMode.NAMED, "get_weather")
    assert accepts(named, '{"city": "Oslo", "days": 3}')
    assert not accepts(named, '{"town": "Oslo"}')
    required = _calling(tools.ToolMode.REQUIRED)
    assert accepts(required, '[{"name": "get_time", "parameters": {}}]')
    assert not accepts(required, "[]")
    assert not accepts(required, '[{"name": "get_weather", "parameters": {}}]')  # city missing
    single = tools.ToolCalling(tools.ToolMode.REQUIRED, (WEATHER, TIME), parallel=False)
    two = '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]'
    assert accepts(required, two) and not accepts(single, two)
    assert tools.grammar(_calling(tools.ToolMode.AUTO)) is None


def _sse_json(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in lines if line]


def _end(fmt: ChatFormat, index: int = 0) -> list[dict[str, Any]]:
    return _sse_json(fmt.event(0, ChoiceEnd(index, "stop")))


def test_stream_sends_tool_call_deltas_and_content_passes_through() -> None:
    auto = ChatFormat("id", "m", False, False, calling=_calling(tools.ToolMode.AUTO))
    pieces = ['  [{"name": "get_', 'weather", ', '"parameters": {"city": "Rome"}}]']
    assert auto.event(0, Delta(pieces[0])) == []  # held: it may open a call
    [head] = _sse_json(auto.event(0, Delta(pieces[1])))  # it does: the name is known
    [call] = head["choices"][0]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": ""}
    [tail] = _sse_json(auto.event(0, Delta(pieces[2])))
    [call] = tail["choices"][0]["delta"]["tool_calls"]
    assert call["id"] is None and call["function"]["name"] is None
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    [chunk] = _end(auto)
    assert chunk["choices"][0]["finish_reason"] == "tool_calls"

    prose = ChatFormat("id", "m", True, False, calling=_calling(tools.ToolMode.AUTO))
    assert prose.event(0, Delta(" ", (TokenLogprob(" ", -0.5),))) == []  # may open a call
    [chunk] = _sse_json(prose.event(0, Delta(" Hi", (TokenLogprob(" Hi", -1.0),))))
    assert chunk["choices"][0]["delta"]["content"] == "  Hi"
    # The held token's logprob goes out with its text.
    assert [e["logprob"] for e in chunk["choices"][0]["logprobs"]["content"]] == [-0.5, -1.0]
    assert _end(prose)[-1]["choices"][0]["finish_reason"] == "stop"

    named = ChatFormat(
        "id", "m", False, False, calling=_calling(tools.ToolMode.NAMED, "get_weather")
    )
    first, second = (_sse_json(named.event(0, Delta(t)))[0] for t in ('{"city"', ': "Oslo"}'))
    head = first["choices"][0]["delta"]["tool_calls"][0]
    assert head["function"] == {"name": "get_weather", "arguments": '{"city"'} and head["id"]
    tail = second["choices"][0]["delta"]["tool_calls"][0]
    assert tail["id"] is None and tail["function"]["arguments"] == ': "Oslo"}'
    assert _end(named)[-1]["choices"][0]["finish_reason"] == "tool_calls"
    run = [Delta('{"city": "Oslo"}'), ChoiceEnd(0, "stop"), Done(("stop",), 3, 4)]
    full = named.full([run])
    [out] = full.choices[0].message.tool_calls  # type: ignore[misc]
    jsonschema.validate(json.loads(out.function.arguments), WEATHER.schema)
    assert full.choices[0].finish_reason == "tool_calls" and full.choices[0].message.content is None


def test_each_choice_is_parsed_for_tool_calls_on_its_own() -> None:
    """n = 2 under auto: choice 0 calls a tool while choice 1 writes prose; each choice's
    held text, chunks and finish_reason are its own."""
    fmt = ChatFormat("id", "m", False, False, n=2, calling=_calling(tools.ToolMode.AUTO))
    call = '[{"name": "get_time", "parameters": {}}]'
    [sent] = _sse_json(fmt.event(0, Delta(call, index=0)))
    assert sent["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "get_time"
    [prose] = _sse_json(fmt.event(0, Delta("Hello", index=1)))
    assert prose["choices"][0] == {**prose["choices"][0], "index": 1}
    assert prose["choices"][0]["delta"]["content"] == "Hello"
    [end] = _end(fmt, 0)
    assert end["choices"][0]["index"] == 0 and end["choices"][0]["finish_reason"] == "tool_calls"
    assert _end(fmt, 1)[-1]["choices"][0]["finish_reason"] == "stop"
    run = [
        Delta(call, index=0),
        Delta("Hello", index=1),
        ChoiceEnd(0, "stop"),
        ChoiceEnd(1, "stop"),
        Done(("stop", "stop"), 3, 9),
    ]
    full = fmt.full([run])
    assert [c.finish_reason for c in full.choices] == ["tool_calls", "stop"]
    assert full.choices[1].message.content == "Hello" and not full.choices[1].message.tool_calls


def test_prompt_describes_tools_when_the_template_does_not(
    tokenizer: Tokenizer, model_dir: Path
) -> None:
    info = ModelInfo(
        "tpla-test",
        tokenizer,
        4096,
        grammars=GrammarCompiler.from_model_dir(
            model_dir, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids)
        ),
    )
    body = ChatCompletionRequest.model_validate(
        chat(
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=8,
            messages=[
                {"role": "user", "content": "t?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_time", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "noon"},
            ],
        )
    )
    req = prepare_chat(body, info, 0.0)
    assert req.tools is not None and req.tools.mode is tools.ToolMode.NAMED
    assert req.params.grammar == tools.grammar(req.tools)
    text = tokenizer.decode(list(req.prompt_ids), skip_special_tokens=False)
    assert "You can call these tools" in text and "get_weather" in text
    assert "Tool result (c1): noon" in text and '"name": "get_time"' in text


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (chat(tool_choice="required"), "tool_choice", "needs tools"),
        (
            chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
            "not in tools",
        ),
        (chat(tools=[TOOLS[0], TOOLS[0]]), "tools", "unique"),
        (
            chat(tools=[{"type": "function", "function": {"name": "bad name"}}]),
            "tools.0.function.name",
            "",
        ),
        (
            chat(
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "zzz"}}}
                ],
                tool_choice="required",
            ),
            "tools",
            "zzz",
        ),
        (
            chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
            "tool_choice",
            "cannot be combined",
        ),
        (chat(messages=[{"role": "tool", "content": "x"}]), "messages.0", "tool_call_id"),
        (
            chat(
                messages=[
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c1", "function": {"name": "f", "arguments": "}not json"}}
                        ],
                    }
                ]
            ),
            "messages",
            "not valid JSON",
        ),
        (
            chat(messages=[{"role": "user", "content": None}]),
            "messages.0.content",
            "content is required",
        ),
    ],
)
async def test_bad_tool_requests_are_400(
    client: httpx.AsyncClient, body: dict[str, Any], param: str, fragment: str
) -> None:
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and fragment in error["message"], error

"""Sampling controls, structured outputs and tools through the served stack with the official
`openai` client, in the TPLA, MLA-TP and SP decode layouts: what the client asks for holds
from the first token (prefill worker) to the last (decode leader), every structured output
parses and validates, named and `required` tool calls give arguments valid for their
function (the tiny random model manages that only because decoding is constrained),
streaming sends tool_calls deltas, and the KV blocks are all free afterwards."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from common.text.tokenizer import Tokenizer
from tests.stack import MODEL_NAME, start_stack
from tools.local_stack import LocalStack

LAYOUTS = {
    "tpla": {"TP": "2", "LATENT_GROUPS": "2"},
    "mla-tp": {"TP": "2", "LATENT_GROUPS": "1", "PARALLEL": "mla-tp"},
    "sp": {"TP": "2", "LATENT_GROUPS": "1", "PARALLEL": "sp", "CHUNK_SIZE": "4"},
}
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[LocalStack]:
    s = start_stack(tiny_model, "grpc", **LAYOUTS[request.param])
    yield s
    s.stop()


# Tests whose engine side the other layouts add nothing to (tests/integration covers it
# in every layout) run on the TPLA stack only; the fixture's instance is shared.
ONLY_TPLA = pytest.mark.parametrize("served", ["tpla"], indirect=True)


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(stack: LocalStack, **kw: object):
    kw.setdefault("messages", MESSAGES)
    return _client(stack).chat.completions.create(model=MODEL_NAME, **kw)


def _token(stack: LocalStack, text: str) -> int:
    [tid] = Tokenizer.from_dir(stack.model_dir).encode(text)
    return tid


def _assert_blocks_free(stack: LocalStack) -> None:
    """Every decode rank reports no KV block in use (its heartbeat lags a little)."""
    used: list[int] = []
    for _ in range(50):
        workers = httpx.get(f"{stack.url}/admin/workers", timeout=10).json()
        used = [w["kv_blocks_used"] for w in workers if w["role"] == "decode"]
        if used and not any(used):
            return
        time.sleep(0.2)
    raise AssertionError(f"KV blocks still in use: {used}")


def test_logit_bias_min_tokens_and_stop_token_ids(served: LocalStack) -> None:
    tok = Tokenizer.from_dir(served.model_dir)
    [eos] = tok.eos_token_ids
    forced = _token(served, "e")
    resp = _chat(served, max_tokens=5, temperature=1.0, seed=3, logit_bias={str(forced): 100})
    assert resp.choices[0].message.content == "e" * 5
    # EOS biased to win at every step: min_tokens holds it off for 3 tokens, prefill's first
    # token included; then it ends the request (counted, never shown).
    resp = _chat(
        served,
        max_tokens=10,
        temperature=0,
        logit_bias={str(eos): 100, str(forced): 50},
        extra_body={"min_tokens": 3},
    )
    assert resp.choices[0].message.content == "eee"
    assert resp.choices[0].finish_reason == "stop" and resp.usage.completion_tokens == 4
    resp = _chat(
        served,
        max_tokens=10,
        temperature=0,
        logit_bias={str(forced): 100},
        extra_body={"stop_token_ids": [forced]},
    )
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.content == ""
    _assert_blocks_free(served)


@ONLY_TPLA
def test_presence_and_frequency_penalties_pick_the_penalized_argmax(served: LocalStack) -> None:
    """Greedy: each token is the argmax of raw logprob - penalties over its own earlier
    tokens (additive penalties commute with log-softmax); checked over the top-20. Tokens
    whose text is ambiguous (partial UTF-8) are biased away so every pick has one id."""
    tok = Tokenizer.from_dir(served.model_dir)
    by_text: dict[str, list[int]] = {}
    for i in range(tok.vocab_size):
        by_text.setdefault(tok.decode([i], skip_special_tokens=False), []).append(i)
    ids = {text: i[0] for text, i in by_text.items() if len(i) == 1}
    away = {str(t): -100 for group in by_text.values() if len(group) > 1 for t in group}
    common = dict(max_tokens=16, temperature=0, logit_bias=away, logprobs=True)
    plain = _chat(served, top_logprobs=1, **common)
    pen = _chat(
        served,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        top_logprobs=20,
        extra_body={"ignore_eos": True},
        **common,
    )
    entries = pen.choices[0].logprobs.content
    seen: dict[int, int] = {}
    for entry in entries:
        chosen = ids[entry.token]
        scores = {
            ids[alt.token]: alt.logprob
            - 1.0 * seen.get(ids[alt.token], 0)
            - 1.5 * (ids[alt.token] in seen)
            for alt in entry.top_logprobs
            if alt.token in ids
        }
        best = max(scores, key=scores.__getitem__)
        if chosen in scores:
            assert scores[chosen] >= scores[best] - 1e-3, (entry.token, seen)
        else:  # it beat every top-20 token only because all of them were penalized
            assert all(t in seen for t in scores)
        seen[chosen] = seen.get(chosen, 0) + 1
    assert [e.token for e in entries] != [e.token for e in plain.choices[0].logprobs.content]
    # Seeded sampling with penalties reproduces.
    kw = dict(max_tokens=12, temperature=1.0, seed=7, presence_penalty=0.5)
    kw |= {"extra_body": {"repetition_penalty": 1.3, "min_p": 0.05, "top_k": 50}}
    assert (
        _chat(served, **kw).choices[0].message.content
        == _chat(served, **kw).choices[0].message.content
    )
    _assert_blocks_free(served)


def test_json_schema_json_object_regex_and_choice(served: LocalStack) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    for seed in range(3):
        resp = _chat(served, max_tokens=250, temperature=1.0, seed=seed, response_format=fmt)
        assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
        jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMA)
    stream = _chat(
        served, max_tokens=250, temperature=0.7, seed=9, response_format=fmt, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    obj = _chat(served, max_tokens=160, temperature=0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # an unbounded object may run out of tokens; what came is a JSON prefix
        assert obj.choices[0].message.content.lstrip().startswith("{")
    regex = _chat(
        served,
        max_tokens=20,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
    )
    text = regex.choices[0].message.content
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
    choice = _chat(
        served,
        max_tokens=20,
        temperature=1.0,
        seed=2,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert choice.choices[0].message.content in ("red", "green", "blue")
    completion = _client(served).completions.create(
        model=MODEL_NAME,
        prompt="x",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"json": {"type": "boolean"}}},
    )
    assert json.loads(completion.choices[0].text) in (True, False)
    _assert_blocks_free(served)


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.body
    assert isinstance(body, dict)
    return body.get("error", body)


@ONLY_TPLA
def test_bad_schema_is_a_400_naming_it(served: LocalStack) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as err:
        _chat(served, response_format=bad)
    assert _error(err.value)["param"] == "response_format"
    assert "nope" in _error(err.value)["message"]
    with pytest.raises(openai.BadRequestError) as err:
        _chat(served, presence_penalty=3.0)
    assert _error(err.value)["param"] == "presence_penalty"


# -- tools ------------------------------------------------------------------------------------

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
TOOL_MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


def _create(stack: LocalStack, **kw: object):
    kw.setdefault("messages", TOOL_MESSAGES)
    kw.setdefault("max_tokens", 200)
    return _client(stack).chat.completions.create(model=MODEL_NAME, tools=TOOLS, **kw)


@ONLY_TPLA
def test_named_and_required_tool_calls_validate(served: LocalStack) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(2):
        resp = _create(served, tool_choice=named, temperature=1.0, seed=seed)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    for seed in range(2):
        resp = _create(
            served, tool_choice="required", temperature=1.0, seed=seed, parallel_tool_calls=False
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("call_")
    _assert_blocks_free(served)


@ONLY_TPLA
def test_streamed_tool_call_deltas_assemble(served: LocalStack) -> None:
    for choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        chunks = list(
            _create(
                served,
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
    _assert_blocks_free(served)


@ONLY_TPLA
def test_conversation_with_tool_results_and_auto(served: LocalStack) -> None:
    history = [
        *TOOL_MESSAGES,
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
    resp = _create(served, messages=history, temperature=0, max_tokens=12)
    choice = resp.choices[0]
    # `auto`: the tiny model decides; either way the answer is well formed.
    if choice.finish_reason == "tool_calls":
        assert all(c.function.name in SCHEMAS for c in choice.message.tool_calls)
    else:
        assert choice.message.tool_calls is None and choice.message.content is not None
    none = _create(served, tool_choice="none", temperature=0, max_tokens=6)
    assert none.choices[0].message.tool_calls is None
    _assert_blocks_free(served)


@ONLY_TPLA
def test_cut_off_tool_calls_stream_and_agree(served: LocalStack) -> None:
    """`required` with parallel calls cut off by max_tokens, n = 2, greedy: the answer keeps
    every complete call, and the stream's calls are the same ones (the last one possibly
    as far as it got), each call's id and name in its first delta."""
    kw = {"tool_choice": "required", "temperature": 0, "max_tokens": 100, "n": 2}
    whole = _create(served, **kw)
    chunks = list(_create(served, stream=True, **kw))
    for choice in whole.choices:
        calls = [
            (c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls or []
        ]
        streamed: dict[int, dict[str, str]] = {}
        reason = None
        for chunk in chunks:
            for c in chunk.choices:
                if c.index != choice.index:
                    continue
                reason = c.finish_reason or reason
                for d in c.delta.tool_calls or []:
                    assert (d.index not in streamed) == bool(d.id and d.function.name)
                    entry = streamed.setdefault(d.index, {"name": d.function.name, "args": ""})
                    entry["args"] += d.function.arguments or ""
        # The tiny model writes call after call: 100 tokens end inside its second.
        assert reason == choice.finish_reason == "length" and calls
        got = [streamed[k] for k in sorted(streamed)]
        assert [(c["name"], json.loads(c["args"])) for c in got[: len(calls)]] == calls
        assert len(got) - len(calls) in ((0, 1) if reason == "length" else (0,))
        for name, args in calls:
            jsonschema.validate(args, SCHEMAS[name])
    _assert_blocks_free(served)

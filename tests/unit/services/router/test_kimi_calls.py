"""Kimi K2's tool calls read back (services/router/kimi_calls.py): the calls a section holds
with the model's own ids; reading stops at the first cut-off or malformed call, so a cut text
reads a prefix of the whole's calls."""

from __future__ import annotations

import json

from services.router.kimi_calls import calls
from tests.unit.services.router.markup_prefixes import assert_prefixes_read_prefixes

SECTION = (
    "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Rome"}<|tool_call_end|>'
    "<|tool_call_begin|> functions.get_time:1 <|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|>"
)


def test_a_section_reads_back_with_the_models_ids() -> None:
    assert [(n, json.loads(a), i) for n, a, i in calls(SECTION)] == [
        ("get_weather", {"city": "Rome"}, "functions.get_weather:0"),
        ("get_time", {}, "functions.get_time:1"),
    ]
    assert_prefixes_read_prefixes(calls, SECTION)


def test_malformed_calls_end_the_reading() -> None:
    bad = "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{nope<|tool_call_end|>"
    assert calls(bad + SECTION) == []
    listed = "<|tool_call_begin|>f<|tool_call_argument_begin|>[1]<|tool_call_end|>"
    assert calls(listed) == []
    assert calls("text<|tool_call_begin|>") == []

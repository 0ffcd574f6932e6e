"""Mistral's tool calls read back (services/router/mistral_calls.py): [TOOL_CALLS]NAME[ARGS]
and its JSON, one after another, a call complete with its arguments object (an optional
[CALL_ID] kept); reading stops at the first cut-off or malformed call."""

from __future__ import annotations

import json

from services.router.mistral_calls import calls
from tests.unit.services.router.markup_prefixes import assert_prefixes_read_prefixes

# After the first [TOOL_CALLS].
TEXT = (
    'get_weather[ARGS]{"city": "Rome", "opts": {"days": 3}}'
    "[TOOL_CALLS]get_time[CALL_ID]abc123XYZ[ARGS]{}"
)


def test_calls_read_back_each_complete_with_its_arguments() -> None:
    assert [(n, json.loads(a), i) for n, a, i in calls(TEXT)] == [
        ("get_weather", {"city": "Rome", "opts": {"days": 3}}, None),
        ("get_time", {}, "abc123XYZ"),
    ]
    assert_prefixes_read_prefixes(calls, TEXT)


def test_malformed_calls_end_the_reading() -> None:
    assert calls("f[ARGS][1, 2]") == []
    assert calls("f[ARGS]{nope}") == []
    assert calls('f[ARGS]{"a": 1} trailing[TOOL_CALLS]g[ARGS]{}') == [("f", '{"a": 1}', None)]

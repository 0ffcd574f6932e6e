"""GLM-4.5 / 4.7's tool calls read back (services/router/glm_calls.py): what its template
writes (GLM-4.7's compact form, GLM-4.5's with newlines) reads back as the same calls, values
as JSON where they parse; reading stops at the first cut-off or malformed call."""

from __future__ import annotations

import json

from services.router.glm_calls import calls
from tests.unit.services.router.markup_prefixes import assert_prefixes_read_prefixes

# After the first <tool_call>.
COMPACT = (
    "get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    '<tool_call>search<arg_key>q</arg_key><arg_value>{"a": [1, null]}</arg_value></tool_call>'
)
NEWLINES = (
    "get_time\n</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
    "<arg_value>Rome</arg_value>\n</tool_call>"
)


def test_both_layouts_read_back() -> None:
    assert [(n, json.loads(a)) for n, a, _ in calls(COMPACT)] == [
        ("get_weather", {"city": "Rome", "days": 3}),
        ("search", {"q": {"a": [1, None]}}),
    ]
    assert [(n, json.loads(a)) for n, a, _ in calls(NEWLINES)] == [
        ("get_time", {}),
        ("get_weather", {"city": "Rome"}),
    ]
    for text in (COMPACT, NEWLINES):
        assert_prefixes_read_prefixes(calls, text)


def test_malformed_calls_end_the_reading() -> None:
    twice = "f<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2"
    assert calls(twice + "</arg_value></tool_call>") == []
    assert calls("f stray<arg_key>a</arg_key></tool_call>") == []
    good = "f<arg_key>a</arg_key><arg_value>x</arg_value></tool_call>"
    assert calls(good + "then text<tool_call>" + good) == [("f", '{"a": "x"}', None)]

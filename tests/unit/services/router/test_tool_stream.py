"""The incremental call-list scanner against the reference parse (tools.parse) on every
prefix of a set of texts, fed at once and a character at a time; and the streamed chat
choice (chat_text.py), whose assembled deltas agree with the whole text's parse."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from services.router import tools
from services.router.chat_text import ChatText
from services.router.tool_stream import CallListScanner
from tests.unit.services.router.test_tools import TIME, WEATHER

KNOWN = frozenset({WEATHER.name, TIME.name})
AUTO = tools.ToolCalling(tools.ToolMode.AUTO, (WEATHER, TIME))
REQUIRED = tools.ToolCalling(tools.ToolMode.REQUIRED, (WEATHER, TIME))

TEXTS = [
    # what the compact grammar lets a model write, three calls
    '[{"name" : "get_weather", "parameters": {"city" : "x" , "days" : 3} } , {"name": '
    '"get_time", "parameters": { } } , {"name": "get_weather", "parameters": {"city": "y"}}]',
    # pretty-printed, strings holding brackets, quotes and escapes, nested values
    '[\n  {\n    "name": "get_weather",\n    "parameters": {"city": "a}]\\"[{\\\\", "n": '
    '[1, {"k": null}], "u": "\\u00e9"}\n  }\n]',
    # the arguments first, other keys, numbers and literals around them
    '[{"parameters": {"days": -1.5e3}, "extra": true, "name": "get_time"}, {"x": 12, "name": '
    '"get_time", "parameters": {"a": false}}]  and then some prose',
    # malformed from some point on: the calls before it stand
    '[{"name": "get_time", "parameters": {}}, {"name": "nope", "parameters": {}}]',
    '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": 5}]',
    '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {"a": 1, '
    '"a": 2}}]',
    '[{"name": "get_time", "name": "get_time", "parameters": {}}]',
    '[{"name": "get_time", "parameters": {}} {"name": "get_time", "parameters": {}}]',
    '[{"name": "get_time", "parameters": {"a": tru}}]',
    '[{"name": "get_time", "parameters": {}},]',
    '[{"name": "get_time"}]',
    # not a call list
    "[1, 2, 3]",
    '[{"name": "nope", "parameters": {}}]',
    "plain prose [with brackets]",
    "[]",
    '[{"parameters": {}, "name": "zzz"}]',
]


def _reference(text: str, calling: tools.ToolCalling) -> tuple[bool, list[tuple[str, Any]]]:
    parsed = tools.parse(text, calling)
    calls = parsed[1] if parsed is not None else []
    return parsed is not None, [(c.name, json.loads(c.arguments)) for c in calls]


def _scanned(scanner: CallListScanner) -> tuple[bool, list[tuple[str | None, Any]]]:
    done = [(c.name, json.loads(c.arguments)) for c in scanner.calls if c.complete]
    return scanner.opened, done


@pytest.mark.parametrize("text", TEXTS)
def test_scanner_agrees_with_the_reference_on_every_prefix(text: str) -> None:
    stepwise = CallListScanner(KNOWN)
    final = CallListScanner(KNOWN)
    final.feed(text)
    for end in range(len(text) + 1):
        prefix = text[:end]
        whole = CallListScanner(KNOWN)
        whole.feed(prefix)
        if end:
            stepwise.feed(text[end - 1])
        expected = _reference(prefix, AUTO)
        assert _scanned(whole) == expected, prefix
        assert _scanned(stepwise) == expected, prefix
        # Under `required` the text is a call list from its first character.
        assert _scanned(whole)[1] == _reference(prefix, REQUIRED)[1], prefix
        # What a call's arguments are so far is what they will be, cut short.
        for call, later in zip(stepwise.calls, final.calls, strict=False):
            assert later.arguments.startswith(call.arguments), prefix
            assert call.name in (None, later.name), prefix


def test_scanner_ignores_what_follows_the_list() -> None:
    scanner = CallListScanner(KNOWN)
    scanner.feed('[{"name": "get_time", "parameters": {}}] [{"name": "get_time"')
    assert scanner.closed and scanner.done and not scanner.failed
    assert [c.complete for c in scanner.calls] == [True]


def _stream(calling: tools.ToolCalling, text: str, pieces: list[str], reason: str) -> dict:
    """Feed `pieces` through a ChatText; the content, calls and finish reason a client
    assembles from the deltas."""
    out = ChatText(calling)
    content, calls = "", {}
    for piece in [*pieces, None]:
        if piece is None:
            routed, reason = out.finish(reason)
        else:
            routed = out.route(piece)
        content += routed.content or ""
        for d in routed.calls:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name, d  # the first delta
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None, d
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return {"content": content, "calls": [calls[k] for k in sorted(calls)], "reason": reason}


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("reason", ["stop", "length"])
def test_streamed_choice_assembles_to_the_whole_texts_calls(text: str, reason: str) -> None:
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(8, len(text) - 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    got = _stream(AUTO, text, pieces, reason)
    opened, calls = _reference(text, AUTO)
    if not opened:
        assert got == {"content": text, "calls": [], "reason": reason}
        return
    assert got["content"] == ""
    # Every complete call streamed whole (a malformed last one may have begun to stream).
    streamed = [(c["name"], c["arguments"]) for c in got["calls"]][: len(calls)]
    assert [(n, json.loads(a)) for n, a in streamed] == calls
    assert got["reason"] == ("tool_calls" if calls and reason == "stop" else reason)


def test_a_cut_off_call_streams_as_far_as_it_got() -> None:
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci'
    got = _stream(REQUIRED, text, list(text), "length")
    assert got["reason"] == "length" and got["content"] == ""
    assert got["calls"] == [
        {"name": "get_time", "arguments": "{}"},
        {"name": "get_weather", "arguments": '{"ci'},
    ]
    assert tools.parse(text, REQUIRED) is not None
    assert [c.name for c in tools.parse(text, REQUIRED)[1]] == ["get_time"]  # type: ignore[index]

"""DeepSeek-V3.2's DSML tool calls read back (services/router/dsml.py): what the prompt
format writes reads back as the same calls; values typed by their string attribute; reading
stops at the first cut-off or malformed invoke; a stream holds back what may become a marker."""

from __future__ import annotations

import json

from common.text.deepseek_v32 import CALLS_BEGIN, dsml_calls
from services.router.dsml import calls, held_tail

CALLS = [
    ("get_weather", json.dumps({"location": "Hangzhou", "date": "2024-01-16"})),
    ("search", json.dumps({"query": 'a <b> "c"', "topn": 3, "opts": {"x": [1, None]}})),
    ("get_time", "{}"),
]


def test_written_calls_read_back() -> None:
    block = dsml_calls(CALLS)[len(CALLS_BEGIN) :]
    got = calls(block)
    assert [(n, json.loads(a)) for n, a in got] == [(n, json.loads(a)) for n, a in CALLS]
    # Cut anywhere, the complete invokes before the cut are read, and only those.
    complete = 0
    for end in range(len(block) + 1):
        got = calls(block[:end])
        assert got == calls(block)[: len(got)]
        assert len(got) >= complete
        complete = len(got)


def test_values_malformed_invokes_and_what_a_stream_holds() -> None:
    invoke = '<｜DSML｜invoke name="f">\n{}\n</｜DSML｜invoke>'
    param = '<｜DSML｜parameter name="{}" string="{}">{}</｜DSML｜parameter>'
    raw = param.format("n", "false", "not json")
    assert calls("\n" + invoke.format(raw)) == [("f", json.dumps({"n": "not json"}))]
    twice = param.format("a", "true", "1") + "\n" + param.format("a", "true", "2")
    good = invoke.format(param.format("a", "true", "1"))
    assert calls(f"\n{good}\n{invoke.format(twice)}\n{good}") == [("f", '{"a": "1"}')]
    assert calls(f"\n{invoke.format('stray text')}") == []
    assert held_tail("answer \n\n<｜DS", CALLS_BEGIN) == len(" \n\n<｜DS")
    assert held_tail("answer", CALLS_BEGIN) == 0
    assert held_tail("answer <", CALLS_BEGIN) == 2

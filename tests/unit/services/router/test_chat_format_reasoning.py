"""A reasoning model's chat choice streamed (chat_format.py through chat_text.py) assembles to
the non-streamed answer (reasoning.split, tools.parse_reasoning and tools.parse, the
references): the reasoning apart from the content under both names (or the one configured),
tool calls after the reasoning in DeepSeek-V3's markers or a JSON list, DeepSeek-V3.2's DSML
calls inside the reasoning and after it, a cut-off in the reasoning; fed in random pieces
(a special-token marker is one piece, as it is one token)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from common.text.deepseek_v32 import dsml_calls
from services.router import tools
from services.router.chat_format import ChatFormat
from services.router.request import ChoiceEnd, Delta, Done
from tests.unit.services.router.test_tools import TIME, WEATHER

V3_MARKERS = re.compile(r"(<｜tool▁[a-z▁]+｜>)")
V3_CALL = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DSML_TIME = dsml_calls([("get_time", "{}")])
DSML_WEATHER = dsml_calls([("get_weather", '{"city": "Oslo", "days": 2}')])
AUTO = tools.ToolCalling(tools.ToolMode.AUTO, (WEATHER, TIME))
DSML = tools.ToolCalling(tools.ToolMode.AUTO, (WEATHER, TIME), markup=tools.CallMarkup.DSML)

CASES: list[tuple[str, tools.ToolCalling | None, bool, str]] = [
    ("<think>\nhm, 2+2</think>\n\nIt is 4.", None, True, "stop"),
    ("still thinking when the tokens ran out", None, True, "length"),
    ("<think>a</think>b", None, False, "stop"),  # not thinking: all content
    ("check the weather</think>Sure." + V3_CALL, AUTO, True, "stop"),
    ('need the time</think>[{"name": "get_time", "parameters": {}}]', AUTO, True, "stop"),
    (
        f"I need the time.\n\n{DSML_TIME}\nThen Oslo.</think>Here:\n\n{DSML_WEATHER}",
        DSML,
        True,
        "stop",
    ),
    (f"first the time\n\n{DSML_TIME}\nand more thinking cut o", DSML, True, "length"),
    (f"No thinking here.\n\n{DSML_WEATHER}", DSML, False, "stop"),
]


def _pieces(text: str, rng: random.Random) -> list[str]:
    """Random pieces; DeepSeek-V3's markers (special tokens) whole."""
    pieces: list[str] = []
    for part in V3_MARKERS.split(text):
        if V3_MARKERS.fullmatch(part):
            pieces.append(part)
            continue
        cuts = sorted(rng.sample(range(1, len(part)), min(6, len(part) - 1))) if part else []
        pieces += [part[a:b] for a, b in zip([0, *cuts], [*cuts, len(part)], strict=True)]
    return [p for p in pieces if p]


def _streamed(fmt: ChatFormat, pieces: list[str], reason: str) -> dict[str, Any]:
    lines = [line for p in pieces for line in fmt.event(0, Delta(p))]
    lines += fmt.event(0, ChoiceEnd(0, reason))
    got: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "reason": None}
    for line in lines:
        [choice] = json.loads(line.removeprefix("data: "))["choices"]
        delta = choice["delta"]
        assert delta.get("reasoning") == delta.get("reasoning_content"), delta
        got["reasoning"] += delta.get("reasoning") or ""
        got["content"] += delta.get("content") or ""
        got["reason"] = choice["finish_reason"] or got["reason"]
        for call in delta.get("tool_calls") or []:
            name, arguments = got["calls"].get(call["index"], (None, ""))
            got["calls"][call["index"]] = (
                name or call["function"]["name"],
                arguments + call["function"]["arguments"],
            )
    got["calls"] = [got["calls"][k] for k in sorted(got["calls"])]
    return got


def _whole(fmt: ChatFormat, text: str, reason: str) -> dict[str, Any]:
    body = fmt.full([[Delta(text), ChoiceEnd(0, reason), Done((reason,), 3, 9)]])
    message = body.choices[0].message
    assert message.reasoning == message.reasoning_content
    return {
        "reasoning": message.reasoning or "",
        "content": message.content or "",
        "calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
        "reason": body.choices[0].finish_reason,
    }


@pytest.mark.parametrize(("text", "calling", "thinking", "reason"), CASES)
def test_streamed_reasoning_choice_assembles_to_the_whole_answer(
    text: str, calling: tools.ToolCalling | None, thinking: bool, reason: str
) -> None:
    rng = random.Random(len(text))
    whole = _whole(
        ChatFormat("c", "m", False, False, calling=calling, thinking=thinking), text, reason
    )
    chars = [c for p in V3_MARKERS.split(text) for c in ([p] if V3_MARKERS.fullmatch(p) else p)]
    for pieces in (_pieces(text, rng), _pieces(text, rng), V3_MARKERS.split(text), chars):
        fmt = ChatFormat("c", "m", False, False, calling=calling, thinking=thinking)
        streamed = _streamed(fmt, [p for p in pieces if p], reason)
        # The same arguments, whatever their JSON spacing.
        streamed["calls"] = [(n, json.loads(a)) for n, a in streamed["calls"]]
        assert streamed == {**whole, "calls": [(n, json.loads(a)) for n, a in whole["calls"]]}
    shown = whole["reasoning"] + whole["content"]
    assert not thinking or ("<think>" not in shown and "</think>" not in shown)
    assert calling is not DSML or "DSML" not in shown


def test_what_each_case_answers() -> None:
    def answer(k: int) -> dict[str, Any]:
        text, calling, thinking, reason = CASES[k]
        return _whole(
            ChatFormat("c", "m", False, False, calling=calling, thinking=thinking), text, reason
        )

    assert answer(0) == {
        "reasoning": "\nhm, 2+2",
        "content": "\n\nIt is 4.",
        "calls": [],
        "reason": "stop",
    }
    cut = answer(1)
    assert cut["reasoning"] == CASES[1][0] and cut["content"] == "" and cut["reason"] == "length"
    assert answer(2)["reasoning"] == "" and answer(2)["content"] == CASES[2][0]
    assert answer(3)["calls"] == [("get_weather", '{"city": "Rome"}')]
    assert answer(3)["reason"] == "tool_calls" and answer(3)["content"] == "Sure."
    v32 = answer(5)
    assert v32["reasoning"] == "I need the time.\nThen Oslo." and v32["content"] == "Here:"
    assert [n for n, _ in v32["calls"]] == ["get_time", "get_weather"]
    assert answer(6)["calls"] == [("get_time", "{}")] and answer(6)["reason"] == "length"


def test_one_reasoning_field_when_configured() -> None:
    fmt = ChatFormat("c", "m", False, False, thinking=True, reasoning_fields=("reasoning",))
    [line] = fmt.event(0, Delta("hm</think>ok"))
    delta = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
    assert delta["reasoning"] == "hm" and "reasoning_content" not in delta
    assert delta["content"] == "ok"
    message = fmt.full([[Delta("hm</think>ok"), ChoiceEnd(0, "stop"), Done(("stop",), 1, 2, 0, 1)]])
    dumped = message.model_dump(mode="json")
    assert dumped["choices"][0]["message"] == {
        "role": "assistant",
        "content": "ok",
        "reasoning": "hm",
    }
    assert dumped["usage"]["completion_tokens_details"] == {"reasoning_tokens": 1}
    plain = ChatFormat("c", "m", False, False).full(
        [[Delta("x"), ChoiceEnd(0, "stop"), Done(("stop",), 1, 1)]]
    )
    assert "completion_tokens_details" not in plain.model_dump(mode="json")["usage"]
    assert "reasoning" not in plain.model_dump(mode="json")["choices"][0]["message"]

"""DeepSeek-V3.2's prompt format against the test cases published with its encoder
(tests/data/deepseek_v32/, thinking mode), and its own rules: chat mode, tools without a
system message, earlier turns' reasoning dropped, bad tool turns refused; a model directory
whose config says deepseek_v32 and ships no template gets it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from common.runtime.errors import TokenizerError
from common.text.chat_template import ChatMessage
from common.text.deepseek_v32 import DeepseekV32Encoding, dsml_calls
from common.text.tokenizer import Tokenizer
from tests.unit.common.text.tokenizer_files import default_config, write_model_dir

DATA = Path(__file__).resolve().parents[3] / "data" / "deepseek_v32"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
CASES = ["weather", "search_w_date", "search_wo_date"]


def _messages(raw: list[dict[str, Any]]) -> list[ChatMessage]:
    return [
        ChatMessage(
            m["role"],
            m.get("content") or "",
            tuple(
                (c.get("id") or "", c["function"]["name"], c["function"]["arguments"])
                for c in m.get("tool_calls") or ()
            ),
            m.get("tool_call_id"),
            m.get("reasoning_content"),
        )
        for m in raw
    ]


def _render(messages: list[ChatMessage], **kw: Any) -> str:
    return DeepseekV32Encoding().render(messages, bos_token=BOS, eos_token=EOS, **kw)


@pytest.mark.parametrize("case", CASES)
def test_published_cases(case: str) -> None:
    case_input = json.loads((DATA / f"input_{case}.json").read_text(encoding="utf-8"))
    expected = (DATA / f"output_{case}.txt").read_text(encoding="utf-8").rstrip("\n")
    # The tools stand beside the messages or on the first (developer) message.
    tools = case_input.get("tools") or case_input["messages"][0]["tools"]
    got = _render(_messages(case_input["messages"]), tools=tools, variables={"thinking": True})
    assert got == expected


def test_chat_mode_closes_every_thinking_and_shows_no_reasoning() -> None:
    messages = [
        ChatMessage("user", "hi"),
        ChatMessage("assistant", "hello", reasoning_content="greet back"),
        ChatMessage("user", "2+2?"),
    ]
    chat = _render(messages)
    turns = "<｜User｜>hi<｜Assistant｜></think>hello{EOS}<｜User｜>2+2?<｜Assistant｜></think>"
    assert chat == BOS + turns.format(EOS=EOS)
    # Thinking opens after the last user turn only; the earlier turn's reasoning is dropped.
    thinking = _render(messages, variables={"enable_thinking": True})
    assert thinking == chat[: -len("</think>")] + "<think>"
    assert "greet back" not in thinking


def test_tools_without_a_system_message_get_one_of_their_own() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    got = _render([ChatMessage("user", "go")], tools=tools)
    assert got.startswith(f"{BOS}\n\n## Tools\n")
    assert '{"name": "f", "parameters": {"type": "object"}}\n</functions>\n<｜User｜>go' in got


def test_calls_in_dsml_and_results_after_them() -> None:
    calls = [("f", '{"s": "x y", "n": 3, "o": {"a": [1]}}')]
    block = dsml_calls(calls)
    assert block == (
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="s" string="true">x y</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="o" string="false">{"a": [1]}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜function_calls>"
    )
    messages = [
        ChatMessage("user", "go"),
        ChatMessage("assistant", "", (("c1", *calls[0]),)),
        ChatMessage("tool", "42", tool_call_id="c1"),
    ]
    got = _render(messages, variables={"thinking": True})
    assert got.endswith(
        f"\n\n{block}{EOS}\n\n<function_results>\n<result>42</result>\n</function_results>"
        "\n\n<think>"
    )


@pytest.mark.parametrize(
    "messages",
    [
        [ChatMessage("user", "go"), ChatMessage("tool", "orphan", tool_call_id="x")],
        [
            ChatMessage("user", "go"),
            ChatMessage("assistant", "", (("c", "f", "{}"),)),
            ChatMessage("tool", "1", tool_call_id="c"),
            ChatMessage("tool", "2", tool_call_id="c"),
        ],
        [ChatMessage("user", "go"), ChatMessage("assistant", "", (("c", "f", "[1]"),))],
        [ChatMessage("user", "go"), ChatMessage("assistant", "", (("c", "f", "{bad"),))],
    ],
)
def test_bad_tool_turns_are_bad_input(messages: list[ChatMessage]) -> None:
    with pytest.raises(TokenizerError):
        _render(messages)


def test_a_deepseek_v32_directory_without_a_template_uses_it(
    backend: tokenizers.Tokenizer, tmp_path: Path
) -> None:
    config = default_config()
    del config["chat_template"]
    directory = write_model_dir(tmp_path, backend, config)
    assert not Tokenizer.from_dir(directory).has_chat_template
    (directory / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    tok = Tokenizer.from_dir(directory)
    assert tok.has_chat_template and tok.template_renders_tools and tok.template_reads("</think>")
    text = tok.apply_chat_template([ChatMessage("user", "hi")], variables={"thinking": True})
    assert text.endswith("<｜User｜>hi<｜Assistant｜><think>")

"""OpenAI tool calling over any chat model (pure logic: prompt text, grammars, output parsing).

tool_choice:
    none       tools are not shown to the model; its output is plain content
    auto       the model decides; its output is parsed for calls
    required   decoding is constrained to a JSON array of one or more calls,
               [{"name": NAME, "parameters": {...}}, ...], each valid for its function
    named      decoding is constrained to that function's arguments object
Constrained decoding makes the arguments valid JSON for the function's parameters on any
model, the demo's included. Output formats parsed under `auto`:
    DeepSeek-V3's own markers (checkpoints whose vocabulary has them):
        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
        ```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
      (the later variant without "function" and the code fence is read too)
    the JSON array above, which a template that does not render tools itself is told to use
    through a system prompt (`system_prompt`).
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from common.sampling.grammar import GrammarSpec

DEEPSEEK_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>)?(?P<name>[^\n<]+?)"
    r"(?:\n```json\n|<｜tool▁sep｜>)(?P<args>.*?)(?:\n```)?<｜tool▁call▁end｜>",
    re.DOTALL,
)
_JSON_START = "["


class ToolMode(enum.Enum):
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: str  # the JSON schema, as JSON text

    @property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.parameters)


@dataclass(frozen=True)
class ToolCalling:
    """A request's tool settings, from its tools and tool_choice (never `none`)."""

    mode: ToolMode
    tools: tuple[Tool, ...]
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # more than one call allowed (parallel_tool_calls)

    @property
    def function(self) -> Tool:
        return next(t for t in self.tools if t.name == self.named)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def grammar(calling: ToolCalling) -> GrammarSpec | None:
    """What decoding is constrained to (required / named), or None (auto)."""
    if calling.mode is ToolMode.NAMED:
        return GrammarSpec.json_schema(calling.function.schema, compact=True)
    if calling.mode is ToolMode.AUTO:
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "parameters": t.schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in calling.tools
    ]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not calling.parallel:
        array["maxItems"] = 1
    return GrammarSpec.json_schema(array, compact=True)


def system_prompt(tools: tuple[Tool, ...]) -> str:
    """Tool definitions and the JSON call format, for templates that do not render tools."""
    listed = [{"name": t.name, "description": t.description, "parameters": t.schema} for t in tools]
    return (
        "You can call these tools:\n"
        f"{json.dumps(listed, ensure_ascii=False)}\n"
        'To call tools, answer with only a JSON array of calls: [{"name": "<tool name>", '
        '"parameters": {<arguments>}}]. Otherwise answer normally.'
    )


def calls_json(calls: list[tuple[str, str]]) -> str:
    """An assistant turn's (name, arguments) calls in the JSON format (for the prompt)."""
    return json.dumps(
        [{"name": n, "parameters": json.loads(a or "{}")} for n, a in calls], ensure_ascii=False
    )


def may_be_call(text: str) -> bool:
    """Whether streamed text so far could still be (the start of) a call under `auto`."""
    head = text.lstrip()
    return any(
        head.startswith(m) or m.startswith(head) for m in (DEEPSEEK_CALLS_BEGIN, _JSON_START)
    )


def parse(text: str, calling: ToolCalling) -> tuple[str, list[ToolCall]] | None:
    """The content before any calls and the calls in the model's output; None when the
    output holds no (well-formed) call, so it is plain content."""
    if calling.mode is ToolMode.NAMED:
        try:
            args = json.loads(text)
        except json.JSONDecodeError:
            return None
        return "", [ToolCall(new_call_id(), calling.function.name, json.dumps(args))]
    if DEEPSEEK_CALLS_BEGIN in text:
        content, _, rest = text.partition(DEEPSEEK_CALLS_BEGIN)
        calls = []
        for m in _DEEPSEEK_CALL.finditer(rest):
            try:
                args = json.loads(m.group("args"))
            except json.JSONDecodeError:
                return None
            calls.append(ToolCall(new_call_id(), m.group("name").strip(), json.dumps(args)))
        return (content, calls) if calls else None
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    known = {t.name for t in calling.tools}
    if not (
        isinstance(items, list)
        and items
        and all(
            isinstance(i, dict) and i.get("name") in known and isinstance(i.get("parameters"), dict)
            for i in items
        )
    ):
        return None
    return "", [ToolCall(new_call_id(), i["name"], json.dumps(i["parameters"])) for i in items]

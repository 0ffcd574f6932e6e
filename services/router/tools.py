"""OpenAI tool calling over any chat model (pure logic: prompt text, grammars, output parsing).

tool_choice:
    none       tools are not shown to the model; its output is plain content
    auto       the model decides; its output is parsed for calls
    required   decoding is constrained to a JSON array of one or more calls,
               [{"name": NAME, "parameters": {...}}, ...], each valid for its function
    named      decoding is constrained to that function's arguments object
Constrained decoding makes the arguments valid JSON for the function's parameters on any
model, the demo's included. Output formats parsed under `auto` (`CallMarkup`: the model's):
    DeepSeek-V3's own markers (checkpoints whose vocabulary has them):
        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
        ```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
      (the later variant without "function" and the code fence is read too)
    DeepSeek-V3.2's DSML (dsml.py), which may also stand inside its thinking
      (`parse_reasoning`)
    Kimi K2's (kimi_calls.py), GLM-4.5 / 4.7's (glm_calls.py), Mistral's (mistral_calls.py)
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
from common.text.deepseek_v32 import CALLS_BEGIN, CALLS_END, INVOKE_END
from services.router import dsml, glm_calls, kimi_calls, mistral_calls

DEEPSEEK_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_CALL_END = "<｜tool▁call▁end｜>"
_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>)?(?P<name>[^\n<]+?)"
    r"(?:\n```json\n|<｜tool▁sep｜>)(?P<args>.*?)(?:\n```)?<｜tool▁call▁end｜>",
    re.DOTALL,
)


class CallMarkup(enum.Enum):
    """The markup a model writes its calls in under `auto` (besides the JSON call list),
    chosen by its chat template (prepare.call_markup)."""

    DEEPSEEK_V3 = "deepseek_v3"  # special-token markers: each arrives whole, in one delta
    DSML = "dsml"  # DeepSeek-V3.2's: plain text, a marker can be split between deltas
    KIMI_K2 = "kimi_k2"  # special-token markers
    GLM45 = "glm45"  # its markers may be plain text, split between deltas
    MISTRAL = "mistral"  # special-token markers; no end marker (a call ends with its JSON)

    @property
    def begin(self) -> str:
        """What opens the calls (the content before it is the answer's)."""
        return _BEGIN[self]

    @property
    def call_end(self) -> str:
        """What ends one call (a stream sends each call once it has come)."""
        return _CALL_END[self]

    @property
    def plain_text(self) -> bool:
        """Whether its markers may come in pieces (a stream holds back a text's end that may
        still become the begin marker, and the blanks before it belong to the markup)."""
        return self in (CallMarkup.DSML, CallMarkup.GLM45)

    def calls(self, text: str) -> list[tuple[str, str, str | None]]:
        """(name, arguments JSON, the id the model gave it or None) of the complete calls in
        `text`, what follows `begin`."""
        if self is CallMarkup.DSML:
            return [(n, a, None) for n, a in dsml.calls(text)]
        if self is CallMarkup.KIMI_K2:
            return kimi_calls.calls(text)
        if self is CallMarkup.GLM45:
            return glm_calls.calls(text)
        if self is CallMarkup.MISTRAL:
            return mistral_calls.calls(text)
        out: list[tuple[str, str, str | None]] = []
        for m in _DEEPSEEK_CALL.finditer(text):
            try:
                args = json.loads(m.group("args"), object_pairs_hook=unique_keys)
            except ValueError:
                break
            out.append((m.group("name").strip(), json.dumps(args), None))
        return out


_BEGIN = {
    CallMarkup.DEEPSEEK_V3: DEEPSEEK_CALLS_BEGIN,
    CallMarkup.DSML: CALLS_BEGIN,
    CallMarkup.KIMI_K2: kimi_calls.SECTION_BEGIN,
    CallMarkup.GLM45: glm_calls.CALL_BEGIN,
    CallMarkup.MISTRAL: mistral_calls.CALLS_BEGIN,
}
_CALL_END = {
    CallMarkup.DEEPSEEK_V3: DEEPSEEK_CALL_END,
    CallMarkup.DSML: INVOKE_END,
    CallMarkup.KIMI_K2: kimi_calls.CALL_END,
    CallMarkup.GLM45: glm_calls.CALL_END,
    CallMarkup.MISTRAL: mistral_calls.ARGS_END,
}


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
    markup: CallMarkup = CallMarkup.DEEPSEEK_V3  # the model's own, read under auto

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
        return GrammarSpec.json_schema(calling.function.schema)
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
    return GrammarSpec.json_schema(array)


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


def parse(text: str, calling: ToolCalling) -> tuple[str, list[ToolCall]] | None:
    """The content before the calls and every complete, well-formed call in the model's
    output, in order; None when the output opens no call, so it is plain content.

    Calls are read up to the first one that is cut off or malformed and nothing after it
    counts, so a call found in some text is found in every longer text too: the streamed
    calls (tool_stream.py) are never taken back. A call list opens at the model's markup's
    begin marker (the whitespace before a DSML block is the markup's), or (JSON) at an
    array whose first object is complete and valid or starts with the name of a known
    tool."""
    if calling.mode is ToolMode.NAMED:
        try:
            args = json.loads(text, object_pairs_hook=unique_keys)
        except ValueError:
            return "", []
        call = ToolCall(new_call_id(), calling.function.name, json.dumps(args))
        return "", [call] if isinstance(args, dict) else []
    markup = calling.markup
    if markup.begin in text:
        content, _, rest = text.partition(markup.begin)
        if markup.plain_text:
            content = content.rstrip(dsml.WHITESPACE)
        return content, [ToolCall(i or new_call_id(), n, a) for n, a, i in markup.calls(rest)]
    known = frozenset(t.name for t in calling.tools)
    calls = _json_calls(text, known)
    if calls or calling.mode is ToolMode.REQUIRED or _named_first(text, known):
        return "", calls
    return None


def parse_reasoning(text: str, calling: ToolCalling) -> tuple[str, list[ToolCall]]:
    """DSML calls inside a whole reasoning text (DeepSeek-V3.2 may call tools while it
    thinks): the reasoning without its call blocks (and the whitespace before each), and
    every complete call of each block, in order."""
    if calling.mode is not ToolMode.AUTO or calling.markup is not CallMarkup.DSML:
        return text, []
    kept, calls = [], []
    while CALLS_BEGIN in text:
        before, _, rest = text.partition(CALLS_BEGIN)
        block, _, text = rest.partition(CALLS_END)
        kept.append(before.rstrip(dsml.WHITESPACE))
        calls += [ToolCall(new_call_id(), n, a) for n, a in dsml.calls(block)]
    return "".join(kept) + text, calls


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict; a key given twice makes it malformed (json's object hook)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key")
    return out


JSON_WHITESPACE = " \t\n\r"
_JSON_STRING = r'"(?:[^"\\]|\\.)*"'
_FIRST_KEY = re.compile(
    rf"[{JSON_WHITESPACE}]*\[[{JSON_WHITESPACE}]*\{{[{JSON_WHITESPACE}]*(?P<key>{_JSON_STRING})"
    rf"[{JSON_WHITESPACE}]*:[{JSON_WHITESPACE}]*(?P<value>{_JSON_STRING})"
)


def _json_calls(text: str, known: frozenset[str]) -> list[ToolCall]:
    """The complete, valid calls at the start of a JSON array of calls."""
    decoder = json.JSONDecoder(object_pairs_hook=unique_keys)
    pos = _skip_whitespace(text, 0)
    if not text.startswith("[", pos):
        return []
    calls: list[ToolCall] = []
    while True:
        pos = _skip_whitespace(text, pos + 1)  # past "[" or ","
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return calls
        if not _is_call(item, known):
            return calls
        calls.append(ToolCall(new_call_id(), item["name"], json.dumps(item["parameters"])))
        pos = _skip_whitespace(text, pos)
        if not text.startswith(",", pos):
            return calls


def _is_call(item: object, known: frozenset[str]) -> bool:
    if not isinstance(item, dict):
        return False
    name = item.get("name")
    return isinstance(name, str) and name in known and isinstance(item.get("parameters"), dict)


def _named_first(text: str, known: frozenset[str]) -> bool:
    """Whether the array's first object opens with `"name": <a known tool>`."""
    m = _FIRST_KEY.match(text)
    if m is None:
        return False
    try:
        key, value = json.loads(m.group("key")), json.loads(m.group("value"))
    except ValueError:
        return False
    return key == "name" and value in known


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in JSON_WHITESPACE:
        pos += 1
    return pos

"""GLM-4.5 / 4.7's tool calls read back from its output (pure logic): the markup its chat
template writes for earlier turns and the model writes.

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>
    <tool_call>...</tool_call>

(GLM-4.5 puts a newline after the name and after each value; both read.) The template writes
a string value as itself and any other value as JSON, so a value that parses as JSON is read as
that JSON and any other as the string (a string argument that looks like JSON, "42", comes
back as 42: the markup cannot tell them apart). Calls are read up to the first one that is
cut off or malformed (a key given twice, text between the pairs), as tools.parse reads every
call format. The markers may be plain text: a stream holds back a text's end that may still
become one (dsml.held_tail).
"""

from __future__ import annotations

import json
import re
from typing import Any

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
_NAME = re.compile(r"\s*(?P<name>[^<\s][^<]*?)\s*(?=<arg_key>|</tool_call>)")
_PAIR = re.compile(
    r"\s*<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.DOTALL
)
_END = re.compile(r"\s*</tool_call>")
_NEXT = re.compile(r"\s*<tool_call>")


def calls(text: str) -> list[tuple[str, str, str | None]]:
    """(name, arguments JSON, None) of every complete, well-formed call at the start of
    `text`, the text after the first call's begin marker."""
    out: list[tuple[str, str, str | None]] = []
    pos = 0
    while (name := _NAME.match(text, pos)) is not None:
        args: dict[str, Any] = {}
        pos = name.end()
        while (pair := _PAIR.match(text, pos)) is not None:
            key = pair.group("key").strip()
            if key in args:
                return out
            args[key] = _value(pair.group("value"))
            pos = pair.end()
        end = _END.match(text, pos)
        if end is None:
            return out
        out.append((name.group("name"), json.dumps(args), None))
        nxt = _NEXT.match(text, end.end())
        if nxt is None:
            return out
        pos = nxt.end()
    return out


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw

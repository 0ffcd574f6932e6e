"""Kimi K2's tool calls read back from its output (pure logic): the markup its chat template
writes for earlier turns and the model writes, every marker one special token.

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGS<|tool_call_end|>
    ...
    <|tool_calls_section_end|>

ARGS is a JSON object. The call's id is the one the model wrote (`functions.NAME:INDEX`), which
the template writes back for the turn's results, so a conversation keeps Kimi's own ids.
Calls are read up to the first one that is cut off or malformed, as tools.parse reads every
call format.
"""

from __future__ import annotations

import json
import re

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_END = "<|tool_call_end|>"
_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>\s*(?P<id>[^<]*?)\s*<\|tool_call_argument_begin\|>"
    r"(?P<args>.*?)<\|tool_call_end\|>",
    re.DOTALL,
)
_ID = re.compile(r"(?:functions\.)?(?P<name>.+?)(?::\d+)?")


def calls(text: str) -> list[tuple[str, str, str | None]]:
    """(name, arguments JSON, the model's call id) of every complete, well-formed call at the
    start of `text`, the text after the section's begin marker."""
    out: list[tuple[str, str, str | None]] = []
    pos = 0
    while (m := _CALL.match(text, pos)) is not None:
        name = _ID.fullmatch(m.group("id"))
        try:
            args = json.loads(m.group("args"))
        except ValueError:
            break
        if name is None or not isinstance(args, dict):
            break
        out.append((name.group("name"), json.dumps(args), m.group("id")))
        pos = m.end()
    return out

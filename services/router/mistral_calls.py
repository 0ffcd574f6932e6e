"""Mistral's tool calls read back from its output (pure logic): the markup of its v11+
tokenizers (Mistral Small 3.2, Small 4), every marker one special token.

    [TOOL_CALLS]NAME[ARGS]{...}[TOOL_CALLS]NAME[ARGS]{...}

(a `[CALL_ID]ID` between the name and [ARGS] is read too, and the id kept). The markup has no
end marker: a call is complete when its arguments object is. The older array form
([TOOL_CALLS][{"name": ..., "arguments": ...}]) is not read. Calls are read up to the first
one that is cut off or malformed, as tools.parse reads every call format.
"""

from __future__ import annotations

import json
import re

CALLS_BEGIN = "[TOOL_CALLS]"
# What ends a call's arguments: a stream re-reads its calls when one comes.
ARGS_END = "}"
_HEAD = re.compile(
    r"\s*(?P<name>[^\[\]\s{][^\[\]]*?)\s*(?:\[CALL_ID\]\s*(?P<id>[^\[\]]*?)\s*)?\[ARGS\]\s*"
)
_NEXT = re.compile(r"\s*\[TOOL_CALLS\]")


def calls(text: str) -> list[tuple[str, str, str | None]]:
    """(name, arguments JSON, the model's call id or None) of every complete, well-formed
    call at the start of `text`, the text after the first call's begin marker."""
    decoder = json.JSONDecoder()
    out: list[tuple[str, str, str | None]] = []
    pos = 0
    while (head := _HEAD.match(text, pos)) is not None:
        try:
            args, pos = decoder.raw_decode(text, head.end())
        except ValueError:
            return out
        if not isinstance(args, dict):
            return out
        out.append((head.group("name"), json.dumps(args), head.group("id") or None))
        nxt = _NEXT.match(text, pos)
        if nxt is None:
            return out
        pos = nxt.end()
    return out

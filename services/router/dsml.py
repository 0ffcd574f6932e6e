"""DeepSeek-V3.2's tool calls read back from its output (pure logic): the DSML markup that
common/text/deepseek_v32.py writes for earlier turns.

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
    ...
    </｜DSML｜invoke>
    ...
    </｜DSML｜function_calls>

A string="true" value is the string itself; a string="false" value is JSON (a value that is
not JSON is kept as the string the model wrote, rather than losing the call). Invokes are
read up to the first one that is cut off or malformed (a parameter given twice, text that
is not a parameter), and nothing after it counts, as tools.parse reads every call format.
The markup is plain text (several tokens per marker), so a stream holds back a text's end
that may still become a marker (`held_tail`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from common.text.deepseek_v32 import DSML, INVOKE_END
from services.router.stops import partial_suffix

WHITESPACE = " \t\r\n"
_INVOKE = re.compile(rf'[{WHITESPACE}]*<{DSML}invoke name="(?P<name>[^"\n]*)">', re.DOTALL)
_PARAMETER = re.compile(
    rf'[{WHITESPACE}]*<{DSML}parameter name="(?P<key>[^"\n]*)" string="(?P<string>true|false)">'
    rf"(?P<value>.*?)</{DSML}parameter>",
    re.DOTALL,
)
_INVOKE_END = re.compile(rf"[{WHITESPACE}]*{re.escape(INVOKE_END)}")


def calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments JSON) of every complete, well-formed invoke at the start of `text`,
    the text after a function_calls begin marker."""
    out: list[tuple[str, str]] = []
    pos = 0
    while (invoke := _INVOKE.match(text, pos)) is not None:
        args: dict[str, Any] = {}
        pos = invoke.end()
        while (param := _PARAMETER.match(text, pos)) is not None:
            key = param.group("key")
            if key in args:
                return out
            args[key] = _value(param.group("value"), param.group("string") == "true")
            pos = param.end()
        end = _INVOKE_END.match(text, pos)
        if end is None:
            return out
        out.append((invoke.group("name"), json.dumps(args)))
        pos = end.end()
    return out


def _value(raw: str, string: bool) -> Any:
    if string:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def held_tail(text: str, marker: str) -> int:
    """How many characters at the end of `text` a stream holds back: whitespace and a
    proper prefix of `marker` that may still become it (the whitespace before a marker is
    not sent: it belongs to the markup)."""
    keep = partial_suffix(text, (marker,))
    rest = text[: len(text) - keep]
    return keep + len(rest) - len(rest.rstrip(WHITESPACE))

"""SSE events survive clients that split lines as Python's str.splitlines does (httpx's
iter_lines, and so the OpenAI-style clients built on it)."""

from __future__ import annotations

import json

from services.router.body_parts import sse
from services.router.response_schemas import ChatDelta


def test_a_token_holding_a_unicode_line_break_stays_one_event() -> None:
    text = "a\x85b\u2028c\u2029d é"
    event = sse(ChatDelta(content=text))
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:])["content"] == text
    assert "é" in event  # only the line breaks are escaped; other text stays as it is

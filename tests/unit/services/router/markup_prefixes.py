"""What every call markup's reader must do on a text cut anywhere: read a prefix of the whole
text's calls, never fewer as the text grows (a stream never takes a call back)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def assert_prefixes_read_prefixes(calls: Callable[[str], list[Any]], text: str) -> None:
    complete = 0
    for end in range(len(text) + 1):
        got = calls(text[:end])
        assert got == calls(text)[: len(got)] and len(got) >= complete, text[:end]
        complete = len(got)

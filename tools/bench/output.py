"""Where a bench's human-readable lines go: stdout, or stderr under `--json`, whose stdout is
then the JSON result alone (`json.loads` of the whole stream parses it)."""

from __future__ import annotations

import sys
from typing import TextIO


def table_stream(as_json: bool) -> TextIO:
    """The stream for a bench's table and progress lines."""
    return sys.stderr if as_json else sys.stdout

"""Where a bench's output goes: its human-readable lines to stdout, or to stderr under
`--json`, whose stdout is then the JSON result alone (`json.loads` of the whole stream parses
it); the result also to the file `--out` names."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO


def table_stream(as_json: bool) -> TextIO:
    """The stream for a bench's table and progress lines."""
    return sys.stderr if as_json else sys.stdout


def write_result(result: dict[str, Any], args: argparse.Namespace) -> int:
    """The result to --out and, with --json, as the last stdout line."""
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    return 0

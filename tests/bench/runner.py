"""Runs `tpla bench …` as a subprocess (as a user would) and returns its JSON contract line."""

from __future__ import annotations

from typing import Any

from tests.cli import tpla_json


def run_bench(*args: str, timeout: float = 300) -> Any:
    return tpla_json("bench", *args, timeout=timeout)

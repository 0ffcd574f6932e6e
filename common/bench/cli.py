"""Registers every `tpla bench` subcommand. Each bench module exposes
`add_parser(bsub)`, which adds its subcommand and sets `func`; modules are imported only
when the CLI is built, so a bench's heavy imports never slow other commands' start-up
more than this list does."""

from __future__ import annotations

import argparse
import importlib

BENCH_MODULES: tuple[str, ...] = (
    "common.bench.kv_transfer",
    "common.bench.serve",
    "common.bench.roofline",
    "common.bench.decode_attn",
    "common.bench.prefill",
    "common.bench.capacity",
    "common.bench.loading",
)


def add_bench_commands(bsub: argparse._SubParsersAction) -> None:
    for name in BENCH_MODULES:
        importlib.import_module(name).add_parser(bsub)

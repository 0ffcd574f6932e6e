"""Registers every `tpla bench` subcommand. Each bench module exposes
`add_parser(bsub)`, which adds its subcommand and sets `func`; modules are imported only
when the CLI is built, so a bench's heavy imports never slow other commands' start-up
more than this list does."""

from __future__ import annotations

import argparse
import importlib

BENCH_MODULES: tuple[str, ...] = (
    "tools.bench.decode_step",
    "tools.bench.leader_step",
    "tools.bench.gpu_check",
    "tools.bench.kv_transfer",
    "tools.bench.serve",
    "tools.bench.roofline",
    "tools.bench.decode_attn",
    "tools.bench.prefill",
    "tools.bench.capacity",
    "tools.bench.loading",
    "tools.bench.calibration",
    "tools.bench.moe",
    "tools.bench.answers",
    "tools.bench.autoscale",
    "tools.bench.ttft",
    "tools.bench.mtp_acceptance",
)


def add_bench_commands(bsub: argparse._SubParsersAction) -> None:
    for name in BENCH_MODULES:
        importlib.import_module(name).add_parser(bsub)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `tpla bench` and its subcommands."""
    bench = sub.add_parser("bench", help="benchmarks (results as ratios from one run)")
    add_bench_commands(bench.add_subparsers(dest="bench", required=True))

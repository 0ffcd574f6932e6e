"""`tpla` command line: one sub-command per entry point (DESIGN §3)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tools.bench.cli import add_bench_parser
from tools.cli.autoscaler import add_autoscaler_parser
from tools.cli.generate import add_generate_parser
from tools.cli.plan import add_plan_parser
from tools.cli.services import add_service_parsers
from tools.cli.tpla import add_convert_parser, add_eval_parser
from tools.cli.train_demo import add_train_demo_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpla", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_convert_parser(sub)
    add_eval_parser(sub)
    add_plan_parser(sub)
    add_autoscaler_parser(sub)
    add_train_demo_parser(sub)
    add_bench_parser(sub)
    add_service_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        # Config, checkpoint, tokenizer and sampling errors are all ValueErrors with a message
        # meant for the user; print it instead of a traceback.
        print(f"tpla {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

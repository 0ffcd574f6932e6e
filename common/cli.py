"""`tpla` command line: one sub-command per entry point (DESIGN §3)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from common.settings import Settings, load_settings, placed

if TYPE_CHECKING:  # heavy imports stay lazy: `tpla --help` must not import torch
    from common.generate import Generation
    from common.tokenizer import Tokenizer
from common.tpla.cli import (
    add_convert_parser,
    add_eval_parser,
    add_generate_mode_arguments,
    add_plan_parser,
)


def _configure_torch(settings: Settings) -> None:
    import torch

    torch.set_num_threads(settings.torch_threads)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise SystemExit(f"--prompt-ids must be comma-separated integers: {exc}") from exc


def cmd_generate(args: argparse.Namespace) -> int:
    from common.generate import generate
    from common.model.args import ModelConfig
    from common.model.attn_backend import select_backend
    from common.model.loader import load_model
    from common.sampling import SamplingParams
    from common.tokenizer import Tokenizer

    settings = placed(
        load_settings(
            model=args.model, dtype=args.dtype, device=args.device, torch_threads=args.threads
        )
    )
    _configure_torch(settings)
    config = ModelConfig.from_dir(settings.model)
    tokenizer = None
    if args.prompt is not None:
        tokenizer = Tokenizer.from_dir(settings.model)
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        prompt_ids = _parse_ids(args.prompt_ids)
    eos = set(config.eos_token_ids)
    if tokenizer is not None:
        eos |= tokenizer.eos_token_ids
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    if args.tp is not None:  # the engine's ranks load their own shares of the weights
        from services.decode.local import generate_distributed

        result = generate_distributed(
            settings.model, prompt_ids, params, sorted(eos), args, settings
        )
        return _print_generation(args, settings, tokenizer, result)
    model = load_model(settings.model, dtype=settings.dtype, device=settings.device)
    model.prefill_backend = select_backend(settings.attention_backend, settings.device)
    if args.mode is not None:
        from common.tpla.cli import generate_with_mode

        result = generate_with_mode(model, settings.model, prompt_ids, params, sorted(eos), args)
    else:
        result = generate(model, prompt_ids, params, eos_ids=sorted(eos), path=args.path)
    return _print_generation(args, settings, tokenizer, result)


def _print_generation(
    args: argparse.Namespace, settings: Settings, tokenizer: Tokenizer | None, result: Generation
) -> int:
    from common.tokenizer import Tokenizer

    text = None
    if tokenizer is None:
        try:
            tokenizer = Tokenizer.from_dir(settings.model)
        except ValueError:
            tokenizer = None  # a weights-only directory still generates ids
    if tokenizer is not None:
        text = tokenizer.decode(result.token_ids)
    if args.json:
        print(
            json.dumps(
                {"token_ids": result.token_ids, "text": text, "finish_reason": result.finish_reason}
            )
        )
    else:
        print(
            args.prompt + text
            if args.prompt is not None and text is not None
            else (text if text is not None else " ".join(map(str, result.token_ids)))
        )
    return 0


def cmd_train_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from common.demo.train import DemoArch, TrainConfig, train

    settings = load_settings(torch_threads=args.threads)
    _configure_torch(settings)
    arch = DemoArch() if args.arch == "demo" else DemoArch.tiny()
    cfg = TrainConfig(
        out=Path(args.out),
        work_dir=Path(args.work_dir or Path("runs") / "train-demo"),
        corpus_root=Path(args.corpus) if args.corpus else None,
        minutes=args.minutes,
        max_steps=args.max_steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        eval_every=args.eval_every,
        card_eval_chars=args.card_eval_chars,
        prior_cpu_seconds=args.prior_cpu_minutes * 60,
        arch=arch,
    )
    report = train(cfg)
    print(json.dumps({"steps": report["steps"], "metrics": report["metrics"]}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpla", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from a model in one process (no services)")
    gen.add_argument("--model", help="model directory (default: TPLA_MODEL or models/demo)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded with the model's tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--path",
        choices=["absorbed", "expanded"],
        default="absorbed",
        help="absorbed: latent-cache decode; expanded: full recompute reference",
    )
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--device")
    gen.add_argument("--threads", type=int, help="torch threads (default TPLA_TORCH_THREADS or 1)")
    gen.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    gen.add_argument(
        "--parallel",
        choices=["tpla", "mla-tp", "sp"],
        default="tpla",
        help="with --tp: split the cache by latent columns (tpla), not at all (mla-tp), "
        "or by token chunks (sp, exact)",
    )
    gen.add_argument("--chunk-size", type=int, default=256, help="SP tokens per chunk")
    gen.add_argument(
        "--tp",
        type=int,
        help="run the distributed decode engine with this many "
        "ranks (TPLA with --latent-groups; --latent-groups 1 is MLA-TP)",
    )
    add_generate_mode_arguments(gen)
    gen.set_defaults(func=cmd_generate)
    add_convert_parser(sub)
    add_eval_parser(sub)
    add_plan_parser(sub)

    td = sub.add_parser("train-demo", help="train the small demo model on CPU (offline)")
    td.add_argument("--out", default="models/demo", help="HF-format output directory")
    td.add_argument("--corpus", help="folder of .py files (default: this Python's stdlib)")
    td.add_argument("--work-dir", help="tokenizer, token cache and resumable checkpoint")
    td.add_argument("--minutes", type=float, default=40.0, help="wall-clock training budget")
    td.add_argument("--max-steps", type=int)
    td.add_argument("--seq-len", type=int, default=1024)
    td.add_argument("--batch-size", type=int, default=4)
    td.add_argument("--eval-every", type=int, default=50)
    td.add_argument("--card-eval-chars", type=int, default=200_000)
    td.add_argument(
        "--arch",
        choices=["demo", "tiny"],
        default="demo",
        help="tiny: a minimal model for smoke tests of the trainer",
    )
    td.add_argument("--threads", type=int)
    td.add_argument(
        "--prior-cpu-minutes",
        type=float,
        default=0.0,
        help="CPU time of a resumed run's earlier part, if its checkpoint lacks it",
    )
    td.set_defaults(func=cmd_train_demo)
    from services.cli import add_service_parsers

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

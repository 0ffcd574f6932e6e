"""`tpla train-demo`: train the small demo model on CPU (tools/demo/train.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.runtime.settings import load_settings


def cmd_train_demo(args: argparse.Namespace) -> int:
    import torch

    from tools.demo.train import DemoArch, TrainConfig, train

    settings = load_settings(torch_threads=args.threads)
    torch.set_num_threads(settings.torch_threads)
    if args.mtp:
        return _train_mtp(args)
    if args.dsa:
        return _train_dsa(args)
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


def _train_mtp(args: argparse.Namespace) -> int:
    from tools.demo.train_mtp import MtpTrainConfig, train_mtp

    cfg = MtpTrainConfig(
        model_dir=Path(args.out),
        corpus_root=Path(args.corpus) if args.corpus else None,
        minutes=args.minutes,
        max_steps=args.max_steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        eval_chars=args.card_eval_chars,
    )
    report = train_mtp(cfg)
    print(json.dumps({"steps": report["steps"], "acceptance": report["acceptance"]}))
    return 0


def _train_dsa(args: argparse.Namespace) -> int:
    from tools.demo.train_dsa import DsaDemoConfig, run

    cfg = DsaDemoConfig(
        source=Path(args.source),
        out=Path(args.out if args.out != "models/demo" else "models/demo-dsa"),
        work_dir=Path(args.work_dir or Path("runs") / "train-dsa-demo"),
        finetune_steps=args.finetune_steps,
        indexer_steps=args.indexer_steps,
        seq_len=min(args.seq_len, 512),
        batch_size=args.batch_size,
        eval_prompts=args.eval_prompts,
    )
    report = run(cfg)
    print(json.dumps({"agreement": report["agreement"]}))
    return 0


def add_train_demo_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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
    td.add_argument(
        "--mtp",
        action="store_true",
        help="train one DeepSeek-V3 MTP layer on the frozen model in --out and add it there",
    )
    td.add_argument(
        "--dsa",
        action="store_true",
        help="make the DSA demo (DeepSeek-V3.2 architecture) from the demo model in --source "
        "into --out (default models/demo-dsa): tools/demo/train_dsa.py",
    )
    td.add_argument("--source", default="models/demo", help="with --dsa: the demo model")
    td.add_argument("--finetune-steps", type=int, default=150, help="with --dsa")
    td.add_argument("--indexer-steps", type=int, default=300, help="with --dsa")
    td.add_argument("--eval-prompts", type=int, default=8, help="with --dsa: per length")
    td.add_argument("--threads", type=int)
    td.add_argument(
        "--prior-cpu-minutes",
        type=float,
        default=0.0,
        help="CPU time of a resumed run's earlier part, if its checkpoint lacks it",
    )
    td.set_defaults(func=cmd_train_demo)

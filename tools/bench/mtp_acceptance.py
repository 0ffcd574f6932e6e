"""`tpla bench mtp-acceptance`: how often a model's MTP layer drafts what greedy speculation
accepts, on held-out text (tools/demo/mtp_acceptance.py says exactly what is counted)."""

from __future__ import annotations

import argparse
import json


def _run(args: argparse.Namespace) -> int:
    import torch

    from common.loading.loader import load_model
    from common.loading.mtp_weights import load_mtp_layers
    from common.text.tokenizer import Tokenizer
    from common.tpla import corpus
    from tools.demo.mtp_acceptance import measure_acceptance, text_agreement

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    layers = load_mtp_layers(args.model, main=model)
    if not layers:
        raise ValueError(f"{args.model} has no MTP layer (num_nextn_predict_layers is 0 or unset)")
    text = corpus.eval_text(max_chars=args.eval_chars)
    ids = torch.tensor(Tokenizer.from_dir(args.model).encode(text, add_bos=False))
    acc = measure_acceptance(
        model, layers[0], ids, windows=args.windows, prompt=args.prompt, new=args.new
    )
    on_text = text_agreement(model, layers[0], ids, windows=args.windows)
    result = {
        "model": args.model,
        "acceptance": round(acc.rate, 4),
        "agreement_on_text": round(on_text.rate, 4),
        "accepted": acc.accepted,
        "drafted": acc.drafted,
        "windows": acc.windows,
        "prompt_tokens": args.prompt,
        "generated_tokens": args.new,
        "eval_chars": args.eval_chars,
    }
    print(
        f"MTP draft accepted at {acc.accepted}/{acc.drafted} positions ({acc.rate:.1%}) over "
        f"{acc.windows} greedy continuations of held-out text; {on_text.rate:.1%} agreement "
        f"with the main model's greedy token on the text itself"
    )
    if args.json:
        print(json.dumps(result))
    return 0


def add_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser(
        "mtp-acceptance",
        help="greedy-speculation acceptance of a model's MTP layer on held-out text",
    )
    p.add_argument("--model", default="models/demo", help="model directory with an MTP layer")
    p.add_argument("--windows", type=int, default=16, help="held-out prompts")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per window")
    p.add_argument("--new", type=int, default=64, help="greedy tokens generated per window")
    p.add_argument("--eval-chars", type=int, default=200_000, help="held-out text budget")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="last stdout line is the JSON result")
    p.set_defaults(func=_run)

"""`tpla convert` and `tpla eval`.

Heavy imports (torch, the model) happen inside the command functions so `tpla --help` stays
fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.runtime.settings import load_settings, placed

METHODS = ("identity", "hadamard", "pca")
DTYPES = ("float32", "bfloat16", "float16")


def _threads(count: int | None) -> None:
    import torch

    torch.set_num_threads(load_settings(torch_threads=count).torch_threads)


def cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from common.loading.side_file import Method, save_side_file, side_file_name
    from common.model.args import ModelConfig
    from common.text.tokenizer import Tokenizer
    from common.tpla.calibration import DEFAULT_CALIB_CHARS, load_text, token_windows
    from common.tpla.convert import reparameterization_from
    from common.tpla.layer_calibration import calibrate_checkpoint
    from common.tpla.rotated_checkpoint import convert_checkpoint

    _threads(args.threads)
    model_dir = Path(load_settings(model=args.model).model)
    method = Method(args.method)
    text = load_text(args.calib, args.calib_chars or DEFAULT_CALIB_CHARS)
    ids = Tokenizer.from_dir(model_dir).encode(text.text, add_bos=False)
    window = min(args.window, ModelConfig.from_dir(model_dir).max_position_embeddings)
    # Layer by layer, never the whole model; the MTP layers' latents are cached too
    # (speculation `mtp`), so their basis comes along.
    calibration = calibrate_checkpoint(
        model_dir, token_windows(ids, window), source=text.source, progress=not args.quiet
    )
    stats = calibration.stats
    side = reparameterization_from(
        calibration.config, calibration.fingerprint, method, stats, seed=args.seed
    )
    if args.out:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        convert_checkpoint(model_dir, args.out, side, dtype=dtype.get(args.dtype or ""))
        written = Path(args.out) / side_file_name(method)
    else:
        written = Path(args.side_file) if args.side_file else model_dir / side_file_name(method)
        save_side_file(written, side)
    shares = [
        round(float(s[: len(s) // 2].sum() / s.sum()), 4)
        for s in (*side.spectra(), *side.mtp_spectra())
    ]  # what r = 2 would see per layer (the MTP layers' last)
    print(
        json.dumps(
            {
                "method": method.value,
                "side_file": str(written),
                "checkpoint": args.out,
                "calibration_tokens": stats.tokens,
                "mtp_layers": side.mtp_layers,
                "first_half_energy_per_layer": shares,
            }
        )
    )
    return 0


def add_convert_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `tpla convert`."""
    p = sub.add_parser(
        "convert",
        help="calibrate and reparameterize (fold gamma, rotate the latent) for TPLA",
        description="Without --out only the side file is written (applied at load time).",
    )
    p.add_argument("--model", help="source model directory (default: TPLA_MODEL or models/demo)")
    p.add_argument("--out", help="write a reparameterized HF checkpoint here")
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--calib", help="calibration text file or folder (default: demo corpus split)")
    p.add_argument("--calib-chars", type=int, help="calibration text budget (default 200000)")
    p.add_argument("--window", type=int, default=1024, help="calibration window (tokens)")
    p.add_argument("--seed", type=int, default=0, help="Hadamard sign seed")
    p.add_argument("--side-file", help="side file path when --out is absent")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the converted checkpoint (default: the source's)",
    )
    p.add_argument("--threads", type=int)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)


def cmd_eval(args: argparse.Namespace) -> int:
    from common.tpla.eval import EvalConfig, evaluate, format_table

    _threads(args.threads)
    settings = placed(load_settings(model=args.model, device=args.device, dtype=args.dtype))
    model_dir = settings.model
    config = EvalConfig(
        groups=args.groups,
        prefill_len=args.prefill_len,
        max_tokens=args.max_tokens_eval,
        window=args.window,
        seed=args.seed,
        calib_path=args.calib,
        calib_chars=args.calib_chars,
        eval_path=args.eval_text,
        progress=not args.quiet,
        device=settings.device,
        dtype=settings.dtype,
    )
    report = evaluate(model_dir, config)
    print(format_table(report), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report.contract()))
    return 0


def add_eval_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `tpla eval`."""
    p = sub.add_parser("eval", help="perplexity of MLA, GLA, TPLA and TPLA-PD (single process)")
    p.add_argument("--model", help="model directory (default: TPLA_MODEL or models/demo)")
    p.add_argument("--groups", type=int, required=True, help="latent groups r")
    p.add_argument("--prefill-len", type=int, default=256, help="exact prompt tokens per window")
    p.add_argument("--max-tokens-eval", type=int, default=8192, help="eval token budget")
    p.add_argument("--window", type=int, help="window length (default: training length)")
    p.add_argument("--eval-text", help="eval text file or folder (default: demo eval split)")
    p.add_argument("--calib", help="calibration text when a side file is missing")
    p.add_argument("--calib-chars", type=int, help="calibration text budget (default 200000)")
    p.add_argument("--seed", type=int, default=0, help="Hadamard sign seed when calibrating")
    p.add_argument("--threads", type=int)
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (default: TPLA_DEVICE, auto)")
    p.add_argument("--dtype", help="auto | float32 | bfloat16 | float16 (default: TPLA_DTYPE)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="last stdout line is the JSON result")
    p.set_defaults(func=cmd_eval)

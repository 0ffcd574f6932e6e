"""`tpla convert`, `tpla eval`, `tpla plan` and the TPLA modes of `tpla generate` (registered by
common.cli).

Heavy imports (torch, the model) happen inside the command functions so `tpla --help` stays
fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.settings import load_settings

if TYPE_CHECKING:
    from common.generate import Generation
    from common.model.model import DeepseekForCausalLM
    from common.sampling import SamplingParams
    from common.tpla.plan import Checkpoint, Plan

METHODS = ("identity", "hadamard", "pca")
DTYPES = ("float32", "bfloat16", "float16")
MODES = ("mla", "tpla", "tpla-pd", "gla")
RMSNORM_MODES = ("exact", "sliced")


def _threads(count: int | None) -> None:
    import torch

    torch.set_num_threads(load_settings(torch_threads=count).torch_threads)


def cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from common.model.loader import load_model
    from common.tokenizer import Tokenizer
    from common.tpla.calibration import (
        DEFAULT_CALIB_CHARS,
        collect_latent_statistics,
        load_text,
        token_windows,
    )
    from common.tpla.convert import (
        build_reparameterization,
        convert_checkpoint,
        save_side_file,
        side_file_name,
    )
    from common.tpla.transforms import Method

    _threads(args.threads)
    model_dir = Path(load_settings(model=args.model).model)
    method = Method(args.method)
    model = load_model(model_dir)
    text = load_text(args.calib, args.calib_chars or DEFAULT_CALIB_CHARS)
    ids = Tokenizer.from_dir(model_dir).encode(text.text, add_bos=False)
    window = min(args.window, model.config.max_position_embeddings)
    stats = collect_latent_statistics(
        model, token_windows(ids, window), source=text.source, progress=not args.quiet
    )
    side = build_reparameterization(model, method, stats, seed=args.seed)
    if args.out:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        convert_checkpoint(model_dir, args.out, side, dtype=dtype.get(args.dtype or ""))
        written = Path(args.out) / side_file_name(method)
    else:
        written = Path(args.side_file) if args.side_file else model_dir / side_file_name(method)
        save_side_file(written, side)
    shares = [
        round(float(s[: len(s) // 2].sum() / s.sum()), 4) for s in side.spectra()
    ]  # what r = 2 would see per layer
    print(
        json.dumps(
            {
                "method": method.value,
                "side_file": str(written),
                "checkpoint": args.out,
                "calibration_tokens": stats.tokens,
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
    model_dir = load_settings(model=args.model).model
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
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="last stdout line is the JSON result")
    p.set_defaults(func=cmd_eval)


def _read_checkpoint(args: argparse.Namespace) -> tuple[Path, Checkpoint]:
    from common.tpla.plan import checkpoint_from_hf_dict

    path = Path(args.config) if args.config else Path(args.model) / "config.json"
    if not path.is_file():
        where = f"--config {args.config}" if args.config else f"model directory {args.model}"
        raise ValueError(f"no config.json found ({where})")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return path, checkpoint_from_hf_dict(raw)


def cmd_plan(args: argparse.Namespace) -> int:
    """`tpla plan`: the table on stdout; with --json, the plan as the last stdout line."""
    from common.tpla.plan import GIB, Hardware, PlanRequest, build_plan

    path, ckpt = _read_checkpoint(args)
    hardware = Hardware(
        gpu_mem_bytes=round(args.gpu_mem_gib * GIB),
        gpus_per_group=args.gpus_per_group,
        reserve_bytes=None if args.reserve_gib is None else round(args.reserve_gib * GIB),
    )
    request = PlanRequest(
        hardware=hardware,
        latent_groups=tuple(args.latent_groups),
        context=args.context,
        kv_dtype=args.dtype,
        weight_dtype=args.weight_dtype or args.dtype,
        exact_rmsnorm=args.rmsnorm == "exact",
        block_size=args.block_size,
        chunk_size=args.chunk_size,
        fp8_block=ckpt.fp8_block,
    )
    plan = build_plan(ckpt.config, request)
    print(format_plan(plan, path, ckpt))
    if args.json:
        print(
            json.dumps(
                {
                    "config": str(path),
                    "checkpoint_quantization": ckpt.quant_method,
                    "mtp_layers_not_loaded": ckpt.mtp_layers,
                    **plan.to_json(),
                }
            )
        )
    return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def format_plan(plan: Plan, path: Path, ckpt: Checkpoint) -> str:
    """The human-readable plan: one row per layout, then what the numbers mean."""
    from common.tpla.plan import FP8, Kind

    c, req = plan.config, plan.request
    hw, ctx = req.hardware, req.context
    mtp = f" (+{ckpt.mtp_layers} MTP layer(s), not loaded)" if ckpt.mtp_layers else ""
    quant = f"; checkpoint stored as {ckpt.quant_method}" if ckpt.quant_method else ""
    base = plan.by_kind(Kind.MLA_TP).max_tokens
    lines = [
        f"{path}: {c.model_type}, {c.num_hidden_layers} layers{mtp}, {c.num_attention_heads} "
        f"heads, d_c={c.kv_lora_rank} d_r={c.qk_rope_head_dim}{quant}",
        f"decode group: {hw.gpus_per_group} GPUs x {_gib(hw.gpu_mem_bytes)} GiB; reserve "
        f"{_gib(hw.reserve)} GiB per GPU; weights {req.weight_dtype}, KV {req.kv_dtype}, "
        f"RMSNorm {'exact' if req.exact_rmsnorm else 'sliced'}, block {req.block_size}, "
        f"SP chunk {req.chunk_size}",
        "",
        f"{'layout':<10} {'heads':>5} {'latent':>6} {'weights':>8} {'KV bytes':>9} "
        f"{'KV budget':>9} {'tokens':>11} {'vs':>6} {'seqs':>7}  fits",
        f"{'':<10} {'/rank':>5} {'/rank':>6} {'GiB':>8} {'/token':>9} "
        f"{'GiB':>9} {'/group':>11} {'mla-tp':>6} {f'@{ctx}':>7}",
    ]
    for p in plan.layouts:
        lay = p.layout
        kv = f"{p.kv_bytes_per_token:,.0f}" + ("*" if lay.kind is Kind.SP else "")
        ratio = f"{p.max_tokens / base:.2f}x" if base else "-"
        lines.append(
            f"{lay.label:<10} {c.num_attention_heads // lay.head_groups:>5} "
            f"{c.kv_lora_rank // lay.latent_groups:>6} {_gib(p.weights_bytes):>8} {kv:>9} "
            f"{_gib(p.kv_budget_bytes):>9} {p.max_tokens:>11,} {ratio:>6} "
            f"{p.max_sequences:>7,}  {'yes' if p.fits else 'NO'}"
        )
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in plan.breakdown)
    lines += [
        "",
        f"{plan.chosen.layout.label} rank weights (GiB): {parts}",
        "* SP: a rank caches whole-width tokens of its round-robin chunks only, about 1/tp "
        "of each sequence; per context token that is (d_c + d_r) x layers x bytes / tp.",
        "tokens: context tokens the group can cache, bounded by one rank's pool (whole "
        f"blocks); seqs: sequences of {ctx} tokens (prompt + max_tokens) held at once.",
        "fits: weights + reserve < GPU memory. A rank reads only its share from the "
        f"checkpoint (the whole model is {_gib(plan.full_model_bytes)} GiB).",
    ]
    if req.weight_dtype == FP8:
        lines.append(
            "float8 weights are a what-if: the loader reads FP8 checkpoints but dequantizes "
            "them to the serving dtype (plan those with --weight-dtype bfloat16)."
        )
    return "\n".join(lines)


def add_plan_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `tpla plan`."""
    p = sub.add_parser(
        "plan",
        help="capacity plan of a decode group: per-rank weights, KV bytes, tokens that fit",
        description="From config.json alone (no weights): per decode rank, the weights the "
        "engine holds and the KV cache left for MLA-TP, TPLA and SP.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model directory holding config.json")
    src.add_argument("--config", help="path of a config.json")
    p.add_argument("--gpu-mem-gib", type=float, required=True, help="memory of one GPU (GiB)")
    p.add_argument("--gpus-per-group", type=int, required=True, help="decode ranks (tp)")
    p.add_argument(
        "--latent-groups",
        type=int,
        nargs="+",
        default=[2],
        help="TPLA latent groups r (several compare several; the first is what --json's "
        "tpla keys and `fits` describe)",
    )
    p.add_argument(
        "--context", type=int, required=True, help="tokens per sequence (prompt + max_tokens)"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="KV cache dtype")
    p.add_argument(
        "--weight-dtype",
        choices=[*sorted(DTYPES), "float8"],
        help="weights' dtype (default: --dtype); float8 = DeepSeek's block-FP8 format",
    )
    p.add_argument(
        "--reserve-gib",
        type=float,
        help="per-GPU memory kept off weights and KV (default: max(2 GiB, 10%% of the GPU))",
    )
    p.add_argument("--rmsnorm", choices=RMSNORM_MODES, default="exact")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (tokens)")
    p.add_argument("--chunk-size", type=int, default=256, help="SP tokens per chunk")
    p.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    p.set_defaults(func=cmd_plan)


def add_generate_mode_arguments(p: argparse.ArgumentParser) -> None:
    """The TPLA options of `tpla generate` (absent --mode keeps the plain engine path)."""
    p.add_argument(
        "--mode",
        choices=MODES,
        help="run the single-process oracle: mla, tpla (prompt sliced too), tpla-pd (exact "
        "prompt, sliced decode, as the served engine), gla",
    )
    p.add_argument("--latent-groups", type=int, default=2, help="latent groups r for tpla/gla")
    p.add_argument("--method", choices=METHODS, default="pca", help="latent basis (side file)")
    p.add_argument("--rmsnorm", choices=RMSNORM_MODES, default="exact")


def generate_with_mode(
    model: DeepseekForCausalLM,
    model_dir: str | Path,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    eos_ids: Sequence[int],
    args: argparse.Namespace,
) -> Generation:
    """`tpla generate --mode ...`: reparameterize from the side file, generate with the oracle."""
    from common.model.tpla import RmsNormMode
    from common.tpla.convert import load_reparameterization
    from common.tpla.reference import AttentionSpec, ReferenceModel, Variant, generate
    from common.tpla.transforms import Method

    variant = Variant(args.mode)
    groups = 1 if variant is Variant.MLA else args.latent_groups
    spectra = None
    if variant.sliced_latents:
        spectra = load_reparameterization(model, model_dir, Method(args.method))
    oracle = ReferenceModel(
        model, AttentionSpec(variant, groups, RmsNormMode(args.rmsnorm)), spectra
    )
    return generate(oracle, prompt_ids, params, eos_ids=eos_ids)

"""`tpla plan`: the capacity plan of a decode group and a prefill group
(common/tpla/capacity_plan.py) for a checkpoint's config.json on given cards, as a table
and, with --json, its contract line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from common.parallel import MOE_MODES, RMSNORM_MODES
from services.decode.config import DEFAULT_SPEC_TOKENS
from tools.cli.tpla import DTYPES

if TYPE_CHECKING:
    from common.tpla.capacity_plan import Checkpoint, Plan


def _read_checkpoint(args: argparse.Namespace) -> tuple[Path, Checkpoint]:
    from common.tpla.capacity_plan import checkpoint_from_hf_dict

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
    from common.parallel import RmsNormMode, parse_moe
    from common.tpla.capacity_plan import GIB, Hardware, PlanRequest, build_plan

    path, ckpt = _read_checkpoint(args)
    if args.speculative == "mtp" and not ckpt.mtp_layers:
        raise ValueError(
            f"--speculative mtp: {path} has no MTP layer (num_nextn_predict_layers is 0 or unset)"
        )
    # The decode ranks load MTP module 0 and chain drafts through it (V3 ships one).
    mtp_loaded = min(ckpt.mtp_layers, 1) if args.speculative == "mtp" else 0
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
        rmsnorm=RmsNormMode(args.rmsnorm),
        block_size=args.block_size,
        chunk_size=args.chunk_size,
        fp8_block=ckpt.fp8_block,
        int4_group=ckpt.int4_group,
        moe=parse_moe(args.moe_parallel),
        prefill_gpus=args.prefill_gpus,
        mtp_layers=mtp_loaded,
        max_batch=args.max_batch,
        max_model_len=args.max_model_len,
        # A drafting step: up to TPLA_SPEC_MAX_BATCH sequences of 1 + k rows each.
        draft_rows=args.spec_max_batch * (1 + DEFAULT_SPEC_TOKENS["mtp"]) if mtp_loaded else 0,
        index_cache_dtype=args.index_cache_dtype,
    )
    plan = build_plan(ckpt.config, request)
    manifest = _manifest(plan, args.gpus_per_node)
    print(format_plan(plan, path, ckpt))
    print(format_manifest(manifest, args.gpus_per_node))
    if args.json:
        print(
            json.dumps(
                {
                    "config": str(path),
                    "checkpoint_quantization": ckpt.quant_method,
                    "mtp_layers_not_loaded": ckpt.mtp_layers - mtp_loaded,
                    "speculative": args.speculative,
                    **plan.to_json(),
                    "manifest": manifest,
                }
            )
        )
    return 0


def _manifest(plan: Plan, gpus_per_node: int) -> dict[str, object] | str:
    """The GPU overlay's values for the plan's groups (common/tpla/pod_layout.py), or why the
    groups fill no whole nodes."""
    from common.tpla.pod_layout import PodLayoutError, manifest_values

    req, chosen = plan.request, plan.chosen
    try:
        return manifest_values(
            req.hardware.gpus_per_group,
            chosen.layout.latent_groups,
            chosen.kv_budget_bytes,
            req.prefill_gpus,
            gpus_per_node,
        )
    except PodLayoutError as exc:
        return str(exc)


def format_manifest(manifest: dict[str, object] | str, gpus_per_node: int) -> str:
    """The manifest lines under the table: one pod per node (docs/deploy.md)."""
    head = f"\nmanifests (k8s/overlays/gpu: one pod per node of {gpus_per_node} GPUs):"
    if isinstance(manifest, str):
        return f"{head} none: {manifest}"
    settings = " ".join(f"{k}={v}" for k, v in manifest.items() if k.startswith("TPLA_"))
    lines = [head, f"  tpla-config: {settings}"]
    for role in ("decode", "prefill"):
        pods = manifest[role]
        assert isinstance(pods, dict)
        lines.append(
            f"  tpla-{role} LeaderWorkerSet: size {pods['size']}; a pod: nvidia.com/gpu "
            f"{pods['nvidia.com/gpu']}, /dev/shm sizeLimit {pods['shm_size_limit']}"
        )
    return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def format_plan(plan: Plan, path: Path, ckpt: Checkpoint) -> str:
    """The human-readable plan: one row per layout, then what the numbers mean."""
    from common.parallel import span

    c, req = plan.config, plan.request
    hw, ctx = req.hardware, req.context
    loaded = "loaded: weights and cache counted" if req.mtp_layers else "not loaded"
    mtp = f" (+{ckpt.mtp_layers} MTP layer(s), {loaded})" if ckpt.mtp_layers else ""
    quant = f"; checkpoint stored as {ckpt.quant_method}" if ckpt.quant_method else ""
    base = plan.baseline.max_tokens
    lines = [
        f"{path}: {c.model_type}, {c.num_hidden_layers} layers{mtp}, {c.num_attention_heads} "
        f"heads, d_c={c.kv_lora_rank} d_r={c.qk_rope_head_dim}{quant}",
        f"decode group: {hw.gpus_per_group} GPUs x {_gib(hw.gpu_mem_bytes)} GiB; reserve "
        f"{_gib(hw.reserve)} GiB per GPU; weights {req.weight_dtype}, KV {req.kv_dtype}, "
        f"RMSNorm {req.rmsnorm.value}, block {req.block_size}, "
        f"SP chunk {req.chunk_size}, MoE {req.moe.value}",
        "",
        f"{'layout':<10} {'heads':>5} {'latent':>6} {'weights':>8} {'KV bytes':>9} "
        f"{'KV budget':>9} {'tokens':>11} {'vs':>6} {'seqs':>7}  fits",
        f"{'':<10} {'/rank':>5} {'/rank':>6} {'GiB':>8} {'/token':>9} "
        f"{'GiB':>9} {'/group':>11} {plan.baseline.name:>6} {f'@{ctx}':>7}",
    ]
    for p in plan.layouts:
        lay = p.layout
        kv = f"{p.kv_bytes_per_token:,.0f}" + ("" if lay.caches_every_token else "*")
        ratio = f"{p.max_tokens / base:.2f}x" if base else "-"
        heads = span(lay.heads(0, c.num_attention_heads))
        latent = span(lay.latent_columns(0, c.kv_lora_rank))
        lines.append(
            f"{p.label:<10} {heads:>5} {latent:>6} {_gib(p.weights_bytes):>8} {kv:>9} "
            f"{_gib(p.kv_budget_bytes):>9} {p.max_tokens:>11,} {ratio:>6} "
            f"{p.max_sequences:>7,}  {'yes' if p.fits else 'NO'}"
        )
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in plan.breakdown)
    chosen = plan.chosen
    lines += [
        "",
        f"CUDA graphs: {chosen.graphs} per rank (batch limit {req.max_batch}, context limit "
        f"{req.max_model_len or c.max_position_embeddings}); in the reserve (estimates): their "
        f"pool {_gib(chosen.graph_pool_bytes)} GiB, NCCL {_gib(chosen.nccl_bytes)} GiB"
        + (" (within --reserve-gib)" if hw.reserve_bytes is not None else " (on top of it)"),
        "",
        f"{plan.chosen.label} rank weights (GiB): {parts}",
        "* SP: a rank caches whole-width tokens of its round-robin chunks only, about 1/tp "
        "of each sequence; per context token that is (d_c + d_r) x layers x bytes / tp.",
        "tokens: context tokens the group can cache, bounded by one rank's pool (whole "
        f"blocks); seqs: sequences of {ctx} tokens (prompt + max_tokens) held at once.",
        "fits: weights + reserve < GPU memory. A rank reads only its share from the "
        f"checkpoint (the whole model is {_gib(plan.full_model_bytes)} GiB).",
        "",
        f"prefill group: {req.prefill_gpus} GPUs (MLA-TP, MoE {req.moe.value}, embedding and "
        f"LM head by vocabulary): weights {_gib(plan.prefill_weights_bytes)} GiB per rank; "
        f"fits: {'yes' if plan.prefill_fits else 'NO'} (weights + reserve < GPU memory; "
        "activations of a prefill chunk come out of the reserve)",
    ]
    lines += _notes(plan)
    return "\n".join(lines)


def _notes(plan: Plan) -> list[str]:
    """What the plan's model and weights add to its reading: DSA's keys, quantized weights."""
    from common.tpla.rank_memory import FP8, QUANTIZED, index_key_bytes

    c, req = plan.config, plan.request
    lines: list[str] = []
    if c.dsa is not None:
        keys = index_key_bytes(c, req.kv_dtype, req.mtp_layers, req.index_cache_dtype)
        full = c.dsa.key_layers(c.num_hidden_layers + req.mtp_layers)
        lines.append(
            f"DSA: indexer keys ({req.index_cache_dtype}) of {full} full layers, {keys:,} bytes "
            "a stored token on every rank that caches it, are in the KV bytes; each query "
            f"attends over {c.dsa.index_topk} selected tokens."
        )
    if req.weight_dtype in (QUANTIZED, FP8) and req.int4_group is not None:
        lines.append(
            f"{req.weight_dtype} weights: the checkpoint's INT4 routed experts at 4 bits a "
            f"value plus a bf16 scale per {req.int4_group}, its other weights in bf16, as a "
            f"rank holds them with TPLA_WEIGHT_DTYPE={req.weight_dtype} (auto on CUDA); with "
            "the weights dequantized at load, plan --weight-dtype bfloat16."
        )
    elif req.weight_dtype in (QUANTIZED, FP8):
        lines.append(
            f"{req.weight_dtype} weights: what a rank holds with TPLA_WEIGHT_DTYPE="
            f"{req.weight_dtype} (auto on CUDA); with the weights dequantized at load, plan "
            "--weight-dtype bfloat16."
        )
    return lines


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
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="the model's dtype (TPLA_DTYPE): its KV cache, and a quantized checkpoint's "
        "unquantized weights",
    )
    p.add_argument(
        "--index-cache-dtype",
        choices=("model", "fp8"),
        default="model",
        help="DSA models' indexer keys in the KV pools (TPLA_INDEX_CACHE_DTYPE): the KV dtype, "
        "or DeepSeek's fp8 (d_I + 4 bytes a key)",
    )
    p.add_argument(
        "--weight-dtype",
        choices=[*sorted(DTYPES), "quantized", "float8"],
        help="weights' dtype (default: --dtype); quantized (or float8) = as the checkpoint "
        "stores them: DeepSeek's block FP8, or compressed-tensors' INT4 experts",
    )
    p.add_argument(
        "--reserve-gib",
        type=float,
        help="per-GPU memory kept off weights and KV (default: max(2 GiB, 10%% of the GPU), "
        "and on top a decode rank's CUDA graphs' pool and NCCL's buffers, estimated)",
    )
    p.add_argument("--rmsnorm", choices=RMSNORM_MODES, default="exact")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (tokens)")
    p.add_argument("--chunk-size", type=int, default=256, help="SP tokens per chunk")
    p.add_argument(
        "--moe-parallel",
        choices=MOE_MODES,
        default="tp",
        help="routed experts: a column slice of each (tp) or whole experts per rank (ep)",
    )
    p.add_argument(
        "--prefill-gpus",
        type=int,
        default=1,
        help="ranks of one prefill group (TPLA_PREFILL_TP) on the same cards: the prefill "
        "rank's weights and whether they fit",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="GPUs of a node: the suggested manifests run one pod per node (default 8)",
    )
    _add_step_args(p)
    p.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    p.set_defaults(func=cmd_plan)


def _add_step_args(p: argparse.ArgumentParser) -> None:
    """What a decode step's shapes follow: the CUDA graphs a rank captures, and MTP's weights."""
    p.add_argument(
        "--max-batch",
        type=int,
        default=32,
        help="decode batch limit (TPLA_MAX_BATCH): the CUDA graphs and their pool",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="context limit (TPLA_MAX_MODEL_LEN; default: the model's): the graphs' widths",
    )
    p.add_argument(
        "--spec-max-batch",
        type=int,
        default=4,
        help="with --speculative mtp: sequences a drafting step runs (TPLA_SPEC_MAX_BATCH)",
    )
    p.add_argument(
        "--speculative",
        choices=("none", "ngram", "mtp"),
        default="none",
        help="mtp: the checkpoint's MTP layers are loaded, their weights and latent cache "
        "counted on every rank (ngram needs no weights)",
    )

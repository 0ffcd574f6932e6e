"""`tpla bench decode-attn`: per-device absorbed decode attention, MLA-TP vs TPLA, vs roofline.

Per device at tp = 2 (the paper's Figure 3 setting):
  * MLA-TP: r = 1, H/2 heads, the full latent d_c + d_r per cached token;
  * TPLA:   r = 2, all H heads, half the latent d_c/2 + the replicated d_r.

Timed region (what the decode engine runs per layer for attention, `RankModel.decode_step`):
`fused_slice_attention` reading the cache through `PagedLatentCache.rows` (whole-block copies
of a batch's block tables, a few MB per chunk; blocks in shuffled pool order, as after
allocator churn): q~ = q_nope W_UK, scores against [n | k_pe], padding mask, split-K
softmax, u = p n, o = u W_UV^T. It starts from the rotated
queries [B, h, d_n + d_r] and ends at per-head values [B, h, d_v]; the query projection, the
new token's cache write and o_proj are dense per-token layers, not attention, and are
excluded. `--kernel reference` times the per-token `gather` + einsum `latent_slice_attention`
(the engine's previous code) instead. MLA-TP and TPLA calls alternate (same background load
for both); the fastest of the repeats of every sweep of the grid (`--rounds`) is `ms`, their
median `ms_median`.

`--kernel triton` times the Triton paged kernel (common/triton_kernels/decode_attention.py)
on a CUDA GPU over the same region, bf16: absorbed queries, the kernel reading the paged
cache in place, the W_UV product. It scores each row against the GPU's HBM roofline (see
`gpu_peak`) instead of this CPU's; on a machine without CUDA it says so and times nothing
(the interpreter's speed means nothing).

FLOPs and bytes are counted once, in `DeviceWork` (attn_work.py): matmul FLOPs only (2 per
multiply-add; the softmax's O(h T) exps are not counted) and ideal bytes (cache read once,
weights, queries and output once; the gather's copy is the kernel's overhead, not part of the
bound).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from common.kv.paged_cache import CacheLayout, PagedLatentCache
from common.model.tpla import fused_slice_attention, latent_slice_attention
from common.native.latent_attention import paged_latent_attention
from tools.bench.attn_work import BLOCK_SIZE, GPUS, MODES, TP, DeviceWork, device_work, grid, shapes
from tools.bench.output import table_stream
from tools.bench.roofline import Roofline, measure_roofline, roofline_record

COLD_BYTES = 96 * 2**20  # > the 32 MB L3 of the development VM, so each layer comes from DRAM

# --dsa: V3.2 from a short context to its long ones.
DSA_CONTEXTS = (4096, 32768, 131072)


def prepare_attention(
    work: DeviceWork, kernel: str, seed: int = 0
) -> Callable[[int], torch.Tensor]:
    """`run(i)`: one call of the engine's attention on a real paged cache (see module doc).

    Like the engine, consecutive calls read different layers' caches, and there are enough
    layers (at least COLD_BYTES of cache) that a call never finds its layer still in the CPU
    cache from the previous one; otherwise small shapes would run from L3, not DRAM.
    """
    g = torch.Generator().manual_seed(seed)
    per_seq = math.ceil(work.context / BLOCK_SIZE)
    num_blocks = work.batch * per_seq
    layer_bytes = num_blocks * BLOCK_SIZE * (work.width + work.d_r) * 4
    layers = min(max(math.ceil(COLD_BYTES / layer_bytes), 1), 256)
    layout = CacheLayout(layers, work.width, work.d_r, BLOCK_SIZE)
    cache = PagedLatentCache(layout, num_blocks)
    cache.kv.normal_(generator=g)
    # Shuffled pool order: block tables as after allocator churn, never one contiguous run.
    block_ids = torch.randperm(num_blocks, generator=g).view(work.batch, per_seq)
    lengths = torch.full((work.batch,), work.context)
    b, h = work.batch, work.heads
    q_nope = torch.randn(b, h, work.d_n, generator=g)
    q_pe = torch.randn(b, h, work.d_r, generator=g)
    w_uk = torch.randn(h, work.d_n, work.width, generator=g) * 0.05
    w_uv = torch.randn(h, work.d_v, work.width, generator=g) * 0.05
    scale, beta = (work.d_n + work.d_r) ** -0.5, 0.5
    chunk = cache.chunk_tokens(b)
    pos = torch.arange(work.context)
    slots = block_ids[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    valid = torch.ones(b, 1, work.context, dtype=torch.bool)

    def run(layer: int) -> torch.Tensor:
        if kernel == "native":
            return paged_latent_attention(
                q_nope,
                q_pe,
                cache.kv[layer],
                block_ids,
                lengths,
                BLOCK_SIZE,
                w_uk,
                w_uv,
                scale,
                beta,
            )
        if kernel == "fast":
            rows = cache.rows(layer, block_ids)
            return fused_slice_attention(
                q_nope, q_pe, rows.read, rows.total, chunk, lengths, w_uk, w_uv, scale, beta
            )
        n, k_pe = cache.gather(layer, slots)
        return latent_slice_attention(
            q_nope[:, None], q_pe[:, None], n, k_pe, valid, w_uk, w_uv, scale, beta
        )

    return lambda i: run(i % layers)


def time_pair(works: dict[str, DeviceWork], kernel: str, repeats: int) -> dict[str, list[float]]:
    """Seconds per call for each mode, calls interleaved so that both modes see the same
    background load on a shared machine (their ratio is the result that matters)."""
    runs = {mode: prepare_attention(work, kernel) for mode, work in works.items()}
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    with torch.inference_mode():
        for run in runs.values():
            run(-1)  # warm-up: workspace, BLAS dispatch
        for i in range(repeats):
            for mode, run in runs.items():
                t0 = time.perf_counter()
                run(i)
                times[mode].append(time.perf_counter() - t0)
    return times


def run_bench(
    roof: Roofline,
    quick: bool,
    kernel: str = "fast",
    demo_dir: str = "models/demo",
    names: list[str] | None = None,
    rounds: int = 1,
    remeasure: Callable[[], Roofline] | None = None,
) -> tuple[list[dict[str, Any]], Roofline]:
    """Time every (shape, context, batch, mode) -> (rows, the roofline they are scored on).

    The grid is swept `rounds` times and each row keeps the repeats of every round, so that
    its fastest call is not all taken in one minute: on a shared VM a slow minute otherwise
    lands on a run of consecutive rows (measured: one run's V3 rows at 2K-32K x 1 came out
    15-35% slower in both modes, and equal to the previous kernel when alternated after).
    The roofline is the denominator, so it gets the same treatment: `remeasure()` runs after
    every round and the best peaks are kept (quick runs measured 70-84 GFLOP/s and 13.8-16.2
    GB/s from one run to the next, moving every fraction with them).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    cells = [
        (shape, context, batch)
        for shape in shapes(demo_dir)
        if not names or shape.name in names
        for context, batch in grid(quick)
    ]
    timed: dict[tuple[str, int, int], dict[str, list[float]]] = {}
    for _ in range(rounds):
        for shape, context, batch in cells:
            works = {m: device_work(shape, m, batch, context) for m in MODES}
            # About 0.3 s of ideal work per mode and round, at least 5 repeats, at most 20.
            ideal = max(roof.bound_seconds(w.flops(), w.bytes(4)) for w in works.values())
            repeats = max(5, min(20, int(0.3 / max(ideal, 1e-6))))
            cell = timed.setdefault((shape.name, context, batch), {m: [] for m in works})
            for mode, times in time_pair(works, kernel, repeats).items():
                cell[mode].extend(times)
        if remeasure is not None:
            roof = roof.best(remeasure())
    rows: list[dict[str, Any]] = []
    for shape, context, batch in cells:
        for mode, times in timed[(shape.name, context, batch)].items():
            work = device_work(shape, mode, batch, context)
            rows.append(
                {
                    "shape": shape.name,
                    "mode": mode,
                    "context": context,
                    "batch": batch,
                    "kernel": kernel,
                    "heads_per_device": work.heads,
                    "latent_width": work.width,
                    "d_r": work.d_r,
                    "d_n": work.d_n,
                    "d_v": work.d_v,
                    "ms": 1e3 * min(times),
                    "ms_median": 1e3 * statistics.median(times),
                    "repeats": len(times),
                }
            )
    finish_rows(rows, roof)
    return rows, roof


def work_of(row: dict[str, Any]) -> DeviceWork:
    return DeviceWork(
        row["heads_per_device"],
        row["latent_width"],
        row["d_r"],
        row["d_n"],
        row["d_v"],
        row["batch"],
        row["context"],
    )


def finish_rows(rows: list[dict[str, Any]], roof: Roofline) -> None:
    """(Re)compute every derived field of timed rows from `roof`: rates, bounds, ratios."""
    by_key: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for row in rows:
        work = work_of(row)
        seconds = row["ms"] / 1e3
        flops, nbytes = work.flops(), work.bytes(4)
        bound = roof.bound_seconds(flops, nbytes)
        memory_bound = nbytes / roof.bytes_per_s >= flops / roof.flops_per_s
        row.update(
            {
                "flops": flops,
                "bytes": nbytes,
                "intensity_flop_per_byte": flops / nbytes,
                "gflops_per_s": flops / seconds / 1e9,
                "gbytes_per_s": nbytes / seconds / 1e9,
                "bound_ms": 1e3 * bound,
                "bound_by": "memory" if memory_bound else "compute",
                "roofline_fraction": bound / seconds,
            }
        )
        by_key.setdefault((row["shape"], row["context"], row["batch"]), {})[row["mode"]] = row
    for pair in by_key.values():
        if set(pair) != set(MODES):
            continue
        mla, tpla = (pair[m] for m in MODES)
        tpla["speedup_vs_mla_tp"] = mla["ms"] / tpla["ms"]
        tpla["predicted_speedup_cpu"] = mla["bound_ms"] / tpla["bound_ms"]
        for gpu in GPUS:
            key = "predicted_speedup_" + gpu.name.split()[0].lower()
            tpla[key] = gpu.bound_seconds(work_of(mla)) / gpu.bound_seconds(work_of(tpla))


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'shape':17} {'mode':6} {'ctx':>6} {'B':>3} {'ms':>9} {'GFLOP/s':>8} {'GB/s':>6} "
        f"{'bound':>8} {'frac':>5} {'speedup':>8} {'pred':>5}"
    )
    lines = [head]
    for r in rows:
        sp = f"{r['speedup_vs_mla_tp']:.2f}x" if "speedup_vs_mla_tp" in r else ""
        pr = f"{r['predicted_speedup_cpu']:.2f}x" if "predicted_speedup_cpu" in r else ""
        lines.append(
            f"{r['shape']:17} {r['mode']:6} {r['context']:>6} {r['batch']:>3} {r['ms']:>9.3f} "
            f"{r['gflops_per_s']:>8.1f} {r['gbytes_per_s']:>6.1f} {r['bound_ms']:>8.3f} "
            f"{r['roofline_fraction']:>5.2f} {sp:>8} {pr:>5}"
        )
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    if args.dsa:
        from tools.bench.dsa_attn import run_dsa

        args.contexts = args.contexts or list(DSA_CONTEXTS)
        return run_dsa(args)
    if args.kernel == "triton":
        from tools.bench.decode_attn_gpu import run_triton

        return run_triton(args)
    sizes = (1024, 256.0) if args.quick else (2048, 512.0)
    rows, roof = run_bench(
        measure_roofline(*sizes),
        args.quick,
        args.kernel,
        args.demo,
        args.shapes,
        args.rounds,
        remeasure=lambda: measure_roofline(*sizes),
    )
    median_fraction = statistics.median(float(r["roofline_fraction"]) for r in rows)
    summary = {
        "rows": rows,
        "roofline": roofline_record(roof),
        "tp": TP,
        "block_size": BLOCK_SIZE,
        "kernel": args.kernel,
        "quick": args.quick,
        "rounds": args.rounds,
        "median_roofline_fraction": median_fraction,
        "gpus": [asdict(g) for g in GPUS],
    }
    if args.plot:
        from tools.bench.plots import plot_decode_attn

        plot_decode_attn(summary, Path(args.plot))
    out = table_stream(args.json)
    print(_table(rows), file=out)
    print(f"median roofline_fraction {median_fraction:.2f} (threads {roof.threads})", file=out)
    if args.json:
        print(json.dumps(summary))
    return 0


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("decode-attn", help="per-device decode attention vs roofline")
    p.add_argument("--quick", action="store_true", help="a small subset (well under a minute)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="sweeps of the grid; each row keeps its fastest call over all of them (default 3)",
    )
    p.add_argument(
        "--kernel",
        choices=["native", "fast", "reference", "triton"],
        default="native",
        help="CPU kernels, or the Triton kernel on a CUDA GPU (bf16; HBM roofline)",
    )
    p.add_argument("--demo", default="models/demo", help="demo model dir for its shapes")
    p.add_argument("--shapes", nargs="+", help="subset of deepseek-v3 deepseek-v2-lite demo")
    p.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        help="--kernel triton: these contexts at batch 1 and 4 instead of the grid; --dsa: "
        f"these contexts (default {' '.join(map(str, DSA_CONTEXTS))})",
    )
    p.add_argument("--plot", help="write a Figure-3-style PNG here (CPU kernels)")
    p.add_argument(
        "--dsa",
        action="store_true",
        help="DeepSeek Sparse Attention at V3.2's per-device shapes: the indexer and the "
        "sparse attention timed apart, beside the dense attention (tools/bench/dsa_attn.py)",
    )
    p.add_argument("--batch", type=int, default=1, help="with --dsa: sequences per call")
    p.add_argument("--json", action="store_true", help="last stdout line is the JSON result")
    p.set_defaults(func=_run)

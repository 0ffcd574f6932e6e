"""`tpla bench decode-attn --kernel triton`: the Triton paged decode kernel on a CUDA GPU,
MLA-TP vs TPLA over the same region as the CPU rows (tools/bench/decode_attn.py), bf16, each
row against the GPU's HBM roofline (`gpu_peak`). Without CUDA it says so and times nothing
(the interpreter's speed means nothing)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

from common.kv.paged_cache import CacheLayout, PagedLatentCache
from tools.bench.attn_work import (
    BLOCK_SIZE,
    GPUS,
    MODES,
    TP,
    Accelerator,
    DeviceWork,
    device_work,
    grid,
    shapes,
)
from tools.bench.output import table_stream

GPU_COLD_BYTES = 256 * 2**20  # > the 50 MB L2 of an H100 / H200: every call reads HBM
GPU_CALLS = 20  # back-to-back calls per timing, between two CUDA events
NO_GPU = (
    "the Triton rows need a CUDA GPU: no CUDA device here, so nothing was timed "
    "(CPU rows: --kernel native | fast | reference)"
)


def gpu_peak(device: torch.device) -> tuple[Accelerator, str, float]:
    """(the roofline's accelerator, where its bandwidth comes from, measured copy bandwidth).

    Published HBM peaks for the GPUs in `GPUS` (an H100 PCIe has 2 TB/s, not the SXM's 3.35:
    it is not matched); any other GPU gets its measured device-to-device copy bandwidth
    (read + write bytes of a 1 GiB clone, best of 5) and no compute bound.
    """
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    copy_bw = 2 * src.numel() / best
    name = torch.cuda.get_device_name(device)
    for gpu in GPUS:
        if gpu.name.split()[0] in name and "PCIe" not in name:
            return gpu, f"published peak ({gpu.name})", copy_bw
    return Accelerator(name, copy_bw, float("inf")), "measured copy bandwidth", copy_bw


def prepare_triton(
    work: DeviceWork, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> Callable[[int], torch.Tensor]:
    """`run(i)`: the Triton decode attention of layer i % layers, from the rotated queries to
    the per-head values (`prepare_attention`'s region). The layers hold GPU_COLD_BYTES
    together, so a caller that counts i up never finds a layer still in L2."""
    from common.model.tpla import absorbed_queries
    from common.triton_kernels.decode_attention import paged_decode_attention

    g = torch.Generator().manual_seed(seed)
    per_seq = math.ceil(work.context / BLOCK_SIZE)
    num_blocks = work.batch * per_seq
    itemsize = torch.empty((), dtype=dtype).element_size()
    layer_bytes = num_blocks * BLOCK_SIZE * (work.width + work.d_r) * itemsize
    layers = min(max(math.ceil(GPU_COLD_BYTES / layer_bytes), 1), 4096)
    cache = PagedLatentCache(
        CacheLayout(layers, work.width, work.d_r, BLOCK_SIZE, dtype), num_blocks, device
    )
    cache.kv.normal_()
    block_ids = torch.randperm(num_blocks, generator=g).view(work.batch, per_seq).to(device)
    lengths = torch.full((work.batch,), work.context, device=device)
    b, h = work.batch, work.heads

    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(device, dtype)

    q_nope, q_pe = rand(b, h, work.d_n), rand(b, h, work.d_r)
    w_uk = rand(h, work.d_n, work.width, std=0.05)
    w_uv = rand(h, work.d_v, work.width, std=0.05)
    scale, beta = (work.d_n + work.d_r) ** -0.5, 0.5

    def run(layer: int) -> torch.Tensor:
        q = absorbed_queries(q_nope, q_pe, w_uk, scale, beta)
        u, _ = paged_decode_attention(
            q, cache.kv[layer % layers], block_ids, lengths, BLOCK_SIZE, rope_width=work.d_r
        )
        return torch.bmm(u.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    return run


def time_gpu(runs: dict[str, Callable[[int], torch.Tensor]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call, modes alternating. Each sample is GPU_CALLS back-to-back calls
    between two CUDA events divided by their number: the host queues ahead, as it does in a
    decode step, so the launches' host cost is hidden wherever the kernels take longer."""
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    calls = 0  # one count for every call: each reads the next layer, never one still in L2
    with torch.inference_mode():
        for run in runs.values():
            run(calls)  # compiles the kernels for this shape
        torch.cuda.synchronize()
        for _ in range(rounds):
            for mode, run in runs.items():
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(GPU_CALLS):
                    calls += 1
                    run(calls)
                end.record()
                end.synchronize()
                times[mode].append(start.elapsed_time(end) / 1e3 / GPU_CALLS)
    return times


def run_triton_bench(
    quick: bool,
    demo_dir: str,
    names: list[str] | None,
    rounds: int,
    contexts: list[int] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Time the Triton kernel at every (shape, context, batch, mode) on cuda:0, bf16
    (`contexts`: those, at batch 1 and 4, instead of the grid's)."""
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    gpu, source, copy_bw = gpu_peak(device)
    rows: list[dict[str, Any]] = []
    for shape in shapes(demo_dir):
        if names and shape.name not in names:
            continue
        pairs = grid(quick) if contexts is None else [(c, b) for c in contexts for b in (1, 4)]
        for context, batch in pairs:
            works = {m: device_work(shape, m, batch, context) for m in MODES}
            runs = {m: prepare_triton(w, device, dtype) for m, w in works.items()}
            pair: dict[str, dict[str, Any]] = {}
            for mode, times in time_gpu(runs, 5 * rounds).items():
                work = works[mode]
                seconds = min(times)
                nbytes, bound = work.bytes(2), gpu.bound_seconds(work)
                pair[mode] = {
                    "shape": shape.name,
                    "mode": mode,
                    "context": context,
                    "batch": batch,
                    "kernel": "triton",
                    "dtype": "bf16",
                    "heads_per_device": work.heads,
                    "latent_width": work.width,
                    "d_r": work.d_r,
                    "d_n": work.d_n,
                    "d_v": work.d_v,
                    "ms": 1e3 * seconds,
                    "ms_median": 1e3 * statistics.median(times),
                    "repeats": len(times) * GPU_CALLS,
                    "bytes": nbytes,
                    "flops": work.flops(),
                    "gbytes_per_s": nbytes / seconds / 1e9,
                    "hbm_fraction": nbytes / seconds / gpu.bytes_per_s,
                    "bound_ms": 1e3 * bound,
                    "roofline_fraction": bound / seconds,
                }
            mla, tpla = (pair[m] for m in MODES)
            tpla["speedup_vs_mla_tp"] = mla["ms"] / tpla["ms"]
            # The paper's TPLA / MLA-TP ratio: the roofline's, from bytes and FLOPs alone.
            tpla["predicted_speedup"] = mla["bound_ms"] / tpla["bound_ms"]
            rows += [mla, tpla]
            del runs
            torch.cuda.empty_cache()
    device_info = {
        "device": torch.cuda.get_device_name(device),
        "hbm_bytes_per_s": gpu.bytes_per_s,
        "roofline_source": source,
        "copy_bytes_per_s": copy_bw,
    }
    return rows, device_info


def run_triton(args: argparse.Namespace) -> int:
    """`--kernel triton`: the rows on this process's CUDA GPU against its HBM roofline."""
    summary: dict[str, Any] = {"kernel": "triton", "tp": TP, "block_size": BLOCK_SIZE}
    out = table_stream(args.json)
    if not torch.cuda.is_available():
        print(NO_GPU, file=out)
        summary.update({"rows": [], "skipped": NO_GPU})
    else:
        rows, device_info = run_triton_bench(
            args.quick, args.demo, args.shapes, args.rounds, args.contexts
        )
        summary.update({"rows": rows, "quick": args.quick, "rounds": args.rounds, **device_info})
        print(_gpu_table(rows), file=out)
        print(
            f"{device_info['device']}: HBM roofline {device_info['hbm_bytes_per_s'] / 1e12:.2f}"
            f" TB/s ({device_info['roofline_source']}; measured copy "
            f"{device_info['copy_bytes_per_s'] / 1e12:.2f} TB/s)",
            file=out,
        )
    if args.json:
        print(json.dumps(summary))
    return 0


def _gpu_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'shape':17} {'mode':6} {'ctx':>6} {'B':>3} {'ms':>8} {'GB/s':>7} {'hbm':>5} "
        f"{'roof':>5} {'speedup':>8} {'pred':>6}"
    ]
    for r in rows:
        sp = f"{r['speedup_vs_mla_tp']:.2f}x" if "speedup_vs_mla_tp" in r else ""
        pr = f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else ""
        lines.append(
            f"{r['shape']:17} {r['mode']:6} {r['context']:>6} {r['batch']:>3} {r['ms']:>8.4f} "
            f"{r['gbytes_per_s']:>7.1f} {r['hbm_fraction']:>5.2f} {r['roofline_fraction']:>5.2f} "
            f"{sp:>8} {pr:>6}"
        )
    return "\n".join(lines)

"""`tpla bench moe --fp8`: a MoE layer's FP8 routed experts on a CUDA GPU, the Triton FP8
grouped GEMM (`TPLA_EXPERTS_KERNEL=triton`) against dequantize-then-GEMM, at
DeepSeek-V3's expert shapes, each row against the GPU's HBM roofline.

Per shape and batch of T tokens (top-8 of 256 experts, random routing):
- `triton_fp8`: `Fp8GroupedExperts`, what a layer runs: x quantized per 1 x 128 group, both
  projections on the Triton kernel reading the e4m3 values and block scales as loaded;
- `dequantize`: the held experts dequantized to bf16 (the old way: every held expert, each
  step) then `grouped_experts` on the dequantized weights;
- `bf16`: `grouped_experts` on weights already bf16 (what dequantize-then-GEMM costs past its
  dequantization; it would hold twice the bytes).
`bytes` is what the FP8 path must read at least: the e4m3 values and scales of the experts
the batch's slots touch, and the activations; `hbm_fraction` = bytes / time / HBM bandwidth
(the published peak of an H100 SXM / H200, else the measured copy bandwidth). The L2 is
flushed (a 256 MiB write) before each timed call, so no call finds another's weights there.
Without CUDA it says so and times nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tools.bench.output import table_stream

NO_CUDA = "the FP8 experts' rows need a CUDA GPU: no CUDA here, so nothing was timed"
DEFAULT_OUT = "benchmarks/moe_fp8_cuda.json"
FLUSH_BYTES = 256 * 2**20  # > the 50 MB L2 of an H100 / H200
TOP_K, EXPERTS = 8, 256


@dataclass(frozen=True)
class Fp8Shape:
    name: str
    hidden: int
    intermediate: int  # of each held expert (its columns on this rank)
    held: int  # the rank's experts: global experts 0 .. held - 1


SHAPES = (
    Fp8Shape("v3-ep8", 7168, 2048, 32),  # whole experts, 32 of 256 on each of 8 ranks
    Fp8Shape("v3-tp8", 7168, 256, 256),  # every expert, 2048 / 8 columns of each
)


def fp8_stack(count: int, rows: int, cols: int, device: torch.device, role: str) -> Any:
    """Random e4m3 experts [count, rows, cols] with 128 x 128 block scales."""
    from common.model.fp8 import Fp8Weight, RowRun

    values = torch.empty(count, rows, cols, dtype=torch.float8_e4m3fn, device=device)
    for e in range(count):  # a bf16 temporary of one expert at a time
        values[e] = (torch.randn(rows, cols, device=device) * 64).to(torch.float8_e4m3fn)
    scale = torch.rand(count, math.ceil(rows / 128), math.ceil(cols / 128), device=device)
    return Fp8Weight(
        values,
        scale * 1e-4,
        (RowRun(rows, 0, 0),),
        0,
        (128, 128),
        (count, rows, cols),
        torch.bfloat16,
        role,
    )


def read_bytes(shape: Fp8Shape, ids: torch.Tensor, gate_up: Any, down: Any) -> int:
    """The e4m3 values and scales of the experts the slots touch, and the activations."""
    touched = int(ids[ids < shape.held].unique().numel())
    per_expert = sum(w.nbytes // shape.held for w in (gate_up, down))
    t = ids.shape[0]
    activations = t * shape.hidden * (2 + 2) + t * TOP_K * 2 * shape.intermediate * 2
    return touched * per_expert + activations


def prepare(shape: Fp8Shape, batch: int, device: torch.device) -> tuple[dict, int]:
    """The three kernels over one layer's inputs, and the bytes the FP8 path reads."""
    from common.model.expert_routing import route
    from common.model.experts import grouped_experts
    from common.model.experts_kernel import settle
    from common.model.fp8 import share_workspace

    g = torch.Generator().manual_seed(batch)
    d, i = shape.hidden, shape.intermediate
    x = torch.randn(batch, d, generator=g).to(device, torch.bfloat16)
    ids = torch.rand(batch, EXPERTS, generator=g).topk(TOP_K, dim=-1).indices.to(device)
    weights = torch.rand(batch, TOP_K, generator=g).to(device)
    gate_up = fp8_stack(shape.held, 2 * i, d, device, "gate_up")
    down = fp8_stack(shape.held, d, i, device, "down")
    share_workspace(torch.nn.ModuleDict({"gate_up": gate_up, "down": down}))
    kernel, how = settle("triton", gate_up, down)
    assert how == "triton (FP8 blocks)", how
    bf16_up, bf16_down = gate_up.dequantize().clone(), down.dequantize().clone()

    def run_fp8() -> torch.Tensor:
        return kernel(x, route(ids, weights, shape.held), gate_up, down)

    def run_dequantize() -> torch.Tensor:
        up_w, down_w = gate_up.dequantize(), down.dequantize()
        return grouped_experts(x, route(ids, weights, shape.held), up_w, down_w)

    def run_bf16() -> torch.Tensor:
        return grouped_experts(x, route(ids, weights, shape.held), bf16_up, bf16_down)

    runs = {"triton_fp8": run_fp8, "dequantize": run_dequantize, "bf16": run_bf16}
    return runs, read_bytes(shape, ids.cpu(), gate_up, down)


def time_calls(runs: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call between two CUDA events, the L2 flushed before each, kernels
    alternating."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for run in runs.values():
            run()  # compiles the kernels for this shape
        for _ in range(repeats):
            for name, run in runs.items():
                flush.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3)
    return times


def bench_rows(batches: list[int], repeats: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from tools.bench.decode_attn_gpu import gpu_peak

    device = torch.device("cuda", torch.cuda.current_device())
    gpu, source, copy_bw = gpu_peak(device)
    rows: list[dict[str, Any]] = []
    for shape in SHAPES:
        for batch in batches:
            runs, nbytes = prepare(shape, batch, device)
            with torch.inference_mode():
                want = runs["bf16"]().float()
                got = runs["triton_fp8"]().float()
            err = float((got - want).norm() / want.norm().clamp(min=1e-30))
            times = time_calls(runs, repeats)
            fp8_s = min(times["triton_fp8"])
            for name, t in times.items():
                rows.append(
                    {
                        "shape": shape.name,
                        "hidden": shape.hidden,
                        "intermediate": shape.intermediate,
                        "held_experts": shape.held,
                        "batch": batch,
                        "kernel": name,
                        "ms": 1e3 * min(t),
                        "ms_median": 1e3 * statistics.median(t),
                        "fp8_bytes": nbytes,
                        "hbm_fraction": nbytes / min(t) / gpu.bytes_per_s,
                        "speedup_of_triton_fp8": min(t) / fp8_s,
                        "rel_err_vs_bf16": err if name == "triton_fp8" else 0.0,
                    }
                )
            del runs
            torch.cuda.empty_cache()
    info = {
        "device": torch.cuda.get_device_name(device),
        "hbm_bytes_per_s": gpu.bytes_per_s,
        "roofline_source": source,
        "copy_bytes_per_s": copy_bw,
    }
    return rows, info


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'shape':8} {'batch':>5} {'kernel':11} {'ms':>9} {'hbm':>5} {'fp8 faster':>10}"]
    lines += [
        f"{r['shape']:8} {r['batch']:>5} {r['kernel']:11} {r['ms']:>9.4f} "
        f"{r['hbm_fraction']:>5.2f} {r['speedup_of_triton_fp8']:>9.2f}x"
        for r in rows
    ]
    return "\n".join(lines)


def run_fp8(args: argparse.Namespace) -> int:
    """`--fp8`: the rows on this process's CUDA GPU, written to `--out` (default
    benchmarks/moe_fp8_cuda.json); without CUDA, the reason."""
    out = table_stream(args.json)
    summary: dict[str, Any] = {"bench": "moe-fp8", "torch": torch.__version__}
    if not torch.cuda.is_available():
        print(NO_CUDA, file=out)
        summary.update({"rows": [], "skipped": NO_CUDA})
    else:
        rows, info = bench_rows(args.batch, args.repeats)
        summary.update({"rows": rows, "repeats": args.repeats, **info})
        print(table(rows), file=out)
        print(f"{info['device']}: HBM {info['hbm_bytes_per_s'] / 1e12:.2f} TB/s", file=out)
        Path(args.out or DEFAULT_OUT).write_text(json.dumps(summary, indent=1) + "\n")
    if args.json:
        print(json.dumps(summary))
    return 0

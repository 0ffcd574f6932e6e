"""`tpla bench moe`: one MoE layer's routed experts, the reference loop against grouped GEMMs
(`--fp8`: FP8 experts on CUDA, tools/bench/moe_fp8_gpu.py).

Times what `MoE.routed` runs for T tokens (batch 1, 16, 64 by default) with k experts each:
`loop` is the per-expert reference (common/model/experts.py `routed_experts`), `grouped` the
device-routed `grouped_mm` kernel, and on the CPU in fp32 `native` is the C++ kernel the
native decode backend calls (`small_gemm.moe_experts`, up to its row limit, where the rank
holds every expert). Shapes:

- `demo`: models/demo's experts (D 256, I 256, 8 experts, top-2), as one rank holds them at tp=1;
- `v3-tp8`: V3's expert shape cut 8 ways by columns (D 7168, I 2048 / 8 = 256), top-8 of 16
  experts (V3 has 256; 16 keep the weights a few hundred MB);
- `v3-ep8`: whole V3 experts (I 2048) as an expert-parallel rank holds them: 2 of 16, top-8,
  so about one in eight slots is this rank's.

Kernels alternate within each repeat (the same background load for each); `ms` is the
fastest repeat, `ms_median` the median. With `--json`, stdout carries only the JSON object
and the table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.model.expert_routing import route
from common.model.experts import grouped_experts, grouped_unsupported, routed_experts
from common.native import small_gemm
from tools.bench.moe_fp8_gpu import DEFAULT_OUT, run_fp8

BATCHES = (1, 16, 64)
FP8_BATCHES = (1, 32, 128, 4096)  # decode batches, and a prefill chunk's tokens


@dataclass(frozen=True)
class ExpertShape:
    name: str
    hidden: int
    intermediate: int  # of each held expert (its columns on this rank)
    held: int  # experts this rank holds: global experts 0 .. held - 1
    experts: int  # experts the router picks among
    top_k: int


SHAPES = {
    s.name: s
    for s in (
        ExpertShape("demo", 256, 256, 8, 8, 2),
        ExpertShape("v3-tp8", 7168, 256, 16, 16, 8),
        ExpertShape("v3-ep8", 7168, 2048, 2, 16, 8),
    )
}


def layer_inputs(
    shape: ExpertShape, batch: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """x, ids, weights, gate_up, down for one layer: each token's top-k distinct experts."""
    g = torch.Generator().manual_seed(seed)
    d, i = shape.hidden, shape.intermediate
    x = torch.randn(batch, d, generator=g)
    ids = torch.rand(batch, shape.experts, generator=g).topk(shape.top_k, dim=-1).indices
    weights = torch.rand(batch, shape.top_k, generator=g)
    gate_up = torch.randn(shape.held, 2 * i, d, generator=g) * d**-0.5
    down = torch.randn(shape.held, d, i, generator=g) * i**-0.5
    return (
        x.to(device, dtype),
        ids.to(device),
        weights.to(device),
        gate_up.to(device, dtype),
        down.to(device, dtype),
    )


def kernels(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    holds_all: bool,
) -> dict[str, Callable[[], torch.Tensor]]:
    """The kernels that run on these inputs, by name."""
    held = gate_up.shape[0]
    out: dict[str, Callable[[], torch.Tensor]] = {
        "loop": lambda: routed_experts(x, route(ids, weights, held), gate_up, down)
    }
    if grouped_unsupported(gate_up, down) is None:
        out["grouped"] = lambda: grouped_experts(x, route(ids, weights, held), gate_up, down)
    # The native backend runs its kernel only where a rank holds every expert (tp).
    if holds_all and small_gemm.moe_experts(x, ids, weights, gate_up, down) is not None:
        native = small_gemm.moe_experts
        out["native"] = lambda: native(x, ids, weights, gate_up, down)  # type: ignore[return-value]
    return out


def time_row(
    shape: ExpertShape, batch: int, dtype: torch.dtype, device: torch.device, repeats: int
) -> list[dict[str, Any]]:
    inputs = layer_inputs(shape, batch, dtype, device)
    runs = kernels(*inputs, holds_all=shape.held == shape.experts)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        want = runs["loop"]().float()
        for name, run in runs.items():
            got = run().float()  # also the warm-up
            err = float((got - want).abs().max()) if want.numel() else 0.0
            if err > 5e-2 * max(float(want.abs().max()), 1.0):
                raise AssertionError(f"{shape.name} b={batch}: {name} differs from loop by {err}")
        for _ in range(repeats):
            for name, run in runs.items():
                sync()
                t0 = time.perf_counter()
                run()
                sync()
                times[name].append(time.perf_counter() - t0)
    loop_ms = min(times["loop"]) * 1e3
    return [
        {
            "shape": shape.name,
            "hidden": shape.hidden,
            "intermediate": shape.intermediate,
            "held_experts": shape.held,
            "experts": shape.experts,
            "top_k": shape.top_k,
            "batch": batch,
            "kernel": name,
            "ms": min(t) * 1e3,
            "ms_median": statistics.median(t) * 1e3,
            "speedup_vs_loop": loop_ms / (min(t) * 1e3),
        }
        for name, t in times.items()
    ]


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'shape':<8} {'batch':>5} {'kernel':<8} {'ms':>9} {'median':>9} {'vs loop':>8}"]
    lines += [
        f"{r['shape']:<8} {r['batch']:>5} {r['kernel']:<8} {r['ms']:>9.3f} "
        f"{r['ms_median']:>9.3f} {r['speedup_vs_loop']:>7.2f}x"
        for r in rows
    ]
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    rows = [
        row
        for name in args.shapes
        for batch in args.batch
        for row in time_row(SHAPES[name], batch, dtype, device, args.repeats)
    ]
    result = {
        "bench": "moe",
        "device": str(device),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }
    print(format_rows(rows), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0


def add_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser(
        "moe", help="a MoE layer's routed experts: reference loop vs grouped (--fp8: on CUDA)"
    )
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--batch", nargs="+", type=int, default=None, help=f"default {BATCHES}")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", action="store_true", help="stdout: only the JSON result")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="FP8 experts on CUDA at V3's shapes: the Triton FP8 grouped GEMM against "
        f"dequantize-then-GEMM (tools/bench/moe_fp8_gpu.py; batches {FP8_BATCHES})",
    )
    p.add_argument("--out", default=None, help=f"--fp8: the JSON file (default {DEFAULT_OUT})")
    p.set_defaults(func=_dispatch)


def _dispatch(args: argparse.Namespace) -> int:
    if args.fp8:
        args.batch = args.batch or list(FP8_BATCHES)
        return run_fp8(args)
    args.batch = args.batch or list(BATCHES)
    return _run(args)

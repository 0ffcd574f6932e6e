"""`tpla bench roofline`: this machine's fp32 matmul FLOP/s and streaming read bandwidth.

These are the denominators of every other attention bench: a kernel's roofline bound is
`max(bytes / bandwidth, flops / flop_rate)`. Both are measured in the calling process with
its current torch thread count, best of N, because other work on a shared machine only ever
makes a run slower.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch


@dataclass(frozen=True)
class Roofline:
    flops_per_s: float  # fp32 GEMM, best of N
    bytes_per_s: float  # streaming read (sum over a large tensor), best of N
    threads: int
    gemm_size: int
    stream_mb: float

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (flop / byte) where a kernel turns from memory- to compute-bound."""
        return self.flops_per_s / self.bytes_per_s

    def bound_seconds(self, flops: float, nbytes: float) -> float:
        return max(nbytes / self.bytes_per_s, flops / self.flops_per_s)

    def best(self, other: Roofline) -> Roofline:
        """The higher of two measurements of each peak: a busy moment only lowers them, so
        benches measure before and after their rows and keep the best (the strictest bound)."""
        return replace(
            self,
            flops_per_s=max(self.flops_per_s, other.flops_per_s),
            bytes_per_s=max(self.bytes_per_s, other.bytes_per_s),
        )


def best_seconds(fn: Callable[[], object], repeats: int, min_seconds: float = 0.0) -> float:
    """Fastest of `repeats` calls (after one warm-up), repeating until `min_seconds` passed."""
    fn()
    best = float("inf")
    start = time.perf_counter()
    done = 0
    while done < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        done += 1
    return best


def measure_roofline(gemm_size: int = 2048, stream_mb: float = 512.0, repeats: int = 5) -> Roofline:
    """Measure peak-ish fp32 GEMM FLOP/s and read bandwidth now, in this process."""
    with torch.inference_mode():
        g = torch.Generator().manual_seed(0)
        a = torch.randn(gemm_size, gemm_size, generator=g)
        b = torch.randn(gemm_size, gemm_size, generator=g)
        out = torch.empty(gemm_size, gemm_size)
        gemm = best_seconds(lambda: torch.mm(a, b, out=out), repeats)
        # Far larger than any cache, so every pass streams from DRAM.
        big = torch.ones(int(stream_mb * 2**20) // 4)
        stream = best_seconds(lambda: big.sum(), repeats)
        nbytes = big.numel() * 4
    return Roofline(
        flops_per_s=2 * gemm_size**3 / gemm,
        bytes_per_s=nbytes / stream,
        threads=torch.get_num_threads(),
        gemm_size=gemm_size,
        stream_mb=stream_mb,
    )


def roofline_record(roof: Roofline) -> dict[str, float | int]:
    return {**asdict(roof), "ridge_flop_per_byte": roof.ridge}


def _run(args: argparse.Namespace) -> int:
    roof = measure_roofline(args.gemm_size, args.stream_mb, args.repeats)
    if args.json:
        print(json.dumps(roofline_record(roof)))
    else:
        print(
            f"threads {roof.threads}: fp32 GEMM {roof.flops_per_s / 1e9:.1f} GFLOP/s "
            f"({roof.gemm_size}^3), read {roof.bytes_per_s / 1e9:.2f} GB/s "
            f"({roof.stream_mb:.0f} MB), ridge {roof.ridge:.1f} flop/byte"
        )
    return 0


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("roofline", help="this machine's fp32 GEMM FLOP/s and read bandwidth")
    p.add_argument("--gemm-size", type=int, default=2048)
    p.add_argument("--stream-mb", type=float, default=512.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(func=_run)

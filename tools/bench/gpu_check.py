"""`tpla bench gpu` (`make gpu-check`): the one call to make when a GPU is lent, in under five
minutes on one GPU; each part's result goes to benchmarks/<part>_cuda.json and a summary to
benchmarks/gpu_check_cuda.json.

Parts, each a child process with its own time limit:
- `gpu-tests`: the tests marked `gpu` (`make test-gpu`'s run);
- `decode-attn`: the Triton decode attention at 4K / 32K / 128K tokens on DeepSeek-V3's shape
  against the HBM roofline (`tpla bench decode-attn --kernel triton`);
- `decode-step`: the engine's step with CUDA graphs on and off, batch 1 / 32 / 128, on a
  V3-shaped two-layer model with random FP8 weights (V3's attention, a dense layer and a MoE
  layer of 2,048-wide experts, top 8; 32 routed experts and 1/8 of the vocabulary: what one
  rank of a tp = 8 V3 group holds of a layer's experts, 1.4 billion FP8 values, and of the
  head), written first to a temporary directory; it reports the steps that ran eager, which
  must be 0;
- `fp8-experts`: V3's FP8 routed experts on the Triton FP8 grouped GEMM against
  dequantize-then-GEMM (`tpla bench moe --fp8`);
- `leader-step`: the decode leader's plan per step (`tpla bench leader-step`), on the lent
  machine's CPU.

Without a GPU every part that needs one says so and is skipped; the rest runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.parallel import BASELINE
from tools.bench.output import table_stream
from tools.bench.v3_shapes import v3_shaped

# One rank's share of a DeepSeek-V3 layer, two layers (a dense one, then a MoE one).
V3_RANK_CONFIG = v3_shaped(
    vocab_size=16160,  # V3's 129,280 over 8 ranks
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=2,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_routed_experts=32,  # V3's 256 over 8 ranks: the experts' bytes one rank reads
    max_position_embeddings=8192,
)
STEP_BATCHES = ("1", "32", "128")
STEP_CONTEXT = 4096
ATTN_CONTEXTS = ("4096", "32768", "131072")
NO_GPU = "no CUDA device visible: this part needs one"


@dataclass
class Part:
    """One part of the check: its result, as the summary keeps it."""

    name: str
    status: str = "pending"  # ok | failed | skipped | timeout
    seconds: float = 0.0
    detail: str = ""
    output: str = ""  # the file written, relative to the output directory
    highlights: dict[str, Any] = field(default_factory=dict)


def _tpla(*args: str) -> list[str]:
    return [sys.executable, "-m", "tools.cli", *args]


def _run(part: Part, argv: list[str], timeout: float, out: Path | None) -> str | None:
    """Run one part's child; its stdout (and `out`, its JSON) when it ended well."""
    t0 = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        part.status, part.detail = "timeout", f"over its {timeout:.0f} s"
        return None
    finally:
        part.seconds = round(time.monotonic() - t0, 1)
    if done.returncode != 0:
        lines = (done.stdout + done.stderr).strip().splitlines()
        part.status = "failed"
        part.detail = lines[-1] if lines else f"exit code {done.returncode}"
        return None
    part.status = "ok"
    if out is not None:
        out.write_text(done.stdout.strip().splitlines()[-1] + "\n")
        part.output = out.name
    return done.stdout


def gpu_tests(part: Part, out_dir: Path, gpu: bool) -> None:
    if not gpu:
        part.status, part.detail = "skipped", NO_GPU
        return
    # pytest's marker expression as its own word: `-m gpu` would read as a module to run.
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-mgpu", "tests"]
    stdout = _run(part, argv, 150, None)
    if stdout:
        part.detail = stdout.strip().splitlines()[-1]  # pytest's summary line


def decode_attn(part: Part, out_dir: Path, gpu: bool) -> None:
    if not gpu:
        part.status, part.detail = "skipped", NO_GPU
        return
    argv = _tpla(
        "bench", "decode-attn", "--kernel", "triton", "--shapes", "deepseek-v3",
        "--contexts", *ATTN_CONTEXTS, "--rounds", "2", "--json",
    )  # fmt: skip
    out = out_dir / "decode_attn_check_cuda.json"
    if _run(part, argv, 60, out) is not None:
        rows = json.loads(out.read_text())["rows"]
        part.highlights = {
            f"{r['mode']} ctx {r['context']} b {r['batch']}": round(r["roofline_fraction"], 3)
            for r in rows
        }


def decode_step(part: Part, out_dir: Path, gpu: bool) -> None:
    if not gpu:
        part.status, part.detail = "skipped", NO_GPU
        return
    from tools.bench.loading import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="tpla-v3-") as tmp:
        model = Path(tmp) / "v3-rank"
        write_checkpoint(model, 2**30, "bfloat16", 2, V3_RANK_CONFIG, fp8_block=128)
        argv = _tpla(
            "bench", "decode-step", "--model", str(model), "--device", "cuda", "--tp", "1",
            "--layouts", BASELINE.value, "--batch", *STEP_BATCHES, "--context", str(STEP_CONTEXT),
            "--steps", "20", "--reparam", "none", "--kernel", "triton",
            "--cuda-graphs", "on", "off", "--json",
        )  # fmt: skip
        out = out_dir / "decode_step_v3_cuda.json"
        if _run(part, argv, 150, out) is None:
            return
    rows = json.loads(out.read_text())["rows"]
    layers = V3_RANK_CONFIG["num_hidden_layers"]
    for row in rows:
        graphs = "graphs" if row["cuda_graphs"] else "eager"
        part.highlights[f"batch {row['batch']} {graphs} ms/layer"] = round(
            row["median_ms"] / layers, 3
        )
        if row["cuda_graphs"]:
            part.highlights[f"batch {row['batch']} eager steps"] = row["eager_steps"]


def fp8_experts(part: Part, out_dir: Path, gpu: bool) -> None:
    if not gpu:
        part.status, part.detail = "skipped", NO_GPU
        return
    out = out_dir / "moe_fp8_cuda.json"
    argv = _tpla("bench", "moe", "--fp8", "--repeats", "5", "--out", str(out), "--json")
    _run(part, argv, 90, out)


def leader_step(part: Part, out_dir: Path, gpu: bool, quick: bool = False) -> None:
    grid = ("--batch", "1", "256", "--context", "1024") if quick else ()
    argv = _tpla("bench", "leader-step", *grid, "--json")
    out = out_dir / ("leader_step_cuda.json" if gpu else "leader_step_check.json")
    if _run(part, argv, 90, out) is not None:
        rows = json.loads(out.read_text())["rows"]
        worst = max(rows, key=lambda r: r["leader_ms"])
        part.highlights = {
            "leader ms (worst row)": round(worst["leader_ms"], 3),
            "bytes/step (worst row)": max(r["bytes_per_step"] for r in rows),
            "rank apply ms (worst row)": round(max(r["rank_apply_ms"] for r in rows), 3),
        }


PARTS: dict[str, Callable[[Part, Path, bool], None]] = {
    "gpu-tests": gpu_tests,
    "decode-attn": decode_attn,
    "decode-step": decode_step,
    "fp8-experts": fp8_experts,
    "leader-step": leader_step,
}


def run_check(names: list[str], out_dir: Path, gpu: bool, quick: bool = False) -> list[Part]:
    """The parts named, in order, with their results in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    for name in names:
        part = Part(name)
        if name == "leader-step":
            leader_step(part, out_dir, gpu, quick)
        else:
            PARTS[name](part, out_dir, gpu)
        parts.append(part)
    return parts


def cmd_gpu(args: argparse.Namespace) -> int:
    import torch

    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if gpu else "none"
    out_dir = Path(args.out_dir)
    t0 = time.monotonic()
    parts = run_check(args.parts, out_dir, gpu, args.quick)
    summary = {
        "device": device,
        "seconds": round(time.monotonic() - t0, 1),
        "parts": [asdict(p) for p in parts],
    }
    (out_dir / ("gpu_check_cuda.json" if gpu else "gpu_check.json")).write_text(
        json.dumps(summary, indent=1) + "\n"
    )
    out = table_stream(args.json)
    print(f"GPU check on {device}: {summary['seconds']} s", file=out)
    for p in parts:
        print(f"  {p.name:<12} {p.status:<8} {p.seconds:>6} s  {p.detail}", file=out)
        for key, value in p.highlights.items():
            print(f"      {key}: {value}", file=out)
    if args.json:
        print(json.dumps(summary))
    failed = [p for p in parts if p.status in ("failed", "timeout")]
    return 1 if failed else 0


def add_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser("gpu", help="the GPU check: GPU tests and GPU benchmarks (make gpu-check)")
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    p.add_argument("--out-dir", default="benchmarks", help="where the JSON results go")
    p.add_argument("--quick", action="store_true", help="a small leader-step grid (tests)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gpu)

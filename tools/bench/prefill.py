"""`tpla bench prefill`: TTFT proxy of one prefill device, head-parallel MLA vs TPLA-mode.

Per device at p = 2 ranks, for one prompt of T tokens:
  * "TPLA (sep.)" / MLA prefill: ordinary head-parallel MLA, H/p heads over the full latent
    d_c (the latent is sliced for decode only afterwards, DESIGN §1 PD separation);
  * TPLA-mode prefill: every rank runs all H heads on its d_c/p latent slice (the partial
    outputs are then summed across ranks; beta folds into the queries).

Timed region: the project's prefill attention code path, `MLAttention.expanded` with each
selected attention backend (per-head K/V up-projection from the latent with kv_b_proj, then
causal attention: `sdpa` is torch SDPA, the reference; `native` the C++ kernel the prefill
service runs on CPU) from q_nope/q_pe and n/k_pe to per-head values. Query/latent
projections, o_proj, the FFN and the all-reduce are excluded: they are the same dense work
in both layouts except o_proj and the all-reduce, which TPLA-mode adds. All calls of one
shape and prompt (both layouts, every backend) alternate, so they see the same background
load, and the fastest of the repeats is reported.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.model.args import ModelConfig
from common.model.mla import MLAttention
from common.model.prefill_attention import (
    PrefillAttention,
    make_prefill_attention,
    select_prefill_attention,
)
from common.parallel import BASELINE
from tools.bench.attn_work import AttnShape, per_device, shapes
from tools.bench.output import table_stream

RANKS = 2


@dataclass(frozen=True)
class PrefillWork:
    heads: int
    latent: int  # latent columns on this device
    d_r: int
    d_n: int
    d_v: int
    tokens: int

    def flops(self) -> float:
        """kv_b up-projection, then causal QK^T and PV over the lower triangle (T(T+1)/2)."""
        h, t = self.heads, self.tokens
        up = 2 * t * self.latent * h * (self.d_n + self.d_v)
        pairs = t * (t + 1) / 2
        return float(up + 2 * h * pairs * (self.d_n + self.d_r) + 2 * h * pairs * self.d_v)


def prefill_work(shape: AttnShape, mode: str, tokens: int) -> PrefillWork:
    # "mla-sep" (the paper's TPLA (sep.)) is head-parallel MLA prefill.
    heads, latent = per_device(shape, BASELINE.value if mode == "mla-sep" else mode, RANKS)
    return PrefillWork(heads, latent, shape.d_r, shape.d_n, shape.d_v, tokens)


def _attention(work: PrefillWork) -> MLAttention:
    """An MLA layer with this device's heads and latent width (hidden size is irrelevant)."""
    cfg = ModelConfig(
        model_type="deepseek_v3",
        vocab_size=16,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=work.heads,
        kv_lora_rank=work.latent,
        qk_nope_head_dim=work.d_n,
        qk_rope_head_dim=work.d_r,
        v_head_dim=work.d_v,
    )
    attn = MLAttention(cfg)
    torch.nn.init.normal_(attn.kv_b_proj.weight, std=0.05)
    return attn


def prepare_prefill(work: PrefillWork, backend: PrefillAttention) -> Callable[[], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    attn = _attention(work)
    t, h = work.tokens, work.heads
    q_nope = torch.randn(t, h, work.d_n, generator=g)
    q_pe = torch.randn(t, h, work.d_r, generator=g)
    n = torch.randn(t, work.latent, generator=g)
    k_pe = torch.randn(t, work.d_r, generator=g)

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return attn.expanded(q_nope, q_pe, n, k_pe, [0, t], backend)

    return run


def time_alternating(runs: dict[tuple[str, str], Callable[[], object]], repeats: int) -> dict:
    """Fastest seconds per run; the runs' calls alternate so all see the same load."""
    best = dict.fromkeys(runs, float("inf"))
    for run in runs.values():
        run()  # warm-up
    for _ in range(repeats):
        for key, run in runs.items():
            t0 = time.perf_counter()
            run()
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


def run_bench(
    prompts: list[int],
    repeats: int,
    demo_dir: str = "models/demo",
    names: list[str] | None = None,
    backends: tuple[str, ...] = ("sdpa",),
) -> list[dict[str, object]]:
    # Each as the rule takes it by name for the CPU in fp32 (an error if it cannot run here).
    chosen = {
        name: make_prefill_attention(select_prefill_attention(name, "cpu", torch.float32).kernel)
        for name in backends
    }
    rows: list[dict[str, object]] = []
    for shape in shapes(demo_dir):
        if names and shape.name not in names:
            continue
        for tokens in prompts:
            works = {m: prefill_work(shape, m, tokens) for m in ("mla-sep", "tpla")}
            runs = {
                (b, mode): prepare_prefill(work, backend)
                for b, backend in chosen.items()
                for mode, work in works.items()
            }
            best = time_alternating(runs, repeats)
            cell: dict[tuple[str, str], dict[str, object]] = {}
            for (b, mode), seconds in best.items():
                work = works[mode]
                row: dict[str, object] = {
                    "shape": shape.name,
                    "mode": mode,
                    "backend": b,
                    "prompt": tokens,
                    "heads_per_device": work.heads,
                    "latent_width": work.latent,
                    "ms": 1e3 * seconds,
                    "flops": work.flops(),
                    "gflops_per_s": work.flops() / seconds / 1e9,
                }
                if b != "sdpa" and "sdpa" in chosen:
                    row["speedup_vs_sdpa"] = best[("sdpa", mode)] / seconds
                cell[(b, mode)] = row
                rows.append(row)
            for b in chosen:
                tpla, mla = cell[(b, "tpla")], cell[(b, "mla-sep")]
                tpla["sep_speedup"] = float(tpla["ms"]) / float(mla["ms"])
                tpla["predicted_sep_speedup"] = float(tpla["flops"]) / float(mla["flops"])
    return rows


def _run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    rows = run_bench(args.prompt, args.repeats, args.demo, args.shapes, tuple(args.backends))
    out = table_stream(args.json)
    for r in rows:
        extra = f"  sep speedup {r['sep_speedup']:.2f}x" if "sep_speedup" in r else ""
        if "speedup_vs_sdpa" in r:
            extra += f"  {r['speedup_vs_sdpa']:.2f}x sdpa"
        print(
            f"{r['shape']:17} {r['mode']:8} {r['backend']:6} T={r['prompt']:>5} "
            f"{r['ms']:>10.2f} ms {r['gflops_per_s']:>6.1f} GFLOP/s{extra}",
            file=out,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "rows": rows,
                    "ranks": RANKS,
                    "threads": torch.get_num_threads(),
                    "seconds": time.perf_counter() - start,
                }
            )
        )
    return 0


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("prefill", help="prefill attention per device: MLA (sep.) vs TPLA-mode")
    p.add_argument("--prompt", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--shapes", nargs="+", help="subset of deepseek-v3 deepseek-v2-lite demo")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--backends",
        nargs="+",
        default=["sdpa", "native"],
        choices=("sdpa", "native"),
        help="prefill attention backends, side by side (sdpa is the reference)",
    )
    p.add_argument("--demo", default="models/demo", help="demo model dir for its shapes")
    p.add_argument("--json", action="store_true", help="last stdout line is the JSON result")
    p.set_defaults(func=_run)

"""`tpla bench capacity`: cached tokens per rank under a fixed KV memory budget.

For each model shape and layout, a real `PagedLatentCache` is allocated from the budget with
`CacheLayout.blocks_for_budget` (what a decode rank does at start-up), and its capacity is
blocks x block_size tokens. TPLA at r latent groups caches d_c / r + d_r values per token per
layer against MLA-TP's d_c + d_r, so the expected gain is (d_c + d_r) / (d_c / r + d_r); the
measured ratio differs from it only by whole-block rounding.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from common.kv.paged_cache import CacheLayout, PagedLatentCache
from common.model.args import ModelConfig
from common.parallel import ParallelConfig
from tools.bench.output import table_stream

BLOCK_SIZE = 16


@dataclass(frozen=True)
class CacheShape:
    name: str
    num_layers: int
    d_c: int
    d_r: int
    dtype: torch.dtype


def cache_shapes(demo_dir: str = "models/demo") -> list[CacheShape]:
    demo = ModelConfig.from_dir(demo_dir)
    return [
        # The demo model as the engine serves it (fp32); V3 as served in bf16.
        CacheShape(
            "demo", demo.num_hidden_layers, demo.kv_lora_rank, demo.qk_rope_head_dim, torch.float32
        ),
        CacheShape("deepseek-v3", 61, 512, 64, torch.bfloat16),
    ]


def expected_ratio(d_c: int, d_r: int, r: int) -> float:
    return (d_c + d_r) / (d_c / r + d_r)


def measure_capacity(
    shape: CacheShape, budget_bytes: int, groups: tuple[int, ...] = (1, 2, 4)
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    baseline = 0
    for r in groups:
        layout = CacheLayout(shape.num_layers, shape.d_c // r, shape.d_r, BLOCK_SIZE, shape.dtype)
        blocks = layout.blocks_for_budget(budget_bytes)
        cache = PagedLatentCache(layout, blocks)  # really allocated, as a rank does
        tokens = cache.num_blocks * BLOCK_SIZE
        nbytes = cache.nbytes
        del cache
        if r == 1:
            baseline = tokens
        rows.append(
            {
                "shape": shape.name,
                "mode": ParallelConfig(r, r).name,
                "latent_groups": r,
                "budget_bytes": budget_bytes,
                "allocated_bytes": nbytes,
                "bytes_per_token": layout.bytes_per_token_per_layer * shape.num_layers,
                "blocks": blocks,
                "tokens_per_rank": tokens,
                "ratio_vs_mla_tp": tokens / baseline,
                "expected_ratio": expected_ratio(shape.d_c, shape.d_r, r),
            }
        )
    return rows


def _run(args: argparse.Namespace) -> int:
    budget = int(args.budget_mb * 2**20)
    rows = [row for s in cache_shapes(args.demo) for row in measure_capacity(s, budget)]
    out = table_stream(args.json)
    for r in rows:
        print(
            f"{r['shape']:12} {r['mode']:6} r={r['latent_groups']} "
            f"{r['tokens_per_rank']:>10,} tokens/rank  {r['ratio_vs_mla_tp']:.3f}x "
            f"(expected {r['expected_ratio']:.3f}x)",
            file=out,
        )
    if args.json:
        print(json.dumps({"rows": rows, "budget_mb": args.budget_mb, "block_size": BLOCK_SIZE}))
    return 0


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("capacity", help="cached tokens per rank under a fixed KV budget")
    p.add_argument("--budget-mb", type=float, default=1024.0, help="KV budget per rank")
    p.add_argument("--demo", default="models/demo", help="demo model dir for its shapes")
    p.add_argument("--json", action="store_true", help="last stdout line is the JSON result")
    p.set_defaults(func=_run)

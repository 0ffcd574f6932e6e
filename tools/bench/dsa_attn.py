"""`tpla bench decode-attn --dsa`: one decode rank's DeepSeek Sparse Attention for one layer,
at DeepSeek-V3.2's per-device shapes in a tp = 2 group, split into its two parts:

* indexer: the rank's indexer keys of the rows' histories read from its key pool, scored
  (64 heads x 128 dims, ReLU, weighted sum), the top 2048 selected under the tie rule and
  turned into cache slots (SP: the rank's own tokens, its candidates and the threshold;
  the all-gather between ranks is not timed, a group of one);
* sparse attention: the selected rows gathered and attended (MLA-TP: 64 heads over the full
  latent; TPLA r = 2: 128 heads over half of it; SP: 128 heads over the full latent, the
  partial a log-sum-exp merge takes);

beside the dense attention the same context costs the rank (what a step within index_topk
runs). The functions are the decode rank's (rank/sparse_rank.py, rank/cache_split.py,
common/model/topk.py); queries and caches are random (times do not depend on values). The
fastest of `--rounds` calls per row; the row's three parts are timed in turn.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from common.kv.paged_cache import CacheLayout, CacheReads, PagedLatentCache
from common.kv.slots import token_slots
from common.model.indexer import index_scores
from common.model.sp import partial_attention
from common.model.topk import candidates, mask_positions, threshold, topk_mask, within
from common.model.tpla import fused_slice_attention
from common.parallel import ParallelConfig, span
from tools.bench.output import table_stream

BLOCK, TOPK, INDEX_HEADS, D_I = 64, 2048, 64, 128
D_C, D_R, D_N, D_V, HEADS = 512, 64, 128, 128, 128  # V3.2
TP = 2
# (name, layout): MLA-TP, TPLA at r = tp, SP, as plans set them side by side.
LAYOUTS = [(mode.value, par) for mode, par in ParallelConfig.compared(TP, (TP,))]


def _prepare(par: ParallelConfig, context: int, batch: int) -> dict[str, Callable[[], object]]:
    # A rank attends with its head group's heads over its latent columns; in SP with every
    # head over its own tokens (the queries are gathered).
    every_token = par.caches_every_token
    heads = span(par.heads(0, HEADS)) if every_token else HEADS
    width = span(par.latent_columns(0, D_C))
    g = torch.Generator().manual_seed(0)
    tokens = par.local_length(context, 0)
    per_seq = -(-tokens // BLOCK)
    pool = PagedLatentCache(CacheLayout(1, width, D_R, BLOCK), batch * per_seq + 1)
    keys = PagedLatentCache(CacheLayout(1, D_I, 0, BLOCK), batch * per_seq + 1)
    pool.kv.normal_(generator=g)
    keys.kv.normal_(generator=g)
    tables = torch.randperm(batch * per_seq, generator=g).view(batch, per_seq)
    lengths = torch.full((batch,), tokens)
    reads = (
        CacheReads.blocks(tables, lengths, BLOCK)
        if every_token
        else CacheReads.tokens(tables, lengths, BLOCK)
    )
    q_i = torch.randn(batch, INDEX_HEADS, D_I, generator=g)
    w_i = torch.randn(batch, INDEX_HEADS, generator=g)
    q_nope = torch.randn(batch, heads, D_N, generator=g)
    q_pe = torch.randn(batch, heads, D_R, generator=g)
    q_lat = torch.randn(batch, heads, width, generator=g)
    w_uk = torch.randn(heads, D_N, width, generator=g) * 0.05
    w_uv = torch.randn(heads, D_V, width, generator=g) * 0.05
    scale = (D_N + D_R) ** -0.5
    picked: dict[str, torch.Tensor] = {}

    def indexer() -> None:
        if not every_token:
            assert reads.slots is not None and reads.valid is not None
            rows, valid = keys.gather(0, reads.slots)[0], reads.valid
        else:
            rows = keys.rows(0, reads.block_ids).read(0, per_seq * BLOCK)
            valid = torch.arange(rows.shape[1])[None] < lengths[:, None]
        scores = index_scores(q_i, w_i, rows, D_I**-0.5)
        if not every_token:  # this rank's offer and the threshold over a group of one
            at = torch.arange(scores.shape[1]).expand_as(scores)
            best, pos = candidates(scores, valid, at, TOPK)
            mask = within(scores, at, valid, threshold(best, pos, TOPK))
        else:
            mask = topk_mask(scores, valid, TOPK)
        local, count = mask_positions(mask, TOPK)
        picked["slots"], picked["count"] = token_slots(reads.block_ids, local, BLOCK), count

    def sparse() -> torch.Tensor:
        slots, count = picked["slots"], picked["count"]
        if not every_token:
            n, k_pe = pool.gather(0, slots)
            valid = torch.arange(TOPK)[None] < count[:, None]
            return partial_attention(q_lat, q_pe, n, k_pe, valid, scale)[0]
        rows = pool.kv[0][slots]
        read = lambda t0, t1: rows[:, t0:t1]  # noqa: E731
        return fused_slice_attention(q_nope, q_pe, read, TOPK, TOPK, count, w_uk, w_uv, scale, 1.0)

    def dense() -> torch.Tensor:
        if not every_token:
            assert reads.slots is not None and reads.valid is not None
            n, k_pe = pool.gather(0, reads.slots)
            return partial_attention(q_lat, q_pe, n, k_pe, reads.valid, scale)[0]
        rows = pool.rows(0, reads.block_ids)
        chunk = pool.chunk_tokens(batch)
        return fused_slice_attention(
            q_nope, q_pe, rows.read, rows.total, chunk, lengths, w_uk, w_uv, scale, 1.0
        )

    return {"indexer": indexer, "sparse_attention": sparse, "dense_attention": dense}


def _fastest(fn: Callable[[], object], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def run_dsa(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for context in args.contexts:
            for layout, par in LAYOUTS:
                parts = _prepare(par, context, args.batch)
                parts["indexer"]()  # warm-up, and the selection `sparse` reads
                row: dict[str, Any] = {"layout": layout, "context": context, "batch": args.batch}
                for name, fn in parts.items():
                    row[f"{name}_ms"] = _fastest(fn, args.rounds)
                row["sparse_step_ms"] = row["indexer_ms"] + row["sparse_attention_ms"]
                row["indexer_share"] = row["indexer_ms"] / row["sparse_step_ms"]
                row["dense_over_sparse"] = row["dense_attention_ms"] / row["sparse_step_ms"]
                rows.append(row)
    out = table_stream(args.json)
    print(
        f"{'layout':7} {'context':>8} {'B':>3} {'indexer ms':>11} {'sparse attn ms':>15} "
        f"{'indexer share':>14} {'dense attn ms':>14} {'dense / sparse':>15}",
        file=out,
    )
    for r in rows:
        print(
            f"{r['layout']:7} {r['context']:>8} {r['batch']:>3} {r['indexer_ms']:>11.2f} "
            f"{r['sparse_attention_ms']:>15.2f} {r['indexer_share']:>13.0%} "
            f"{r['dense_attention_ms']:>14.2f} {r['dense_over_sparse']:>14.2f}x",
            file=out,
        )
    if args.json:
        shapes = {"block": BLOCK, "index_topk": TOPK, "index_heads": INDEX_HEADS, "d_i": D_I}
        print(json.dumps({"rows": rows, "shapes": shapes, "rounds": args.rounds}))
    return 0

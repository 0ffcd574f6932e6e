"""`tpla plan`: what one decode rank holds, and how much context then fits, per layout; what
one prefill rank holds, and whether it fits.

Pure arithmetic over `ModelConfig` (no torch, no I/O). What a rank holds per layout, its
weights tensor by tensor and its cache bytes per token, is rank_memory.py; this file fits
that to a card and the engine's paged pool (`CacheLayout.blocks_for_budget`, `RankPools`).
The same tp ranks in three layouts:

- mla-tp: heads split tp ways; every rank caches the full latent (d_c + d_r) of every token.
- tpla:   r latent groups x tp/r head groups; a rank caches d_c/r latent columns + d_r.
- sp:     heads split as in mla-tp; tokens cached at full width in chunks round-robin over
          the ranks, so a rank holds ~1/tp of each sequence.

"Tokens" are context tokens of the group's sequences; one rank's memory bounds them (all
ranks are alike). An SP rank stores only its chunks, so a context token costs it (d_c + d_r)
/ tp on average and its pool backs tp x the tokens it stores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from common.model.args import ModelConfig
from common.parallel import MoeParallel, ParallelConfig, RmsNormMode, layout_label
from common.tpla.rank_memory import (
    DTYPE_BYTES,
    WEIGHT_DTYPES,
    PlanError,
    kv_bytes_per_stored_token,
    prefill_rank_tensors,
    rank_tensors,
    weight_bytes,
)

GIB = 2**30
# Like vLLM's default gpu_memory_utilization=0.9: activations of a decode batch, logits,
# NCCL and allocator slack grow with the card; the floor covers the CUDA context (~0.5-1 GiB)
# plus NCCL buffers on small cards.
RESERVE_FRACTION = 0.10
RESERVE_FLOOR_BYTES = 2 * GIB


@dataclass(frozen=True)
class Checkpoint:
    """What the planner reads from an HF `config.json`: the architecture and two facts
    `ModelConfig` leaves out."""

    config: ModelConfig
    quant_method: str | None  # "fp8" for DeepSeek-V3's published checkpoint
    fp8_block: tuple[int, int]  # its weight_block_size
    mtp_layers: int  # num_nextn_predict_layers: loaded only when speculation is `mtp`


def checkpoint_from_hf_dict(raw: dict[str, Any]) -> Checkpoint:
    """Parse a config dict, quantized or not (planning needs no weights; `--weight-dtype`
    decides the bytes: the loader dequantizes FP8 checkpoints to the serving dtype)."""
    raw = dict(raw)
    quant = raw.pop("quantization_config", None) or {}
    block = quant.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise PlanError(f"quantization_config.weight_block_size {block!r} is not [rows, cols]")
    return Checkpoint(
        config=ModelConfig.from_hf_dict(raw),
        quant_method=quant.get("quant_method"),
        fp8_block=(block[0], block[1]),
        mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
    )


def default_reserve_bytes(gpu_mem_bytes: int) -> int:
    return max(RESERVE_FLOOR_BYTES, math.ceil(RESERVE_FRACTION * gpu_mem_bytes))


@dataclass(frozen=True)
class Hardware:
    """One decode group: `gpus_per_group` GPUs (= tp ranks) of `gpu_mem_bytes` each."""

    gpu_mem_bytes: int
    gpus_per_group: int
    reserve_bytes: int | None = None  # per GPU, outside weights and KV; None: the default

    def __post_init__(self) -> None:
        if self.gpu_mem_bytes <= 0 or self.gpus_per_group < 1:
            raise PlanError("GPU memory and GPUs per group must be positive")
        if self.reserve_bytes is not None and self.reserve_bytes < 0:
            raise PlanError("the memory reserve cannot be negative")

    @property
    def reserve(self) -> int:
        if self.reserve_bytes is None:
            return default_reserve_bytes(self.gpu_mem_bytes)
        return self.reserve_bytes


@dataclass(frozen=True)
class PlanRequest:
    hardware: Hardware
    latent_groups: tuple[int, ...] = (2,)  # TPLA rows; the first is the layout `fits` is about
    context: int = 32768  # tokens a sequence reserves (prompt + max_tokens, as the scheduler)
    kv_dtype: str = "bfloat16"
    weight_dtype: str = "bfloat16"
    rmsnorm: RmsNormMode = RmsNormMode.EXACT
    block_size: int = 16
    chunk_size: int = 256
    fp8_block: tuple[int, int] = (128, 128)
    moe: MoeParallel = MoeParallel.TP  # routed experts: a slice of each, or whole ones (ep)
    prefill_gpus: int = 1  # ranks of one prefill group (TPLA_PREFILL_TP), on the same cards
    mtp_layers: int = 0  # MTP modules loaded (speculation `mtp`): weights and cache counted
    index_cache_dtype: str = "model"  # DSA's indexer keys in the KV pools: model | fp8

    def __post_init__(self) -> None:
        if self.prefill_gpus < 1:
            raise PlanError("a prefill group needs at least one GPU")
        if self.mtp_layers < 0:
            raise PlanError("the MTP layer count cannot be negative")
        if not self.latent_groups:
            raise PlanError("give at least one latent group count")
        if self.context < 1 or self.block_size < 1 or self.chunk_size < 1:
            raise PlanError("context, block size and chunk size must be positive")
        if self.kv_dtype not in DTYPE_BYTES:
            raise PlanError(
                f"unknown KV dtype {self.kv_dtype!r}; choose one of {tuple(DTYPE_BYTES)}"
            )
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise PlanError(
                f"unknown weight dtype {self.weight_dtype!r}; choose one of {WEIGHT_DTYPES}"
            )

    def layouts(self) -> list[tuple[str, ParallelConfig]]:
        """(row name, layout): every layout `ParallelConfig.compared` sets side by side, the
        baseline first; a tpla row keeps its name at r = 1."""
        tp = self.hardware.gpus_per_group
        compared = ParallelConfig.compared(
            tp, self.latent_groups, self.rmsnorm, self.chunk_size, self.moe
        )
        return [(mode.value, layout) for mode, layout in compared]

    def prefill_layout(self) -> ParallelConfig:
        """A prefill group's ranks: MLA-TP over `prefill_gpus`, whatever decode runs."""
        return ParallelConfig(self.prefill_gpus, 1, RmsNormMode.EXACT, moe=self.moe)


@dataclass(frozen=True)
class LayoutPlan:
    """One layout on one rank (the largest rank: lm_head slices differ by a row)."""

    name: str  # the plan's row: a layout's name (a tpla row may ask for r = 1)
    layout: ParallelConfig
    weights_bytes: int
    kv_bytes_per_token: float  # per context token of the group, on one rank
    kv_bytes_per_stored_token: int
    kv_budget_bytes: int  # memory - weights - reserve; negative when the weights do not fit
    stored_tokens: int  # whole blocks of the rank's pool x block size
    max_tokens: int  # context tokens of the group the rank's pool backs
    blocks_per_sequence: int  # on the busiest rank, at the requested context
    max_sequences: int  # per group, at the requested context
    fits: bool  # weights + reserve < GPU memory

    @property
    def label(self) -> str:
        return layout_label(self.name, self.layout.latent_groups)


def plan_layout(c: ModelConfig, req: PlanRequest, name: str, layout: ParallelConfig) -> LayoutPlan:
    hw, bs = req.hardware, req.block_size
    weights = max(
        weight_bytes(rank_tensors(c, layout, rank, req.mtp_layers), req.weight_dtype, req.fp8_block)
        for rank in range(layout.tp)
    )
    stored = kv_bytes_per_stored_token(
        c, layout, req.kv_dtype, req.mtp_layers, req.index_cache_dtype
    )
    budget = hw.gpu_mem_bytes - weights - hw.reserve
    # As CacheLayout.blocks_for_budget, less the cache's trash block (never handed out).
    blocks = max(max(budget, 0) // (stored * bs) - 1, 0)
    # Rank 0 caches the most of a sequence: in SP it owns the first of its chunks.
    per_seq = -(-layout.local_length(req.context, 0) // bs)
    # A context token costs a rank its row only on the one of `token_ranks` that caches it.
    ranks = layout.token_ranks
    return LayoutPlan(
        name=name,
        layout=layout,
        weights_bytes=weights,
        kv_bytes_per_token=stored / ranks,
        kv_bytes_per_stored_token=stored,
        kv_budget_bytes=budget,
        stored_tokens=blocks * bs,
        max_tokens=blocks * bs * ranks,
        blocks_per_sequence=per_seq,
        max_sequences=blocks // per_seq,
        fits=weights + hw.reserve < hw.gpu_mem_bytes,
    )


@dataclass(frozen=True)
class Plan:
    config: ModelConfig
    request: PlanRequest
    layouts: tuple[LayoutPlan, ...]  # as `PlanRequest.layouts`: the baseline first
    breakdown: tuple[tuple[str, int], ...]  # the first TPLA layout's rank-0 bytes by part
    full_model_bytes: int  # the whole model in the weight dtype
    prefill_weights_bytes: int  # the largest prefill rank's (vocabulary slices differ by a row)

    @property
    def prefill_fits(self) -> bool:
        hw = self.request.hardware
        return self.prefill_weights_bytes + hw.reserve < hw.gpu_mem_bytes

    @property
    def baseline(self) -> LayoutPlan:
        """The exact baseline's row (MLA-TP), which the others are compared with."""
        return self.layouts[0]

    @property
    def chosen(self) -> LayoutPlan:
        return self.layouts[1]

    def by_name(self, name: str) -> LayoutPlan:
        """The first row of that name: of tpla, the first r's."""
        return next(p for p in self.layouts if p.name == name)

    def to_json(self) -> dict[str, Any]:
        """The `tpla plan --json` contract (keyed by layout name: tpla is the first r)."""
        req, hw = self.request, self.request.hardware
        keyed = {p.name: self.by_name(p.name) for p in self.layouts}
        return {
            "model_type": self.config.model_type,
            "num_hidden_layers": self.config.num_hidden_layers,
            "gpu_mem_bytes": hw.gpu_mem_bytes,
            "gpus_per_group": hw.gpus_per_group,
            "latent_groups": req.latent_groups[0],
            "context": req.context,
            "dtype": req.kv_dtype,
            "weight_dtype": req.weight_dtype,
            "rmsnorm": req.rmsnorm.value,
            "block_size": req.block_size,
            "chunk_size": req.chunk_size,
            "reserve_bytes": hw.reserve,
            "weights_bytes_per_rank": self.chosen.weights_bytes,
            "kv_bytes_per_token_per_rank": {
                k: _num(p.kv_bytes_per_token) for k, p in keyed.items()
            },
            "max_tokens_per_rank": {k: p.max_tokens for k, p in keyed.items()},
            "max_sequences_per_group": {k: p.max_sequences for k, p in keyed.items()},
            "fits": self.chosen.fits,
            "fits_by_layout": {k: p.fits for k, p in keyed.items()},
            "weights_breakdown_bytes_per_rank": dict(self.breakdown),
            "full_model_bytes": self.full_model_bytes,
            "prefill_gpus": req.prefill_gpus,
            "prefill_weights_bytes_per_rank": self.prefill_weights_bytes,
            "prefill_fits": self.prefill_fits,
            "mtp_layers_loaded": req.mtp_layers,
            "layouts": [_layout_json(p) for p in self.layouts],
        }


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def _layout_json(p: LayoutPlan) -> dict[str, Any]:
    return {
        "layout": p.name,
        "latent_groups": p.layout.latent_groups,
        "head_groups": p.layout.head_groups,
        "weights_bytes_per_rank": p.weights_bytes,
        "kv_bytes_per_token_per_rank": _num(p.kv_bytes_per_token),
        "kv_bytes_per_stored_token": p.kv_bytes_per_stored_token,
        "kv_budget_bytes_per_rank": p.kv_budget_bytes,
        "stored_tokens_per_rank": p.stored_tokens,
        "max_tokens_per_rank": p.max_tokens,
        "blocks_per_sequence": p.blocks_per_sequence,
        "max_sequences_per_group": p.max_sequences,
        "fits": p.fits,
    }


def build_plan(c: ModelConfig, req: PlanRequest) -> Plan:
    """Plan every layout of `req` for model `c`; PlanError when one cannot shard `c`."""
    if req.context > c.max_position_embeddings:
        raise PlanError(
            f"context {req.context} exceeds the model's max_position_embeddings "
            f"({c.max_position_embeddings})"
        )
    layouts = req.layouts()
    for _, layout in layouts:
        layout.check(c)
    if req.mtp_layers > c.num_nextn_predict_layers:
        raise PlanError(
            f"{req.mtp_layers} MTP layers asked for; the model has {c.num_nextn_predict_layers}"
        )
    chosen = rank_tensors(c, layouts[1][1], 0, req.mtp_layers)
    parts: dict[str, int] = {}
    for t in chosen:
        parts[t.part] = parts.get(t.part, 0) + weight_bytes([t], req.weight_dtype, req.fp8_block)
    # load_model keeps the router in float32 too (common.loading.weights.kept_float32).
    full = rank_tensors(c, ParallelConfig(), 0, req.mtp_layers)
    prefill = req.prefill_layout()
    prefill.check(c)
    return Plan(
        config=c,
        request=req,
        layouts=tuple(plan_layout(c, req, name, layout) for name, layout in layouts),
        breakdown=tuple(parts.items()),
        full_model_bytes=weight_bytes(full, req.weight_dtype, req.fp8_block),
        prefill_weights_bytes=max(
            weight_bytes(
                prefill_rank_tensors(c, prefill, rank, req.mtp_layers),
                req.weight_dtype,
                req.fp8_block,
            )
            for rank in range(prefill.tp)
        ),
    )

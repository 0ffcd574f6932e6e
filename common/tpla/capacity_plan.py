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
from common.parallel import MoeParallel, ParallelConfig, RmsNormMode, layout_label, span
from common.step_shapes import step_shapes
from common.tpla.rank_memory import (
    DTYPE_BYTES,
    WEIGHT_DTYPES,
    PlanError,
    RankTensor,
    kv_bytes_per_stored_token,
    prefill_rank_tensors,
    rank_tensors,
    weight_bytes,
)

GIB = 2**30
# Like vLLM's default gpu_memory_utilization=0.9: what a step allocates outside its graphs,
# prefill chunks' activations and allocator slack grow with the card; the floor covers the
# CUDA context (~0.5-1 GiB) on small cards. A decode rank's CUDA graphs and NCCL buffers are
# counted on top (`graph_reserve`).
RESERVE_FRACTION = 0.10
RESERVE_FLOOR_BYTES = 2 * GIB
# Estimates, not measurements (no GPU here measured them): NCCL keeps per communicator
# NCCL_BUFFSIZE (4 MiB) per protocol (Simple, LL128; LL is small) for each of its ring's two
# peers on up to 32 channels of an NVLink node: 4 MiB x 2 x 2 x 32 = 512 MiB a rank. A graph's
# own device memory (its kernel nodes' parameters) is small; 2 MiB each is an allowance.
NCCL_BYTES = 512 * 2**20
GRAPH_BYTES = 2 * 2**20
SPLITS = 32  # the decode kernel's most split-KV partials (decode_attention.MAX_SPLITS)


@dataclass(frozen=True)
class Checkpoint:
    """What the planner reads from an HF `config.json`: the architecture and two facts
    `ModelConfig` leaves out."""

    config: ModelConfig
    quant_method: str | None  # "fp8" for DeepSeek-V3's published checkpoint
    fp8_block: tuple[int, int]  # its weight_block_size
    mtp_layers: int  # num_nextn_predict_layers: loaded only when speculation is `mtp`
    # compressed-tensors' INT4 routed experts (Kimi K2-Thinking / K2.5 / K2.6): their group
    # size; None for any other checkpoint.
    int4_group: int | None = None


def checkpoint_from_hf_dict(raw: dict[str, Any]) -> Checkpoint:
    """Parse a config dict, quantized or not (planning needs no weights; `--weight-dtype`
    decides the bytes: the loader dequantizes FP8 checkpoints to the serving dtype). A
    multimodal wrapper's quantization_config may stand in its text_config."""
    raw = dict(raw)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    quant = raw.pop("quantization_config", None) or text.get("quantization_config") or {}
    block = quant.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise PlanError(f"quantization_config.weight_block_size {block!r} is not [rows, cols]")
    return Checkpoint(
        config=ModelConfig.from_hf_dict(raw),
        quant_method=quant.get("quant_method"),
        fp8_block=(block[0], block[1]),
        mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
        int4_group=_int4_group(quant),
    )


def _int4_group(quant: dict[str, Any]) -> int | None:
    """The group size of a compressed-tensors checkpoint's 4-bit weights (the loader checks
    the rest of the scheme), or None."""
    if quant.get("quant_method") != "compressed-tensors":
        return None
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("num_bits") == 4 and weights.get("group_size"):
            return int(weights["group_size"])
    return None


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
    int4_group: int | None = None  # the checkpoint's INT4 experts' group size (Checkpoint's)
    moe: MoeParallel = MoeParallel.TP  # routed experts: a slice of each, or whole ones (ep)
    prefill_gpus: int = 1  # ranks of one prefill group (TPLA_PREFILL_TP), on the same cards
    mtp_layers: int = 0  # MTP modules loaded (speculation `mtp`): weights and cache counted
    # The decode step's CUDA graphs (common/step_shapes.py): one per shape, sized by the batch
    # limit and the context limit (TPLA_MAX_BATCH, TPLA_MAX_MODEL_LEN: None = the model's),
    # with `draft_rows` the most rows of a step with an MTP draft pass (0: none).
    max_batch: int = 32
    max_model_len: int | None = None
    draft_rows: int = 0
    index_cache_dtype: str = "model"  # DSA's indexer keys in the KV pools: model | fp8

    def __post_init__(self) -> None:
        if self.prefill_gpus < 1:
            raise PlanError("a prefill group needs at least one GPU")
        if self.max_batch < 1 or self.draft_rows < 0:
            raise PlanError("the batch limit must be positive and the draft rows not negative")
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

    def weight_bytes(self, tensors: list[RankTensor]) -> int:
        """Bytes of `tensors` in the request's weight dtype and the checkpoint's format; a
        quantized checkpoint's other weights in the model's dtype (the KV cache's)."""
        return weight_bytes(
            tensors, self.weight_dtype, self.fp8_block, self.int4_group, self.kv_dtype
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
    graphs: int = 0  # CUDA graphs a rank captures
    graph_pool_bytes: int = 0  # their shared pool (an estimate), in the reserve
    nccl_bytes: int = 0  # NCCL's buffers (an estimate), in the reserve

    @property
    def label(self) -> str:
        return layout_label(self.name, self.layout.latent_groups)


def plan_layout(c: ModelConfig, req: PlanRequest, name: str, layout: ParallelConfig) -> LayoutPlan:
    hw, bs = req.hardware, req.block_size
    weights = max(
        req.weight_bytes(rank_tensors(c, layout, rank, req.mtp_layers)) for rank in range(layout.tp)
    )
    stored = kv_bytes_per_stored_token(
        c, layout, req.kv_dtype, req.mtp_layers, req.index_cache_dtype
    )
    graphs, pool = graph_reserve(c, req, layout)
    nccl = NCCL_BYTES if layout.tp > 1 else 0
    # A reserve given explicitly is all of it; the default one has them on top.
    reserve = hw.reserve + (0 if hw.reserve_bytes is not None else pool + nccl)
    budget = hw.gpu_mem_bytes - weights - reserve
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
        fits=weights + reserve < hw.gpu_mem_bytes,
        graphs=graphs,
        graph_pool_bytes=pool,
        nccl_bytes=nccl,
    )


def graph_reserve(c: ModelConfig, req: PlanRequest, layout: ParallelConfig) -> tuple[int, int]:
    """(CUDA graphs a decode rank captures, the bytes of their one shared pool): every
    graph records the largest step's transient tensors into the same pool, estimated at the
    largest shape, batch max_batch over the context limit's table, from what the step makes:
    its logits (and rank 0's gather of every rank's), the decode kernel's split-KV partials
    (fp32), the gathered tables and the reads' copy of them (SP: per-token slots and a mask
    too), the routed slots' expert activations and a layer's hidden states."""
    bs, b, item = req.block_size, req.max_batch, DTYPE_BYTES[req.kv_dtype]
    blocks = -(-(req.max_model_len or c.max_position_embeddings) // bs)
    shapes = step_shapes(b, blocks, bs, req.draft_rows)
    vocab = span(layout.vocab_rows(0, c.vocab_size))
    heads, latent = span(layout.heads(0, c.num_attention_heads)), c.kv_lora_rank
    if layout.caches_every_token:
        latent = span(layout.latent_columns(0, c.kv_lora_rank))
    logits = b * vocab * item * (1 + layout.tp)
    partials = b * heads * SPLITS * (latent + 1) * 4
    tables = 2 * b * blocks * 8
    if not layout.caches_every_token:
        tables += b * blocks * bs * (8 + 8 + 1)
    expert = span(layout.expert_columns(0, c.moe_intermediate_size)) if c.n_routed_experts else 0
    experts = b * c.num_experts_per_tok * (2 * expert + c.hidden_size) * item
    hidden = 8 * b * c.hidden_size * item
    pool = logits + partials + tables + experts + hidden
    return len(shapes), pool + len(shapes) * GRAPH_BYTES


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
        "cuda_graphs_per_rank": p.graphs,
        "graph_pool_bytes_per_rank": p.graph_pool_bytes,
        "nccl_bytes_per_rank": p.nccl_bytes,
    }


def build_plan(c: ModelConfig, req: PlanRequest) -> Plan:
    """Plan every layout of `req` for model `c`; PlanError when one cannot shard `c`."""
    if req.context > c.max_position_embeddings:
        raise PlanError(
            f"context {req.context} exceeds the model's max_position_embeddings "
            f"({c.max_position_embeddings})"
        )
    if req.max_model_len is not None and not req.context <= req.max_model_len:
        raise PlanError(f"context {req.context} exceeds the context limit {req.max_model_len}")
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
        parts[t.part] = parts.get(t.part, 0) + req.weight_bytes([t])
    # load_model keeps the router in float32 too (common.loading.weights.kept_float32).
    full = rank_tensors(c, ParallelConfig(), 0, req.mtp_layers)
    prefill = req.prefill_layout()
    prefill.check(c)
    return Plan(
        config=c,
        request=req,
        layouts=tuple(plan_layout(c, req, name, layout) for name, layout in layouts),
        breakdown=tuple(parts.items()),
        full_model_bytes=req.weight_bytes(full),
        prefill_weights_bytes=max(
            req.weight_bytes(prefill_rank_tensors(c, prefill, rank, req.mtp_layers))
            for rank in range(prefill.tp)
        ),
    )

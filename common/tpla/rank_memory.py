"""What one rank holds: a decode rank's weights per layout, tensor by tensor, and its cache
bytes per token; a prefill rank's weights.

Pure arithmetic over `ModelConfig` (no torch, no I/O). The weights mirror how
`services.decode.rank.rank_model.RankModel` shards a model (a test holds them equal to
`RankModel.parameter_bytes()` for every rank); the cache follows DESIGN §1. `tpla plan`
(plan.py) turns these into the context that fits a card.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from common.model.args import ModelConfig
from common.parallel import ParallelConfig, RmsNormMode, span

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Weights only: kept as the checkpoint stores them (DeepSeek's block-quantized e4m3 with one
# fp32 scale per block, or compressed-tensors' INT4 routed experts); `float8` is its older name.
QUANTIZED = "quantized"
FP8 = "float8"
WEIGHT_DTYPES = (*DTYPE_BYTES, QUANTIZED, FP8)
# The tensors an INT4 checkpoint (Kimi K2-Thinking / K2.5 / K2.6) stores in INT4.
INT4_PARTS = frozenset({"routed_experts"})
# DSA's indexer keys in a rank's key pool (common/model/index_keys.py): the model's dtype, or
# DeepSeek's fp8 (d_I e4m3 bytes and a 4-byte scale).
INDEX_CACHE_DTYPES = ("model", "fp8")


class PlanError(ValueError):
    """The hardware, layout or model given to the planner is inconsistent."""


@dataclass(frozen=True)
class RankTensor:
    """`count` tensors of one 2-D (or 1-D) shape held by a rank, e.g. one per layer."""

    part: str  # attention | dense_mlp | routed_experts | shared_experts | router | norms | ...
    shape: tuple[int, ...]
    count: int = 1
    quantized: bool = False  # a linear weight that DeepSeek's FP8 checkpoints store in fp8
    # The engine keeps it in float32 whatever the model dtype: the router, read from the
    # checkpoint in float32 (common.loading.weights.kept_float32).
    float32: bool = False

    @property
    def numel(self) -> int:
        return self.count * math.prod(self.shape)


def _layer_tensors(
    c: ModelConfig, layout: ParallelConfig, rank: int, moe: bool
) -> list[RankTensor]:
    d, heads = c.hidden_size, span(layout.heads(rank, c.num_attention_heads))
    width = span(layout.latent_columns(rank, c.kv_lora_rank))
    out: list[RankTensor] = []

    def add(part: str, *shape: int, count: int = 1, q: bool = True) -> None:
        out.append(RankTensor(part, shape, count, q, float32=part == "router"))

    if c.q_lora_rank is not None:  # q_a and its norm replicated, q_b rows of this head group
        add("attention", c.q_lora_rank, d)
        add("attention", c.q_lora_rank, q=False)
        add("attention", heads * c.qk_head_dim, c.q_lora_rank)
    else:
        add("attention", heads * c.qk_head_dim, d)
    # kv_a: exact RMSNorm needs every latent row to normalize; sliced mode keeps its slice.
    add("attention", c.kv_lora_rank if layout.rmsnorm is RmsNormMode.EXACT else width, d)
    add("attention", c.qk_rope_head_dim, d)
    add("attention", c.kv_lora_rank, q=False)  # kv_a_layernorm's gamma, whole
    add("attention", heads * c.qk_nope_head_dim, width)  # W_UK[heads, :, S_i]
    add("attention", heads * c.v_head_dim, width)  # W_UV[heads, :, S_i]
    add("attention", d, heads * c.v_head_dim)  # o_proj columns of these heads
    add("norms", d, q=False)
    add("norms", d, q=False)
    if not moe:
        inter = span(layout.ffn_columns(rank, c.intermediate_size))
        add("dense_mlp", inter, d, count=2)  # gate, up
        add("dense_mlp", d, inter)
        return out
    e = span(layout.owned_experts(rank, c.n_routed_experts))
    inter = span(layout.expert_columns(rank, c.moe_intermediate_size))
    add("router", c.n_routed_experts, d, q=False)  # replicated: it scores every expert
    if c.topk_method == "noaux_tc" and c.router_bias:
        add("router", c.n_routed_experts, q=False)  # e_score_correction_bias
    if c.moe_output_norm:
        add("norms", d, q=False)  # post_mlp_layernorm
    add("routed_experts", 2 * inter, d, count=e)  # gate_up of every held expert
    add("routed_experts", d, inter, count=e)
    if c.n_shared_experts:
        shared = span(
            layout.shared_expert_columns(rank, c.moe_intermediate_size, c.n_shared_experts)
        )
        add("shared_experts", shared, d, count=2)
        add("shared_experts", d, shared)
    return out


def _indexer_tensors(c: ModelConfig, count: int) -> list[RankTensor]:
    """`count` DSA indexers, whole on every rank: wq_b, wk (FP8 in V3.2's checkpoint), the
    key norm's weight and bias, and weights_proj (float32, as HF and the engine keep it)."""
    dsa, q_lora = c.dsa, c.q_lora_rank
    if dsa is None or q_lora is None or not count:
        return []
    heads, d = dsa.index_n_heads, dsa.index_head_dim
    return [
        RankTensor("indexer", (heads * d, q_lora), count, quantized=True),
        RankTensor("indexer", (d, c.hidden_size), count, quantized=True),
        RankTensor("indexer", (d,), 2 * count),
        RankTensor("indexer", (heads, c.hidden_size), count, float32=True),
    ]


def rank_tensors(
    c: ModelConfig, layout: ParallelConfig, rank: int, mtp_layers: int = 0
) -> list[RankTensor]:
    """Every tensor `RankModel(full, layout, rank, ...)` holds, and with `mtp_layers` > 0
    the first that many MTP modules (`mtp_tensors`); a DSA model's full layers' indexers."""
    layout.check(c)
    if not 0 <= rank < layout.tp:
        raise PlanError(f"rank {rank} is outside tp={layout.tp}")
    n_moe = sum(c.is_moe_layer(n) for n in range(c.num_hidden_layers))
    out: list[RankTensor] = []
    for moe, layers in ((False, c.num_hidden_layers - n_moe), (True, n_moe)):
        if layers:
            out += [
                replace(t, count=t.count * layers) for t in _layer_tensors(c, layout, rank, moe)
            ]
    if c.dsa is not None:
        out += _indexer_tensors(c, c.dsa.key_layers(c.num_hidden_layers))
    vocab_rows = span(layout.vocab_rows(rank, c.vocab_size))
    out += [
        RankTensor("embedding", (c.vocab_size, c.hidden_size)),  # replicated, whole vocab
        RankTensor("norms", (c.hidden_size,)),
        RankTensor("lm_head", (vocab_rows, c.hidden_size)),
    ]
    return out + mtp_tensors(c, layout, rank, mtp_layers)


def mtp_tensors(
    c: ModelConfig, layout: ParallelConfig, rank: int, mtp_layers: int
) -> list[RankTensor]:
    """A rank's share of `mtp_layers` MTP modules (common/loading/mtp_weights.py): each
    module's decoder layer (layer num_hidden_layers + k) sharded like any layer, enorm,
    hnorm, eh_proj and shared_head.norm replicated. The module's embedding and head are
    counted as the main model's: the loader keeps one copy when they are equal, as in V3."""
    if not 0 <= mtp_layers <= c.num_nextn_predict_layers:
        raise PlanError(
            f"{mtp_layers} MTP layers asked for; the model has {c.num_nextn_predict_layers}"
        )
    out: list[RankTensor] = []
    d = c.hidden_size
    for k in range(mtp_layers):
        moe = c.is_moe_layer(c.num_hidden_layers + k)
        out += [replace(t, part="mtp") for t in _layer_tensors(c, layout, rank, moe)]
        out += [
            RankTensor("mtp", (d,), count=3),  # enorm, hnorm, shared_head.norm
            RankTensor("mtp", (d, 2 * d), quantized=True),  # eh_proj
        ]
        out += [replace(t, part="mtp") for t in _indexer_tensors(c, 1)]  # DSA: its own
    return out


def prefill_rank_tensors(
    c: ModelConfig, layout: ParallelConfig, rank: int, mtp_layers: int = 0
) -> list[RankTensor]:
    """Every tensor rank `rank` of a prefill group holds. It is sharded as an MLA-TP decode
    rank (heads, FFN columns or experts, shared-expert columns, vocabulary rows of the LM
    head) but its embedding is split by vocabulary too: a prefill batch embeds thousands of
    tokens, so a masked lookup and one all-reduce cost little beside the layers, while
    V3's replicated embedding would be 1.75 GiB a rank."""
    if not layout.splits_heads_only:
        raise PlanError("a prefill group is sharded as MLA-TP (r = 1, no SP)")
    vocab_rows = span(layout.vocab_rows(rank, c.vocab_size))
    return [
        RankTensor("embedding", (vocab_rows, c.hidden_size)) if t.part == "embedding" else t
        for t in rank_tensors(c, layout, rank, mtp_layers)
    ]


def weight_bytes(
    tensors: list[RankTensor],
    weight_dtype: str,
    fp8_block: tuple[int, int] = (128, 128),
    int4_group: int | None = None,
    model_dtype: str = "bfloat16",
) -> int:
    """Bytes of `tensors` in `weight_dtype` (the router stays float32, as in the engine).

    Quantized weights count the checkpoint's layout (on the rank's own slice of each matrix):
    with `int4_group` (compressed-tensors' INT4 experts), the routed experts at 4 bits a value
    plus a bf16 scale per group of a row; else DeepSeek's FP8, quantized linears at 1 byte
    plus an fp32 scale per block. Every other weight (norms, embedding, lm_head, ...) is held
    in `model_dtype`, the rank's compute dtype (TPLA_DTYPE), as the engine converts it.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise PlanError(f"unknown weight dtype {weight_dtype!r}; choose one of {WEIGHT_DTYPES}")
    total = 0
    for t in tensors:
        if t.float32:
            total += 4 * t.numel
        elif weight_dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[weight_dtype] * t.numel
        elif int4_group is not None and t.part in INT4_PARTS:
            rows, cols = t.shape
            total += t.count * rows * (cols // 2 + 2 * math.ceil(cols / int4_group))
        elif t.quantized and int4_group is None:
            rows, cols = t.shape
            blocks = math.ceil(rows / fp8_block[0]) * math.ceil(cols / fp8_block[1])
            total += t.numel + 4 * t.count * blocks
        else:
            total += DTYPE_BYTES[model_dtype] * t.numel
    return total


def kv_bytes_per_stored_token(
    c: ModelConfig,
    layout: ParallelConfig,
    kv_dtype: str,
    mtp_layers: int = 0,
    index_cache_dtype: str = "model",
) -> int:
    """Bytes one token takes in a rank's cache, all layers (each MTP module's layer keeps
    its own latent of every position too): (latent slice + d_r) x layers x bytes, and a
    DSA model's indexer keys (`index_key_bytes`)."""
    if kv_dtype not in DTYPE_BYTES:
        raise PlanError(f"unknown KV dtype {kv_dtype!r}; choose one of {tuple(DTYPE_BYTES)}")
    width = span(layout.latent_columns(0, c.kv_lora_rank))  # alike on every rank
    layers = c.num_hidden_layers + mtp_layers
    latents = (width + c.qk_rope_head_dim) * layers * DTYPE_BYTES[kv_dtype]
    return latents + index_key_bytes(c, kv_dtype, mtp_layers, index_cache_dtype)


def index_key_bytes(
    c: ModelConfig, kv_dtype: str, mtp_layers: int = 0, index_cache_dtype: str = "model"
) -> int:
    """A DSA model's indexer keys of one token on a rank (every rank that caches the token
    keeps its whole key, in every layout): one per full layer and MTP layer, d_I values of
    the KV dtype, or d_I + 4 bytes in fp8; 0 without DSA."""
    if index_cache_dtype not in INDEX_CACHE_DTYPES:
        raise PlanError(
            f"unknown index cache dtype {index_cache_dtype!r}; choose one of {INDEX_CACHE_DTYPES}"
        )
    if c.dsa is None:
        return 0
    d = c.dsa.index_head_dim
    row = d + 4 if index_cache_dtype == "fp8" else d * DTYPE_BYTES[kv_dtype]
    return row * c.dsa.key_layers(c.num_hidden_layers + mtp_layers)

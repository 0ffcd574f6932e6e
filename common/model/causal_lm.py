"""The DeepSeek-V2/V3 causal LM: exact expanded prefill and absorbed decode over a latent cache.

Parameter names mirror the HF checkpoint (`model.layers.N.self_attn.kv_b_proj.weight`, ...)
so loading is a name mapping. The cache is reached only through the small `LatentKV`
protocol, so the engine can back it with a paged pool without touching this file. The prefill
loop (`packed_prefill`) runs on a `LayerStack`: this model, or a prefill rank's share of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from typing import Protocol, cast

import torch
from torch import Tensor, nn

from common.model import past_native
from common.model.args import ModelConfig
from common.model.mla import MLAttention, RMSNorm
from common.model.moe import MLP, MoE
from common.model.past_attention import absorbed_over_past, expanded_over_past
from common.model.prefill_attention import PrefillAttention, SdpaPrefillAttention
from common.model.rope import RotaryEmbedding, scale_queries
from common.model.sparse_attention import SelectionCarry, select_decode
from common.model.sparse_prefill import SparsePrefill


class LatentKV(Protocol):
    """Where a decode step stores new latents and reads each sequence's whole latent history."""

    def write(self, layer: int, positions: Tensor, n: Tensor, k_pe: Tensor) -> None:
        """Store one new token per sequence: n [B, d_c], k_pe [B, d_r] at `positions` [B]."""

    def read(self, layer: int, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Return n [B, T, d_c], k_pe [B, T, d_r] and valid [B, T] covering 0..positions[b]."""

    def write_keys(self, layer: int, positions: Tensor, keys: Tensor) -> None:
        """DSA: store a full layer's indexer keys [B, d_I] of the new tokens at `positions`."""

    def read_keys(self, layer: int, positions: Tensor) -> Tensor:
        """DSA: a full layer's indexer keys [B, T, d_I] over the rows `read` returns."""


@dataclass
class PrefillOutput:
    logits: Tensor  # [num_seqs, V] at each prompt's last token, or [T, V] with all_logits
    n: list[Tensor]  # per layer, packed [T, d_c]
    k_pe: list[Tensor]  # per layer, packed [T, d_r]
    # The last layer's output before the final norm, packed [T, D] (every row, whatever
    # `logits` covers): what DeepSeek-V3's multi-token-prediction module reads
    # (common/model/mtp.py) over a whole prompt.
    hidden: Tensor | None = None
    # DSA: per full layer (the index-key pool's rows), the new tokens' indexer keys [T, d_I].
    index_keys: list[Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class PastLatents:
    """A prompt's cached prefix for prefill: per layer n [P, d_c] and k_pe [P, d_r] of its
    first P tokens. The prompt's new tokens then start at position P and attend over them."""

    n: list[Tensor]
    k_pe: list[Tensor]
    index_keys: list[Tensor] = field(default_factory=list)  # DSA: per full layer, [P, d_I]

    @property
    def length(self) -> int:
        return int(self.n[0].shape[0])


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, config.dsa is not None and config.dsa.is_full(layer))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(config)
            if config.is_moe_layer(layer)
            else MLP(config.hidden_size, config.intermediate_size)
        )
        # Named as the checkpoint stores it (A.X-K1 also stores one for its dense layers,
        # where it is not used, as in HF transformers).
        self.post_mlp_layernorm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps)
            if config.moe_output_norm and config.is_moe_layer(layer)
            else None
        )

    def ffn_output(self, f: Tensor) -> Tensor:
        """The FFN's whole output (summed over the ranks) as the residual takes it."""
        return f if self.post_mlp_layernorm is None else self.post_mlp_layernorm(f)

    def feed_forward(self, h: Tensor) -> Tensor:
        return h + self.ffn_output(self.mlp(self.post_attention_layernorm(h)))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config)
        self.prefill_attention: PrefillAttention = SdpaPrefillAttention()

    def to_device(self, device: torch.device | str) -> DeepseekForCausalLM:
        self.to(device)
        self.rope = RotaryEmbedding(self.config, device)
        return self

    def logits(self, h: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(h))

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: Tensor,
        seq_lens: list[int],
        *,
        all_logits: bool = False,
        absorbed: bool = False,
        past: Sequence[PastLatents | None] | None = None,
    ) -> PrefillOutput:
        """Exact MLA over packed prompts, without autograd. Each prompt starts at position 0,
        or after its `past` (a cached prefix whose latents it attends over; the output then
        covers only the new tokens)."""
        return self(input_ids, seq_lens, all_logits=all_logits, absorbed=absorbed, past=past)

    def forward(
        self,
        input_ids: Tensor,
        seq_lens: list[int],
        *,
        all_logits: bool = False,
        absorbed: bool = False,
        past: Sequence[PastLatents | None] | None = None,
    ) -> PrefillOutput:
        """Packed prompts -> logits and per-layer latents (differentiable; used for training).

        `absorbed=True` runs the latent-space path instead of the expanded one (a reference
        for tests; prefill is compute-bound, so the expanded path is the fast one). `past`:
        per prompt, its cached prefix or None (see `prefill`).
        """
        return packed_prefill(
            self, input_ids, seq_lens, all_logits=all_logits, absorbed=absorbed, past=past
        )

    # -- LayerStack: the whole model is a group of one rank ---------------------------------

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        return cast(Sequence[DecoderLayer], self.model.layers)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def reduce(self, partial: Tensor) -> Tensor:
        return partial

    @torch.inference_mode()
    def decode(self, token_ids: Tensor, positions: Tensor, kv: LatentKV) -> Tensor:
        """One decode step for B sequences (one new token each) -> logits [B, V]."""
        cos, sin = self.rope.cos_sin(positions)
        h = self.model.embed_tokens(token_ids)
        carry = SelectionCarry()
        for i, layer in enumerate(self.decoder_layers()):
            h = decode_layer(layer, i, h, self.rope, (cos, sin), positions, kv, carry)
        return self.logits(h)


def decode_layer(
    layer: DecoderLayer,
    index: int,
    h: Tensor,
    rope: RotaryEmbedding,
    cos_sin: tuple[Tensor, Tensor],
    positions: Tensor,
    kv: LatentKV,
    carry: SelectionCarry | None = None,
) -> Tensor:
    """One layer of a decode step: write the new latents as cache layer `index`, attend over
    the whole history (absorbed), then the FFN. h [B, D] -> [B, D]. A DSA layer attends only
    over the tokens its indexer selects (a shared one: those of the full layer before it in
    `carry`)."""
    cos, sin = cos_sin
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    q_latent = attn.q_latent(x) if attn.dsa is not None else None
    queries = attn.queries(x, rope, cos, sin, q_latent)
    q_nope, q_pe = scale_queries(*queries, rope.query_scale(positions))
    n_new, k_pe_new = attn.latents(x, rope, cos, sin)
    kv.write(index, positions, n_new, k_pe_new)
    if attn.indexer is not None:
        kv.write_keys(index, positions, attn.indexer.keys(x, cos, sin))
    n, k_pe, valid = kv.read(index, positions)
    if q_latent is not None:
        keys = kv.read_keys(index, positions) if attn.indexer is not None else n
        carry = carry if carry is not None else SelectionCarry()
        valid = select_decode(attn, x, q_latent, (cos, sin), keys, valid, carry)
    o = attn.absorbed(q_nope[:, None], q_pe[:, None], n, k_pe, valid[:, None])[:, 0]
    return layer.feed_forward(h + attn.output(o))


class LayerStack(Protocol):
    """What a packed prefill runs on: the whole model, or one rank's share of it (its heads'
    attention, its FFN slice, its vocabulary shard) whose partial sums `reduce` completes."""

    rope: RotaryEmbedding
    prefill_attention: PrefillAttention

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """Every layer, each with the whole model's modules (or a rank's slices of them)."""

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token ids [T] -> the whole hidden state [T, D]."""

    def reduce(self, partial: Tensor) -> Tensor:
        """A partial hidden state summed over the group's ranks (in place or not)."""

    def logits(self, h: Tensor) -> Tensor:
        """The final hidden state [R, D] -> the logits this stack holds [R, V or its shard]."""


def packed_positions(
    input_ids: Tensor, seq_lens: list[int], past: Sequence[PastLatents | None] | None
) -> tuple[list[int], list[PastLatents | None], list[int], Tensor]:
    """Packed prompts' row offsets (cu: each prompt's first row, then the total), each
    prompt's past (None: from position 0), its first position (its past's length) and every
    row's position [T]."""
    cu = [0]
    for length in seq_lens:
        cu.append(cu[-1] + length)
    if cu[-1] != input_ids.shape[0] or min(seq_lens, default=0) <= 0:
        raise ValueError("seq_lens must be positive and sum to len(input_ids)")
    pasts = list(past) if past is not None else [None] * len(seq_lens)
    if len(pasts) != len(seq_lens):
        raise ValueError("past must have one entry per prompt")
    starts = [p.length if p is not None else 0 for p in pasts]
    device = input_ids.device
    positions = torch.cat(
        [torch.arange(s, s + n, device=device) for s, n in zip(starts, seq_lens, strict=True)]
    )
    return cu, pasts, starts, positions


def packed_prefill(
    stack: LayerStack,
    input_ids: Tensor,
    seq_lens: list[int],
    *,
    all_logits: bool = False,
    absorbed: bool = False,
    past: Sequence[PastLatents | None] | None = None,
) -> PrefillOutput:
    """The one prefill loop: `DeepseekForCausalLM.forward` and every prefill rank run it.

    Each layer's attention output and FFN output are summed over the ranks (`reduce`) before
    the residual add; the whole model's `reduce` is the identity, so it runs exactly this.
    """
    cu, pasts, starts, positions = packed_positions(input_ids, seq_lens, past)
    rope, backend = stack.rope, stack.prefill_attention
    cos, sin = rope.cos_sin(positions)
    q_scale = rope.query_scale(positions)
    h = stack.embed(input_ids)
    all_n, all_k_pe = [], []
    layers = stack.decoder_layers()
    dsa = layers[0].self_attn.dsa if layers else None
    sparse = None
    if dsa is not None:
        past_keys = [p.index_keys if p is not None else None for p in pasts]
        sparse = SparsePrefill(dsa.index_topk, cu, starts, past_keys)
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q_latent = attn.q_latent(x) if sparse is not None else None
        q_nope, q_pe = scale_queries(*attn.queries(x, rope, cos, sin, q_latent), q_scale)
        n, k_pe = attn.latents(x, rope, cos, sin)
        if sparse is not None and q_latent is not None:
            sparse.index(attn, x, q_latent, cos, sin)
        if sparse is not None and sparse.any_sparse:
            past_rows = [(p.n[index], p.k_pe[index]) if p is not None else None for p in pasts]
            qkv = (q_nope, q_pe, n, k_pe)
            dense = partial(_one_dense, attn, qkv, pasts, index, absorbed, backend)
            o = sparse.attend_batch(attn, *qkv, past_rows, dense)
        elif any(starts):
            o = _over_past(attn, q_nope, q_pe, n, k_pe, cu, pasts, index, absorbed, backend)
        elif absorbed:
            o = _absorbed_causal(attn, q_nope, q_pe, n, k_pe, cu)
        else:
            o = attn.expanded(q_nope, q_pe, n, k_pe, cu, backend)
        h = h + stack.reduce(attn.output(o))
        h = h + layer.ffn_output(stack.reduce(layer.mlp(layer.post_attention_layernorm(h))))
        all_n.append(n)
        all_k_pe.append(k_pe)
    last = h if all_logits else h[torch.tensor(cu[1:], device=h.device) - 1]
    keys = sparse.keys if sparse is not None else []
    return PrefillOutput(stack.logits(last), all_n, all_k_pe, h, keys)


def _one_dense(
    attn: MLAttention,
    qkv: tuple[Tensor, Tensor, Tensor, Tensor],
    pasts: list[PastLatents | None],
    layer: int,
    absorbed: bool,
    backend: PrefillAttention,
    prompt: int,
    rows: slice,
) -> Tensor:
    """One prompt's dense attention (its packed `rows` of q_nope, q_pe, n, k_pe)."""
    q_nope, q_pe, n, k_pe = (t[rows] for t in qkv)
    span = [0, rows.stop - rows.start]
    return _over_past(attn, q_nope, q_pe, n, k_pe, span, [pasts[prompt]], layer, absorbed, backend)


def _over_past(
    attn: MLAttention,
    q_nope: Tensor,
    q_pe: Tensor,
    n: Tensor,
    k_pe: Tensor,
    cu: list[int],
    pasts: list[PastLatents | None],
    layer: int,
    absorbed: bool,
    backend: PrefillAttention,
) -> Tensor:
    """Attention for a batch where some prompts continue a cached prefix (or earlier chunks):
    each prompt on its own, a prompt without a past exactly as in a batch without any, one with
    a past in key tiles, never holding its scores over the whole prompt at once: through the
    native kernel where the backend is the native one (common/model/past_native.py), else
    torch's tiled online softmax (common/model/past_attention.py, the reference)."""
    out = []
    for (start, end), past in zip(pairwise(cu), pasts, strict=True):
        rows = slice(start, end)
        if past is None:
            span = [0, end - start]
            o = (
                _absorbed_causal(attn, q_nope[rows], q_pe[rows], n[rows], k_pe[rows], span)
                if absorbed
                else attn.expanded(q_nope[rows], q_pe[rows], n[rows], k_pe[rows], span, backend)
            )
        else:
            p_n, p_k_pe = past.n[layer].to(n.dtype), past.k_pe[layer].to(k_pe.dtype)
            args = (q_nope[rows], q_pe[rows], p_n, p_k_pe, n[rows], k_pe[rows])
            if past_native.usable(backend, *args):
                # Past and new given apart: no copy of the whole past per layer and chunk.
                native = (
                    past_native.native_absorbed_over_past
                    if absorbed
                    else past_native.native_expanded_over_past
                )
                o = native(
                    q_nope[rows],
                    q_pe[rows],
                    (p_n, p_k_pe),
                    (n[rows], k_pe[rows]),
                    attn.kv_b_proj.weight,
                    attn.scale,
                )
            else:
                n_all, k_all = torch.cat([p_n, n[rows]]), torch.cat([p_k_pe, k_pe[rows]])
                over = absorbed_over_past if absorbed else expanded_over_past
                o = over(q_nope[rows], q_pe[rows], n_all, k_all, attn.kv_b_proj.weight, attn.scale)
        out.append(o)
    return torch.cat(out)


def _absorbed_causal(
    attn: MLAttention, q_nope: Tensor, q_pe: Tensor, n: Tensor, k_pe: Tensor, cu: list[int]
) -> Tensor:
    out = []
    for start, end in pairwise(cu):
        length = end - start
        causal = torch.ones(length, length, dtype=torch.bool, device=n.device).tril()
        o = attn.absorbed(
            q_nope[None, start:end],
            q_pe[None, start:end],
            n[None, start:end],
            k_pe[None, start:end],
            causal[None],
        )
        out.append(o[0])
    return torch.cat(out)

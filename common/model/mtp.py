"""DeepSeek-V3's multi-token-prediction (MTP) module: a draft of the token after next.

Module k (k = 0 .. num_nextn_predict_layers - 1) is stored as checkpoint layer
L = num_hidden_layers + k. At position t it reads the main model's last hidden state h_t
(before the final norm) and the embedding of token t+1, and predicts token t+2:

    x_t    = eh_proj([enorm(embed(t+1)); hnorm(h_t)])     # the embedding half first
    h'_t   = DecoderLayer_L(x_t)                          # MLA + MoE or dense, causal
    logits = shared_head.head(shared_head.norm(h'_t))

The concatenation order is the checkpoint's (vLLM and SGLang concatenate the same way; the
V3 report writes the halves the other way round). h'_t feeds the next draft when chained
(`mtp_draft`), and the layer's attention keeps its own latent cache: (n, k_pe) per
position, the latent of position t computed from (h_t, token t+1).

The checkpoint stores an embedding and an output head in every MTP layer; the report says
they are shared with the main model, and the loader keeps one copy when they are equal
(common/loading/mtp_weights.py). Two forms, both on the main model's layer code: a prefill
form over packed prompts (`packed_prefill` on a one-layer stack, so `past` and the expanded
and absorbed paths come with it) and a decode form (one new token per sequence over the
layer's latent cache, absorbed attention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from common.model.args import ModelConfig
from common.model.causal_lm import (
    DecoderLayer,
    DeepseekForCausalLM,
    LatentKV,
    LayerStack,
    PastLatents,
    PrefillOutput,
    decode_layer,
    packed_positions,
    packed_prefill,
)
from common.model.mla import RMSNorm
from common.model.prefill_attention import PrefillAttention, SdpaPrefillAttention
from common.model.rope import RotaryEmbedding

# The MTP layer's tensors that the V3 report says are the main model's: (its name, the main
# model's). A checkpoint may store them in the layer (V3 does) or leave them out.
SHARED_WITH_MAIN = (
    ("embed_tokens.weight", "model.embed_tokens.weight"),
    ("shared_head.head.weight", "lm_head.weight"),
)


def mtp_layer_index(config: ModelConfig, k: int) -> int:
    """The checkpoint layer index of MTP module k."""
    if not 0 <= k < config.num_nextn_predict_layers:
        raise ValueError(f"MTP module {k} is outside 0..{config.num_nextn_predict_layers - 1}")
    return config.num_hidden_layers + k


class SharedHead(nn.Module):
    """`shared_head.norm` then `shared_head.head`: the final norm and the output head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, h: Tensor) -> Tensor:
        return self.head(self.norm(h))


class MTPLayer(DecoderLayer):
    """Checkpoint layer `layer` (>= num_hidden_layers): a decoder layer (MoE or dense by the
    config's rule for that index) plus the fusion in front of it and the head behind it.
    Parameter names are the checkpoint's under `model.layers.{layer}.`."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(config)

    def fuse(self, next_ids: Tensor, hidden: Tensor) -> Tensor:
        """Token ids of t+1 [T] and the hidden state at t [T, D] -> the layer's input [T, D]."""
        return fuse(self, self.embed_tokens(next_ids), hidden)


class FusionParts(Protocol):
    """The modules in front of an MTP layer's decoder layer: the whole layer's, or a rank's
    (common/loading/mtp_weights.py `RankMTPParts`)."""

    @property
    def enorm(self) -> nn.Module: ...

    @property
    def hnorm(self) -> nn.Module: ...

    @property
    def eh_proj(self) -> nn.Module: ...


def fuse(parts: FusionParts, embedded: Tensor, hidden: Tensor) -> Tensor:
    """The embedding of token t+1 [T, D] and the main model's hidden state at t [T, D] ->
    the MTP decoder layer's input [T, D]."""
    e = parts.enorm(embedded)
    return parts.eh_proj(torch.cat([e, parts.hnorm(hidden)], dim=-1))


@dataclass
class MTPOutput:
    logits: Tensor  # [R, V]: the draft distribution of token t+2 at the rows asked for
    hidden: Tensor  # [R, D]: the layer's output before shared_head.norm (chaining reads it)
    n: Tensor  # packed [T, d_c] (prefill) or [B, d_c] (decode): the layer's own latents
    k_pe: Tensor  # packed [T, d_r] or [B, d_r]
    index_keys: list[Tensor] = field(default_factory=list)  # DSA: its indexer's, [T, d_I]


class MTPStack:
    """One MTP layer as a `LayerStack` for `packed_prefill`: its "embedding" is the fused
    input, so the main model's prefill loop (packing, `past`, both attention paths) runs it."""

    def __init__(
        self,
        layer: MTPLayer,
        hidden: Tensor,
        rope: RotaryEmbedding,
        prefill_attention: PrefillAttention,
    ) -> None:
        self.layer, self.hidden = layer, hidden
        self.rope, self.prefill_attention = rope, prefill_attention

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        return [self.layer]

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.layer.fuse(input_ids, self.hidden)

    def reduce(self, partial: Tensor) -> Tensor:
        return partial

    def logits(self, h: Tensor) -> Tensor:
        return self.layer.shared_head(h)


class MTPInput(Protocol):
    """What `mtp_latents` reads of an MTP stack: the whole layer's (`MTPStack`) or a prefill
    rank's (services/prefill/rank/mtp.py)."""

    rope: RotaryEmbedding

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """The one decoder layer (a rank's: its attention keeps the whole latent)."""

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token ids of t+1 [T] -> the layer's fused input [T, D], whole."""


def mtp_latents(
    stack: MTPInput,
    next_ids: Tensor,
    seq_lens: list[int],
    past: Sequence[PastLatents | None] | None = None,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The MTP layer's latents over packed prompts, n [T, d_c] and k_pe [T, d_r], and its
    indexer keys [T, d_I] where it runs a DSA indexer (V3.2's and GLM-5's do): all that a
    prefill needs of the layer (the decode ranks' MTP cache). A layer's latents come from its
    input alone, so its attention and FFN, whose output only the draft logits read, are not
    run; `mtp_prefill` computes the same n and k_pe with the same operations (a test holds
    them bit-equal). `past`: each prompt's cached prefix, for its positions only."""
    *_, positions = packed_positions(next_ids, seq_lens, past)
    cos, sin = stack.rope.cos_sin(positions)
    (layer,) = stack.decoder_layers()
    x = layer.input_layernorm(stack.embed(next_ids))
    n, k_pe = layer.self_attn.latents(x, stack.rope, cos, sin)
    indexer = layer.self_attn.indexer
    return n, k_pe, [indexer.keys(x, cos, sin)] if indexer is not None else []


def mtp_prefill(
    layer: MTPLayer,
    rope: RotaryEmbedding,
    next_ids: Tensor,
    hidden: Tensor,
    seq_lens: list[int],
    *,
    all_logits: bool = False,
    absorbed: bool = False,
    past: Sequence[PastLatents | None] | None = None,
    prefill_attention: PrefillAttention | None = None,
) -> MTPOutput:
    """The MTP layer over packed prompts: row t of prompt p reads its token t+1 (`next_ids`,
    the prompt shifted by one with the first sampled token last) and the main model's hidden
    state at t (`hidden`, all rows). `past`: per prompt, the layer's own cached latents
    (one layer) or None. Logits and hidden at each prompt's last row, or every row."""
    if next_ids.shape[0] != hidden.shape[0]:
        raise ValueError("next_ids and hidden must cover the same packed rows")
    stack = MTPStack(layer, hidden, rope, prefill_attention or SdpaPrefillAttention())
    out: PrefillOutput = packed_prefill(
        stack, next_ids, seq_lens, all_logits=all_logits, absorbed=absorbed, past=past
    )
    assert out.hidden is not None
    hidden = out.hidden
    if not all_logits:
        hidden = hidden[torch.tensor(seq_lens, device=hidden.device).cumsum(0) - 1]
    return MTPOutput(out.logits, hidden, out.n[0], out.k_pe[0], out.index_keys)


def prompt_next_ids(ids: Tensor, seq_lens: Sequence[int], firsts: Sequence[int]) -> Tensor:
    """Packed prompts [T] -> each row's token t + 1: the prompt shifted by one, each prompt's
    first sampled token last (what `mtp_prefill` reads)."""
    out = torch.empty_like(ids)
    start = 0
    for length, first in zip(seq_lens, firsts, strict=True):
        out[start : start + length - 1] = ids[start + 1 : start + length]
        out[start + length - 1] = first
        start += length
    return out


@torch.inference_mode()
def prefill_with_mtp(
    main: LayerStack,
    mtp_stack: Callable[[Tensor], MTPInput],
    input_ids: Tensor,
    seq_lens: list[int],
    next_ids: Tensor,
    *,
    all_logits: bool = False,
    absorbed: bool = False,
    past: Sequence[PastLatents | None] | None = None,
) -> PrefillOutput:
    """A serving prefill with the MTP layer before the first tokens are sampled: the main
    layers, then the MTP layer's latents (`mtp_latents` of `mtp_stack` of their last hidden
    state: the whole layer's `MTPStack`, or a rank's share) over the same prompts, one more
    layer.
    `next_ids`: each row's next prompt token, and at a prompt's last row its own token
    (`prompt_own_next_ids`) in place of the first sampled one; that row's latent is the only
    one that differs, and the decode ranks' first draft pass writes it again from the first
    token before it is read (services/decode/rank/draft_pass.py). `past`: each prompt's
    cached latents, the MTP layer's last."""
    layers = len(main.decoder_layers())
    main_past = None if past is None else [split_past(p, 0, layers) for p in past]
    out = packed_prefill(
        main, input_ids, seq_lens, all_logits=all_logits, absorbed=absorbed, past=main_past
    )
    assert out.hidden is not None
    own = None if past is None else [split_past(p, layers, layers + 1) for p in past]
    n, k_pe, keys = mtp_latents(mtp_stack(out.hidden), next_ids, seq_lens, own)
    index_keys = [*out.index_keys, *keys]
    return PrefillOutput(out.logits, [*out.n, n], [*out.k_pe, k_pe], out.hidden, index_keys)


def whole_prefill_with_mtp(
    model: DeepseekForCausalLM,
    layer: MTPLayer,
    input_ids: Tensor,
    seq_lens: list[int],
    next_ids: Tensor,
    *,
    all_logits: bool = False,
    past: Sequence[PastLatents | None] | None = None,
) -> PrefillOutput:
    """`prefill_with_mtp` on the whole model and its whole MTP layer (a tp = 1 prefill)."""
    return prefill_with_mtp(
        model,
        lambda hidden: MTPStack(layer, hidden, model.rope, model.prefill_attention),
        input_ids,
        seq_lens,
        next_ids,
        all_logits=all_logits,
        past=past,
    )


def prompt_own_next_ids(ids: Tensor, seq_lens: Sequence[int]) -> Tensor:
    """Packed prompts [T] -> each row's token t + 1, each prompt's last row its own token
    (what the MTP layer reads over a prompt before its first token is sampled)."""
    next_ids = ids.clone()
    next_ids[:-1] = ids[1:]
    ends = torch.tensor(seq_lens, device=ids.device).cumsum(0) - 1
    next_ids[ends] = ids[ends]
    return next_ids


def split_past(past: PastLatents | None, start: int, end: int) -> PastLatents | None:
    """Layers [start, end) of a cached prefix's latents, and their indexer keys (DSA: the
    layers from `start` on are the main model's last ones or MTP layers; each MTP layer
    keeps one key layer, after the main model's)."""
    if past is None:
        return None
    keys, total = past.index_keys, len(past.n)
    after = len(keys) - (total - end)  # the key layers of layers before `end`
    before = len(keys) - (total - start) if start else 0
    return PastLatents(past.n[start:end], past.k_pe[start:end], keys[before:after])


def mtp_decode(
    layer: MTPLayer,
    rope: RotaryEmbedding,
    next_ids: Tensor,
    hidden: Tensor,
    positions: Tensor,
    kv: LatentKV,
    cache_layer: int = 0,
) -> MTPOutput:
    """One new position per sequence: token t+1 [B], hidden state at t [B, D] and t itself
    [B] -> the draft of t+2. The new latents are written to `kv` layer `cache_layer` at t,
    then the layer attends over positions 0..t there."""
    cos, sin = rope.cos_sin(positions)
    x = layer.fuse(next_ids, hidden)
    latents = _Recorder(kv)
    h = decode_layer(layer, cache_layer, x, rope, (cos, sin), positions, latents)
    return MTPOutput(layer.shared_head(h), h, latents.n, latents.k_pe)


def mtp_draft(
    layers: Sequence[MTPLayer],
    rope: RotaryEmbedding,
    next_ids: Tensor,
    hidden: Tensor,
    positions: Tensor,
    caches: Sequence[LatentKV],
    k: int,
) -> Tensor:
    """k greedy drafts per sequence, chained, each fed the previous draft and the previous
    module's hidden state. The modules run in order at position t, as the V3 report chains
    them (module j reads module j-1's hidden state at t and token t+j+1); past the last
    module, the last one runs again at t+1, t+2, ... (V3 ships one module, which vLLM and
    SGLang reuse this way). Each module writes its latent wherever it runs, into its own
    cache; latents from drafted tokens are provisional (the next step writes them from
    accepted tokens). Returns the drafts [B, k] of tokens t+2 .. t+k+1."""
    drafts = []
    ids, h = next_ids, hidden
    last = len(layers) - 1
    for j in range(k):
        module = min(j, last)
        out = mtp_decode(layers[module], rope, ids, h, positions + max(0, j - last), caches[module])
        ids, h = out.logits.argmax(-1), out.hidden
        drafts.append(ids)
    return torch.stack(drafts, dim=1)


class _Recorder:
    """A `LatentKV` that passes through to another and keeps the latents written."""

    def __init__(self, inner: LatentKV) -> None:
        self.inner = inner
        self.n = torch.empty(0)
        self.k_pe = torch.empty(0)

    def write(self, layer: int, positions: Tensor, n: Tensor, k_pe: Tensor) -> None:
        self.n, self.k_pe = n, k_pe
        self.inner.write(layer, positions, n, k_pe)

    def read(self, layer: int, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.inner.read(layer, positions)

    def write_keys(self, layer: int, positions: Tensor, keys: Tensor) -> None:
        self.inner.write_keys(layer, positions, keys)

    def read_keys(self, layer: int, positions: Tensor) -> Tensor:
        return self.inner.read_keys(layer, positions)

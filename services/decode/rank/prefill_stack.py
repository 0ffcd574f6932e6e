"""A decode rank's share of the model as a prefill runs it: the `LayerStack` that
`packed_prefill` (common/model/causal_lm.py) runs when the group prefills a prompt itself
(rank/prefill_pass.py).

Each layer is the whole model's `DecoderLayer` over the rank's share. The norms and the FFN
slice are the rank's own modules (a prefill rank takes the same FFN split). The attention is
that of the rank's prefill heads (`ParallelConfig.prefill_heads`) over the whole latent, as a
prefill rank's (MLA-TP): their query rows and o_proj columns are views of the rank's own (a
sub-range of its head group's), the latent projection is the rank's whole kv_a, and
kv_b_proj's rows of those heads are its W_UK / W_UV joined per head where the rank holds
every latent column. Where it holds a slice of them (TPLA, r > 1) those rows are read from
the checkpoint, and in sliced-RMSNorm mode the whole kv_a too: the weights a local prefill
adds to a rank. Weights held elsewhere are joined when read (`JoinedRows`), never copied to
stay. The embedding is the rank's (replicated), the logits its vocabulary rows padded to the
group's width, and `reduce` its group's all-reduce. A rank holding the MTP module prefills its
latents too (`RankPrefillMTP`: `mtp_latents` reads the layer's input norm and latent
projection, the fused input of the rank's replicated embedding and the main model's hidden
state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.group.comm import Comm
from common.loading.rank_slices import place_linear
from common.loading.weights import WeightSource
from common.model.causal_lm import DecoderLayer
from common.model.fp8 import DequantizedOnUse, Weight, dense
from common.model.mla import MLAttention, RMSNorm
from common.model.mtp import fuse
from common.model.prefill_attention import PrefillAttention
from common.model.rope import RotaryEmbedding
from common.parallel import ParallelConfig, span
from services.decode.rank.layers import RankAttention, RankLayer
from services.decode.rank.mtp import RankMTP
from services.decode.rank.rank_model import RankModel


class JoinedRows(nn.Module):
    """A linear weight made of row blocks held by other modules, joined when `weight` is read
    (MLAttention reads kv_a and kv_b as tensors, once a layer): nothing held twice. The
    parts are kept as a plain list, so the rank's parameters are not counted again."""

    def __init__(self, parts: list[Weight]) -> None:
        super().__init__()
        self.parts = parts

    @property
    def weight(self) -> Tensor:
        return torch.cat([dense(p) for p in self.parts])


def prefill_attention(
    src: WeightSource, index: int, attn: RankAttention, heads: slice
) -> MLAttention:
    """MLA over the whole latent for `heads` (within the rank's head group), from the rank's
    own attention weights and, for what it lacks, the checkpoint (`src`)."""
    c = src.config
    p = f"model.layers.{index}.self_attn."
    qk, kv = c.qk_nope_head_dim + c.qk_rope_head_dim, c.qk_nope_head_dim + c.v_head_dim
    own = slice(heads.start - attn.head_offset, heads.stop - attn.head_offset)
    with torch.device("meta"):
        mla = MLAttention(dataclasses.replace(c, num_attention_heads=span(heads)))
    q_b: Weight
    if isinstance(attn.q_b, Tensor):
        q_b = attn.q_b[own.start * qk : own.stop * qk]
    else:
        name = "q_proj.weight" if attn.q_a is None else "q_b_proj.weight"
        q_b = src.linear(p + name, slice(heads.start * qk, heads.stop * qk))
    if attn.q_a is None:
        place_linear(mla, "q_proj", q_b)
    else:
        assert attn.q_a_norm is not None
        place_linear(mla, "q_a_proj", attn.q_a)
        mla.q_a_layernorm = attn.q_a_norm
        place_linear(mla, "q_b_proj", q_b)
    latent = (
        attn.kv_a_latent
        if attn.exact_rmsnorm
        else src.linear(p + "kv_a_proj_with_mqa.weight", slice(0, c.kv_lora_rank))
    )
    mla.kv_a_proj_with_mqa = JoinedRows([latent, attn.kv_a_rope])  # type: ignore[assignment]
    with torch.device("meta"):
        mla.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
    mla.kv_a_layernorm.weight = attn.gamma
    if attn.shard.width == c.kv_lora_rank:  # the rank's W_UK / W_UV are whole
        uk, uv = dense(attn.uk)[own], dense(attn.uv)[own]
        mla.kv_b_proj = JoinedRows([torch.cat((uk, uv), dim=1).flatten(0, 1)])  # type: ignore[assignment]
    else:
        kv_rows = slice(heads.start * kv, heads.stop * kv)
        place_linear(mla, "kv_b_proj", src.linear(p + "kv_b_proj.weight", kv_rows))
    w_o: Weight
    if isinstance(attn.w_o, Tensor):
        w_o = attn.w_o[:, own.start * c.v_head_dim : own.stop * c.v_head_dim]
    else:
        cols = slice(heads.start * c.v_head_dim, heads.stop * c.v_head_dim)
        w_o = src.linear(p + "o_proj.weight", cols=cols)
    place_linear(mla, "o_proj", w_o)
    return mla


def prefill_layer(src: WeightSource, index: int, layer: RankLayer, heads: slice) -> DecoderLayer:
    """Decoder layer `index` as a prefill runs it on this rank: `layer`'s norms and FFN, and
    the attention of `heads` over the whole latent (`prefill_attention`)."""
    with torch.device("meta"):
        local = DecoderLayer(src.config, index)
    local.input_layernorm = layer.input_norm
    local.self_attn = prefill_attention(src, index, layer.attn, heads)
    local.post_attention_layernorm = layer.post_norm
    local.mlp = layer.ffn
    local.post_mlp_layernorm = layer.post_ffn_norm
    return local


class RankPrefillMTP:
    """The rank's MTP module 0 as a prefill reads it: its decoder layer as `prefill_layer`
    builds it and the parts around it (the rank's own)."""

    def __init__(self, src: WeightSource, mtp: RankMTP, heads: slice) -> None:
        self.layer = prefill_layer(src, mtp.cache_layer, mtp.layer, heads)
        self.parts = mtp.parts

    def over(self, hidden: Tensor, rope: RotaryEmbedding) -> MtpInput:
        """The layer over a piece whose main model's hidden state is `hidden` [T, D]."""
        return MtpInput(self, hidden, rope)


class MtpInput:
    """What `mtp_latents` reads (common/model/mtp.py `MTPInput`) on this rank."""

    def __init__(self, mtp: RankPrefillMTP, hidden: Tensor, rope: RotaryEmbedding) -> None:
        self.mtp, self.hidden, self.rope = mtp, hidden, rope

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        return [self.mtp.layer]

    def embed(self, input_ids: Tensor) -> Tensor:
        parts = self.mtp.parts
        return fuse(parts, parts.embed(input_ids), self.hidden)


class RankPrefillStack:
    """The rank's `LayerStack` (see above), built once beside its `RankModel`."""

    def __init__(
        self,
        src: WeightSource,
        model: RankModel,
        parallel: ParallelConfig,
        comm: Comm,
        attention: PrefillAttention,
    ) -> None:
        c = model.config
        heads = parallel.prefill_heads(model.rank, c.num_attention_heads)
        self.layers = [prefill_layer(src, n, layer, heads) for n, layer in enumerate(model.layers)]
        self.mtp = None if model.mtp is None else RankPrefillMTP(src, model.mtp, heads)
        self.model, self.comm = model, comm
        self.prefill_attention = attention
        # A quantized weight read for the prefill (its heads' rows of a quantized q_b, say)
        # dequantizes into the rank's workspace: the rank runs one step at a time.
        workspace = next(
            (m.workspace for m in model.modules() if isinstance(m, DequantizedOnUse)), None
        )
        mtp = [] if self.mtp is None else [self.mtp.layer]
        for layer in [*self.layers, *mtp]:
            for module in layer.self_attn.modules():
                if workspace is not None and isinstance(module, DequantizedOnUse):
                    module.workspace = workspace

    @property
    def rope(self) -> RotaryEmbedding:
        return self.model.rope

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        return self.layers

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.embed(input_ids)

    def reduce(self, partial: Tensor) -> Tensor:
        self.comm.sum_(partial)
        return partial

    def logits(self, h: Tensor) -> Tensor:
        """The rank's vocabulary rows of the logits, padded to the group's common width (as a
        decode step's, for the same gather)."""
        model = self.model
        logits = F.linear(model.norm(h), model.lm_head)
        pad = model.vocab_size_padded - logits.shape[1]
        return F.pad(logits, (0, pad)) if pad else logits

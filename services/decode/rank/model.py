"""One decode rank's share of the model and its decode step.

Rank (i, j) of a group with `tp = r * m` ranks holds latent slice i and head group j
(DESIGN §1 "TPLA decode"): the W_UK / W_UV columns of S_i for its heads, its heads' rows of
the query projection and columns of o_proj, a 1/tp slice of every FFN (dense MLP, each routed
expert and the shared experts) and a 1/tp slice of the vocabulary. Norms, the router, the
small kv_a projection and the embedding are replicated. Each layer does two all-reduces of
the hidden state (after attention, after the FFN); logits are gathered to the leader.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.kv.paged_cache import CacheLayout, CacheReads, PagedLatentCache
from common.loading.weights import ModelWeights, WeightSource
from common.model.mla import Linear, RMSNorm, project_latent, project_queries
from common.model.model import DeepseekForCausalLM
from common.model.moe import MLP, MoE
from common.model.rope import RotaryEmbedding
from common.model.sp import merge_partials
from common.model.tpla import LatentShard, latent_norm, latent_slice_attention
from common.parallel import ParallelConfig, RmsNormMode
from services.decode.group.comm import Comm
from services.decode.rank.backends import DecodeBackend, TorchBackend

log = logging.getLogger(__name__)


class RankAttention(nn.Module):
    """A rank's share of one layer's attention weights and the math around its kernel."""

    def __init__(
        self,
        src: WeightSource,
        layer: int,
        heads: slice,
        shard: LatentShard,
        mode: RmsNormMode,
    ) -> None:
        super().__init__()
        c = src.config
        p = f"model.layers.{layer}.self_attn."
        self.d_n, self.d_r, self.d_v, self.d_c = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        )
        self.num_heads = heads.stop - heads.start
        self.head_offset = heads.start
        self.scale = c.softmax_scale
        self.shard = shard
        self.mode = mode
        qk = self.d_n + self.d_r
        rows = slice(heads.start * qk, heads.stop * qk)
        if c.q_lora_rank is not None:
            self.q_a: nn.Parameter | None = nn.Parameter(src.tensor(p + "q_a_proj.weight"))
            self.q_a_norm: RMSNorm | None = _norm(src, p + "q_a_layernorm.weight", c.rms_norm_eps)
            self.q_b = nn.Parameter(src.tensor(p + "q_b_proj.weight", rows))
        else:
            self.q_a, self.q_a_norm = None, None
            self.q_b = nn.Parameter(src.tensor(p + "q_proj.weight", rows))
        kv_a = p + "kv_a_proj_with_mqa.weight"
        # Exact mode needs the whole (small) latent projection to normalize exactly; sliced
        # mode holds only its slice's rows. The rope rows are replicated either way.
        exact = mode is RmsNormMode.EXACT
        latent_rows = slice(0, self.d_c) if exact else slice(shard.start, shard.end)
        self.kv_a_latent = nn.Parameter(src.tensor(kv_a, latent_rows))
        self.kv_a_rope = nn.Parameter(src.tensor(kv_a, slice(self.d_c, None)))
        self.gamma = nn.Parameter(src.tensor(p + "kv_a_layernorm.weight"))
        self.eps = c.rms_norm_eps
        # W_UK / W_UV of these heads, latent columns S_i: rows of kv_b_proj [h (d_n + d_v), w].
        kv = self.d_n + self.d_v
        w_kv = src.tensor(
            p + "kv_b_proj.weight",
            slice(heads.start * kv, heads.stop * kv),
            slice(shard.start, shard.end),
        ).view(self.num_heads, kv, shard.width)
        self.w_uk = nn.Parameter(w_kv[:, : self.d_n].contiguous())
        self.w_uv = nn.Parameter(w_kv[:, self.d_n :].contiguous())
        del w_kv
        self.w_o = nn.Parameter(
            src.tensor(
                p + "o_proj.weight", cols=slice(heads.start * self.d_v, heads.stop * self.d_v)
            )
        )

    @property
    def exact_rmsnorm(self) -> bool:
        return self.mode is RmsNormMode.EXACT

    def queries(
        self, x: Tensor, rope: RotaryEmbedding, cos: Tensor, sin: Tensor, linear: Linear
    ) -> tuple[Tensor, Tensor]:
        return project_queries(
            x, self.q_a, self.q_a_norm, self.q_b, (self.d_n, self.d_r), rope, cos, sin, linear
        )

    def new_latent(
        self, x: Tensor, rope: RotaryEmbedding, cos: Tensor, sin: Tensor, linear: Linear
    ) -> tuple[Tensor, Tensor]:
        """This rank's slice n[S_i] and the rotated k_pe of new tokens."""
        norm = latent_norm(self.gamma, self.eps, self.shard, self.mode)
        return project_latent(x, self.kv_a_latent, self.kv_a_rope, norm, rope, cos, sin, linear)

    def attend(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        reads: CacheReads,
        backend: DecodeBackend,
    ) -> Tensor:
        """TPLA / MLA-TP: [B, h, *] queries over this rank's latent slice of layer `index`
        -> partial hidden state [B, D]; `attend_reference` is the same math unfused."""
        o = backend.attention(self, q_nope, q_pe, cache, index, reads)
        return backend.linear(o.reshape(o.shape[0], -1), self.w_o)

    def attend_reference(
        self, q_nope: Tensor, q_pe: Tensor, n: Tensor, k_pe: Tensor, valid: Tensor
    ) -> Tensor:
        """`attend` on per-token gathered n [B, T, w], k_pe [B, T, d_r] and a mask [B, T]."""
        o = latent_slice_attention(
            q_nope[:, None],
            q_pe[:, None],
            n,
            k_pe,
            valid[:, None],
            self.w_uk,
            self.w_uv,
            self.scale,
            self.shard.beta,
        )[:, 0]
        return F.linear(o.reshape(o.shape[0], -1), self.w_o)

    def attend_sp(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        cache: PagedLatentCache,
        index: int,
        reads: CacheReads,
        comm: Comm,
        backend: DecodeBackend,
    ) -> Tensor:
        """SP: every head over this rank's token chunks, merged exactly across ranks."""
        b = q_nope.shape[0]
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope, self.w_uk)
        # Every rank needs every head's query for its own tokens: gather the head groups.
        q_all = comm.gather_heads(torch.cat((q_lat, q_pe), dim=-1))
        q_lat_all, q_pe_all = q_all.split([self.d_c, self.d_r], dim=-1)
        u, m, l = backend.partial_attention(q_lat_all, q_pe_all, cache, index, reads, self.scale)
        global_max = m.clone()
        comm.max_(global_max)
        u, l = merge_partials(u, m, l, global_max)
        packed = torch.cat((u, l[..., None].to(u.dtype)), dim=-1)
        comm.sum_(packed)
        heads = slice(self.head_offset, self.head_offset + self.num_heads)
        u_mine = packed[:, heads, : self.d_c] / packed[:, heads, self.d_c :]
        o = torch.einsum("bhc,hvc->bhv", u_mine, self.w_uv)
        return backend.linear(o.reshape(b, -1), self.w_o)


def _norm(src: WeightSource, name: str, eps: float) -> RMSNorm:
    weight = src.tensor(name)
    with torch.device("meta"):
        norm = RMSNorm(weight.shape[0], eps)
    norm.weight = nn.Parameter(weight)
    return norm


def _mlp(src: WeightSource, prefix: str, cols: slice) -> MLP:
    """Rows `cols` of gate / up and columns `cols` of down (a slice of the intermediate dim)."""
    gate = src.tensor(prefix + "gate_proj.weight", cols)
    with torch.device("meta"):
        local = MLP(gate.shape[1], gate.shape[0])
    local.gate_proj.weight = nn.Parameter(gate)
    local.up_proj.weight = nn.Parameter(src.tensor(prefix + "up_proj.weight", cols))
    local.down_proj.weight = nn.Parameter(src.tensor(prefix + "down_proj.weight", cols=cols))
    return local


def _shard_ffn(src: WeightSource, layer: int, parallel: ParallelConfig, rank: int) -> nn.Module:
    """A 1/tp slice of a dense MLP or of every expert of a MoE (intermediate dimension)."""
    c = src.config
    p = f"model.layers.{layer}.mlp."
    if not c.is_moe_layer(layer):
        return _mlp(src, p, parallel.ffn_columns(rank, c.intermediate_size))
    cols = parallel.expert_columns(rank, c.moe_intermediate_size)
    with torch.device("meta"):
        local = MoE(dataclasses.replace(c, moe_intermediate_size=cols.stop - cols.start))
    # The router runs in float32 whatever the serving dtype (its scores pick the experts).
    local.gate.weight = nn.Parameter(src.tensor(p + "gate.weight").float())
    if c.topk_method == "noaux_tc":
        bias = src.tensor(p + "gate.e_score_correction_bias").float()
        local.gate.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
    local.experts.gate_up_proj = nn.Parameter(src.gate_up(p + "experts", cols))
    local.experts.down_proj = nn.Parameter(src.down(p + "experts", cols))
    if c.n_shared_experts:
        cols = parallel.shared_expert_columns(rank, c.moe_intermediate_size, c.n_shared_experts)
        local.shared_experts = _mlp(src, p + "shared_experts.", cols)
    return local


class RankLayer(nn.Module):
    def __init__(self, src: WeightSource, layer: int, attn: RankAttention, ffn: nn.Module) -> None:
        super().__init__()
        eps, p = src.config.rms_norm_eps, f"model.layers.{layer}."
        self.input_norm = _norm(src, p + "input_layernorm.weight", eps)
        self.attn = attn
        self.post_norm = _norm(src, p + "post_attention_layernorm.weight", eps)
        self.ffn = ffn


class RankModel(nn.Module):
    """Everything one rank needs for decode, read from a `WeightSource`: a checkpoint (each
    tensor sliced as it is read) or an already loaded full model.

    The step is device-generic PyTorch; what a kernel can speed up goes through the rank's
    `DecodeBackend` (`use_backend`), chosen once at start-up.
    """

    def __init__(
        self,
        source: WeightSource | DeepseekForCausalLM,
        parallel: ParallelConfig,
        rank: int,
        shards_per_layer: list[list[LatentShard]],
        backend: DecodeBackend | None = None,
    ) -> None:
        super().__init__()
        src = ModelWeights(source) if isinstance(source, DeepseekForCausalLM) else source
        c = src.config
        self.config, self.parallel, self.rank = c, parallel, rank
        i, _ = parallel.coords(rank)
        heads = parallel.heads(rank, c.num_attention_heads)
        self.layers = nn.ModuleList(
            RankLayer(
                src,
                n,
                RankAttention(src, n, heads, shards_per_layer[n][i], parallel.rmsnorm),
                _shard_ffn(src, n, parallel, rank),
            )
            for n in range(c.num_hidden_layers)
        )
        self.embed = nn.Embedding.from_pretrained(
            src.tensor("model.embed_tokens.weight"), freeze=False
        )
        self.norm = _norm(src, "model.norm.weight", c.rms_norm_eps)
        self.vocab_size_padded = parallel.padded_vocab(c.vocab_size)
        rows = parallel.vocab_rows(rank, c.vocab_size)
        self.lm_head = nn.Parameter(src.tensor("lm_head.weight", rows))
        self.rope = RotaryEmbedding(c, self.lm_head.device)
        self.latent_width = shards_per_layer[0][i].width
        self.backend: DecodeBackend = TorchBackend()
        self.use_backend(backend or TorchBackend())

    @property
    def device(self) -> torch.device:
        return self.lm_head.device

    def place(self, device: torch.device) -> None:
        """Move the weights and the rotary tables to `device`; rebinds the backend."""
        self.to(device)
        self.rope = RotaryEmbedding(self.config, device)
        self.use_backend(self.backend)

    def use_backend(self, backend: DecodeBackend) -> DecodeBackend:
        """Run the step's kernels on `backend` from now on (bound to this model's weights)."""
        backend.bind(self)
        self.backend = backend
        return backend

    def cache_layout(self, block_size: int, dtype: torch.dtype) -> CacheLayout:
        return CacheLayout(
            self.config.num_hidden_layers,
            self.latent_width,
            self.config.qk_rope_head_dim,
            block_size,
            dtype,
        )

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    @torch.inference_mode()
    def decode_step(
        self,
        token_ids: Tensor,
        positions: Tensor,
        write_slots: Tensor,
        reads: CacheReads,
        cache: PagedLatentCache,
        comm: Comm,
    ) -> Tensor:
        """One token per sequence -> this rank's padded vocab slice of logits [B, V/tp].

        `write_slots` [B] is where each new token's latent goes on this rank (-1: another
        rank owns it, in SP mode); `reads` addresses the cached history (its slots / valid
        mask in SP mode). Every input is on the model's device.
        """
        if self.parallel.sp and (reads.slots is None or reads.valid is None):
            raise ValueError("an SP decode step reads per-token slots: use CacheReads.tokens")
        be, rope = self.backend, self.rope
        cos, sin = rope.cos_sin(positions)
        h = self.embed(token_ids)
        for index, layer in enumerate(self.layers):
            q_nope, q_pe = be.attention_inputs(index, layer, rope, h, cos, sin, cache, write_slots)
            if self.parallel.sp:
                y = layer.attn.attend_sp(q_nope, q_pe, cache, index, reads, comm, be)
            else:
                y = layer.attn.attend(q_nope, q_pe, cache, index, reads, be)
            comm.sum_(y)
            h = h + y
            f = be.ffn(layer.ffn, be.rms_norm(layer.post_norm, h))
            comm.sum_(f)
            h = h + f
        logits = be.linear(be.rms_norm(self.norm, h), self.lm_head)
        pad = self.vocab_size_padded - logits.shape[1]
        return F.pad(logits, (0, pad)) if pad else logits

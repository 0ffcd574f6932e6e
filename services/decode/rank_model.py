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
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.kv.paged_cache import CacheLayout, CacheReads, PagedLatentCache
from common.model.mla import RMSNorm
from common.model.model import DeepseekForCausalLM
from common.model.moe import MLP, MoE
from common.model.rope import RotaryEmbedding
from common.model.sp import merge_partials
from common.model.tpla import LatentShard, RmsNormMode, latent_slice_attention, sliced_rmsnorm
from services.decode.backends import DecodeBackend, TorchBackend
from services.decode.comm import Comm
from services.decode.config import ParallelConfig, split_range

Linear = Callable[[Tensor, Tensor], Tensor]

log = logging.getLogger(__name__)


class RankAttention(nn.Module):
    """A rank's share of one layer's attention weights and the math around its kernel."""

    def __init__(
        self, full: nn.Module, heads: slice, shard: LatentShard, mode: RmsNormMode
    ) -> None:
        super().__init__()
        a = full
        self.d_n, self.d_r, self.d_v, self.d_c = a.d_n, a.d_r, a.d_v, a.d_c
        self.num_heads = heads.stop - heads.start
        self.head_offset = heads.start
        self.scale = a.scale
        self.shard = shard
        self.exact_rmsnorm = mode is RmsNormMode.EXACT
        qk = a.d_n + a.d_r
        rows = slice(heads.start * qk, heads.stop * qk)
        if a.q_lora:
            self.q_a = nn.Parameter(a.q_a_proj.weight.detach().clone())
            self.q_a_norm = RMSNorm(a.q_a_proj.weight.shape[0], a.q_a_layernorm.eps)
            self.q_a_norm.weight = nn.Parameter(a.q_a_layernorm.weight.detach().clone())
            self.q_b = nn.Parameter(a.q_b_proj.weight[rows].detach().clone())
        else:
            self.q_a, self.q_a_norm = None, None
            self.q_b = nn.Parameter(a.q_proj.weight[rows].detach().clone())
        w_kva = a.kv_a_proj_with_mqa.weight.detach()
        # Exact mode needs the whole (small) latent projection to normalize exactly; sliced
        # mode holds only its slice's rows. The rope rows are replicated either way.
        latent_rows = slice(0, a.d_c) if self.exact_rmsnorm else slice(shard.start, shard.end)
        self.kv_a_latent = nn.Parameter(w_kva[latent_rows].clone())
        self.kv_a_rope = nn.Parameter(w_kva[a.d_c :].clone())
        self.gamma = nn.Parameter(a.kv_a_layernorm.weight.detach().clone())
        self.eps = a.kv_a_layernorm.eps
        cols = slice(shard.start, shard.end)
        self.w_uk = nn.Parameter(a.w_uk()[heads, :, cols].detach().clone())
        self.w_uv = nn.Parameter(a.w_uv()[heads, :, cols].detach().clone())
        w_o = a.o_proj.weight.detach().view(-1, a.num_heads, a.d_v)
        self.w_o = nn.Parameter(w_o[:, heads].reshape(w_o.shape[0], -1).clone())

    def queries(
        self, x: Tensor, rope: RotaryEmbedding, cos: Tensor, sin: Tensor, linear: Linear
    ) -> tuple[Tensor, Tensor]:
        if self.q_a is not None:
            x = self.q_a_norm(linear(x, self.q_a))
        q = linear(x, self.q_b).view(x.shape[0], self.num_heads, self.d_n + self.d_r)
        q_nope, q_pe = q.split([self.d_n, self.d_r], dim=-1)
        return q_nope, rope.apply(q_pe, cos[:, None], sin[:, None])

    def new_latent(
        self, x: Tensor, rope: RotaryEmbedding, cos: Tensor, sin: Tensor, linear: Linear
    ) -> tuple[Tensor, Tensor]:
        """This rank's slice n[S_i] and the rotated k_pe of new tokens."""
        k_pe = rope.apply(linear(x, self.kv_a_rope), cos, sin)
        lat = linear(x, self.kv_a_latent)
        s = self.shard
        if self.exact_rmsnorm:
            lf = lat.float()
            n = lf * torch.rsqrt(lf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (self.gamma * n.to(x.dtype))[:, s.start : s.end], k_pe
        return sliced_rmsnorm(lat, self.gamma[s.start : s.end], self.eps, s.rms_correction), k_pe

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


def _shard_ffn(module: nn.Module, config, rank: int, tp: int) -> nn.Module:
    """A 1/tp slice of a dense MLP or of every expert of a MoE (intermediate dimension)."""
    if isinstance(module, MoE):
        inter = config.moe_intermediate_size
        cols = split_range(inter, tp, rank, "moe_intermediate_size")
        local = MoE(dataclasses.replace(config, moe_intermediate_size=cols.stop - cols.start))
        local.gate.load_state_dict(module.gate.state_dict())
        gu = module.experts.gate_up_proj.detach()
        local.experts.gate_up_proj = nn.Parameter(
            torch.cat((gu[:, :inter][:, cols], gu[:, inter:][:, cols]), dim=1).clone()
        )
        local.experts.down_proj = nn.Parameter(
            module.experts.down_proj.detach()[:, :, cols].clone()
        )
        if module.shared_experts is not None:
            local.shared_experts = _shard_ffn(module.shared_experts, config, rank, tp)
        return local
    inter = module.gate_proj.weight.shape[0]
    cols = split_range(inter, tp, rank, "intermediate_size")
    local = MLP(module.gate_proj.weight.shape[1], cols.stop - cols.start)
    local.gate_proj.weight = nn.Parameter(module.gate_proj.weight.detach()[cols].clone())
    local.up_proj.weight = nn.Parameter(module.up_proj.weight.detach()[cols].clone())
    local.down_proj.weight = nn.Parameter(module.down_proj.weight.detach()[:, cols].clone())
    return local


class RankLayer(nn.Module):
    def __init__(self, attn: RankAttention, layer: nn.Module, ffn: nn.Module) -> None:
        super().__init__()
        self.input_norm = layer.input_layernorm
        self.attn = attn
        self.post_norm = layer.post_attention_layernorm
        self.ffn = ffn


class RankModel(nn.Module):
    """Everything one rank needs for decode; built from the full model, which is then freed.

    The step is device-generic PyTorch; what a kernel can speed up goes through the rank's
    `DecodeBackend` (`use_backend`), chosen once at start-up.
    """

    def __init__(
        self,
        full: DeepseekForCausalLM,
        parallel: ParallelConfig,
        rank: int,
        shards_per_layer: list[list[LatentShard]],
        backend: DecodeBackend | None = None,
    ) -> None:
        super().__init__()
        c = full.config
        self.config, self.parallel, self.rank = c, parallel, rank
        i, j = parallel.coords(rank)
        heads = split_range(c.num_attention_heads, parallel.head_groups, j, "num_attention_heads")
        self.layers = nn.ModuleList(
            RankLayer(
                RankAttention(layer.self_attn, heads, shards_per_layer[n][i], parallel.rmsnorm),
                layer,
                _shard_ffn(layer.mlp, c, rank, parallel.tp),
            )
            for n, layer in enumerate(full.model.layers)
        )
        self.embed = full.model.embed_tokens
        self.norm = full.model.norm
        vocab = torch.tensor_split(torch.arange(c.vocab_size), parallel.tp)
        self.vocab_size_padded = max(len(v) for v in vocab)
        self.lm_head = nn.Parameter(full.lm_head.weight.detach()[vocab[rank]].clone())
        self.rope = RotaryEmbedding(c, full.lm_head.weight.device)
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

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
import enum
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.kv.paged_cache import BlockRows, CacheLayout, CacheReads, PagedLatentCache
from common.model.mla import RMSNorm
from common.model.model import DeepseekForCausalLM
from common.model.moe import MLP, MoE
from common.model.rope import RotaryEmbedding
from common.model.sp import merge_partials, partial_attention
from common.model.tpla import (
    LatentShard,
    RmsNormMode,
    fused_slice_attention,
    latent_slice_attention,
    sliced_rmsnorm,
)
from common.native import decode_layer, small_gemm
from common.native import latent_attention as native
from services.decode.comm import Comm
from services.decode.rank_ffn import ffn_forward

log = logging.getLogger(__name__)


class ParallelError(ValueError):
    """The requested parallel layout does not fit the model."""


class AttentionKernel(enum.Enum):
    """Which TPLA / MLA-TP decode attention kernel a rank runs (same math, tested equal)."""

    NATIVE = "native"  # C++ over the paged cache in place (fp32 CPU; else falls back)
    TORCH = "torch"  # `fused_slice_attention`: PyTorch ops over whole-block copies


class ParallelMode(enum.Enum):
    """How a decode group splits the latent cache over its ranks."""

    TPLA = "tpla"  # by latent columns (r groups); r = 1 is MLA-TP, the exact baseline
    SP = "sp"  # by token chunks, round-robin, full width; exact (log-sum-exp merge)


@dataclass(frozen=True)
class ParallelConfig:
    """tp = latent_groups (r) x head_groups (m). r = 1 is MLA-TP; r = tp is full TPLA.

    In SP mode r = 1 and m = tp: projections are split by heads as in MLA-TP, and the cache
    by chunks of `chunk_size` tokens.
    """

    tp: int = 1
    latent_groups: int = 1
    rmsnorm: RmsNormMode = RmsNormMode.EXACT
    mode: ParallelMode = ParallelMode.TPLA
    chunk_size: int = 256

    def __post_init__(self) -> None:
        if self.tp < 1 or self.latent_groups < 1 or self.tp % self.latent_groups:
            raise ParallelError(
                f"tp={self.tp} is not a multiple of latent_groups={self.latent_groups}"
            )
        if self.mode is ParallelMode.SP and self.latent_groups != 1:
            raise ParallelError("sequence parallelism keeps the full latent: latent_groups=1")
        if self.chunk_size < 1:
            raise ParallelError("chunk_size must be positive")

    @property
    def sp(self) -> bool:
        return self.mode is ParallelMode.SP

    @property
    def name(self) -> str:
        if self.sp:
            return "sp"
        return "mla-tp" if self.latent_groups == 1 else "tpla"

    @property
    def head_groups(self) -> int:
        return self.tp // self.latent_groups

    def coords(self, rank: int) -> tuple[int, int]:
        """(latent group i, head group j) of a rank."""
        return rank // self.head_groups, rank % self.head_groups


def _split(total: int, parts: int, index: int, what: str) -> slice:
    if total % parts:
        raise ParallelError(f"{what} ({total}) is not divisible by {parts}")
    size = total // parts
    return slice(index * size, (index + 1) * size)


def rank_latent_columns(parallel: ParallelConfig, rank: int, d_c: int) -> slice:
    """The latent columns rank `rank` caches: slice S_i of its latent group i."""
    i, _ = parallel.coords(rank)
    return _split(d_c, parallel.latent_groups, i, "kv_lora_rank")


class RankAttention(nn.Module):
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
        self.mode = mode
        self.native = False  # set by RankModel once the weights' dtype and device are known
        self.linear = F.linear  # likewise: small_gemm.linear with the native kernels
        # Likewise: the native queries + new latent + cache write, bound to this layer's
        # weights (`bind_inputs`); None runs `queries` / `new_latent` / `PagedLatentCache.write`.
        self.inputs: decode_layer.AttentionInputs | None = None
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
        latent_rows = (
            slice(0, a.d_c) if mode is RmsNormMode.EXACT else slice(shard.start, shard.end)
        )
        self.kv_a_latent = nn.Parameter(w_kva[latent_rows].clone())
        self.kv_a_rope = nn.Parameter(w_kva[a.d_c :].clone())
        self.gamma = nn.Parameter(a.kv_a_layernorm.weight.detach().clone())
        self.eps = a.kv_a_layernorm.eps
        cols = slice(shard.start, shard.end)
        self.w_uk = nn.Parameter(a.w_uk()[heads, :, cols].detach().clone())
        self.w_uv = nn.Parameter(a.w_uv()[heads, :, cols].detach().clone())
        w_o = a.o_proj.weight.detach().view(-1, a.num_heads, a.d_v)
        self.w_o = nn.Parameter(w_o[:, heads].reshape(w_o.shape[0], -1).clone())

    def bind_inputs(self, input_norm: RMSNorm, rope: RotaryEmbedding) -> None:
        """Run this layer's attention inputs natively from now on (fp32 CPU weights)."""
        s, exact = self.shard, self.mode is RmsNormMode.EXACT
        self.inputs = decode_layer.AttentionInputs(
            decode_layer.LayerWeights(
                norm=input_norm.weight.detach(),
                eps=input_norm.eps,
                q_a=None if self.q_a is None else self.q_a.detach(),
                q_a_norm=None if self.q_a_norm is None else self.q_a_norm.weight.detach(),
                q_a_eps=0.0 if self.q_a_norm is None else self.q_a_norm.eps,
                q_b=self.q_b.detach(),
                kv_latent=self.kv_a_latent.detach(),
                kv_rope=self.kv_a_rope.detach(),
                kv_norm=self.gamma.detach()[s.start : s.end],
                kv_eps=self.eps,
                latent_offset=s.start if exact else 0,
                rms_correction=1.0 if exact else s.rms_correction,
                heads=self.num_heads,
                d_n=self.d_n,
                d_r=self.d_r,
                interleaved=rope.interleaved,
            )
        )

    def queries(
        self, x: Tensor, rope: RotaryEmbedding, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor]:
        if self.q_a is not None:
            x = self.q_a_norm(self.linear(x, self.q_a))
        q = self.linear(x, self.q_b).view(x.shape[0], self.num_heads, self.d_n + self.d_r)
        q_nope, q_pe = q.split([self.d_n, self.d_r], dim=-1)
        return q_nope, rope.apply(q_pe, cos[:, None], sin[:, None])

    def new_latent(
        self, x: Tensor, rope: RotaryEmbedding, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor]:
        """This rank's slice n[S_i] and the rotated k_pe of new tokens."""
        k_pe = rope.apply(self.linear(x, self.kv_a_rope), cos, sin)
        lat = self.linear(x, self.kv_a_latent)
        s = self.shard
        if self.mode is RmsNormMode.EXACT:
            lf = lat.float()
            n = lf * torch.rsqrt(lf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (self.gamma * n.to(x.dtype))[:, s.start : s.end], k_pe
        return sliced_rmsnorm(lat, self.gamma[s.start : s.end], self.eps, s.rms_correction), k_pe

    def attend(
        self, q_nope: Tensor, q_pe: Tensor, rows: BlockRows, chunk: int, lengths: Tensor
    ) -> Tensor:
        """TPLA / MLA-TP: [B, h, *] queries over this rank's latent slice -> partial [B, D].

        `rows` reads the sequences' cache blocks, token t of sequence b valid iff
        t < lengths[b]. `attend_reference` is the same math unfused.
        """
        if self.native:
            o = native.paged_latent_attention(
                q_nope.contiguous(),
                q_pe.contiguous(),
                rows.cache.kv[rows.layer],
                rows.block_ids,
                lengths,
                rows.cache.layout.block_size,
                self.w_uk,
                self.w_uv,
                self.scale,
                self.shard.beta,
            )
        else:
            o = fused_slice_attention(
                q_nope,
                q_pe,
                rows.read,
                rows.total,
                chunk,
                lengths,
                self.w_uk,
                self.w_uv,
                self.scale,
                self.shard.beta,
            )
        return self.linear(o.reshape(o.shape[0], -1), self.w_o)

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
        self, q_nope: Tensor, q_pe: Tensor, n: Tensor, k_pe: Tensor, valid: Tensor, comm: Comm
    ) -> Tensor:
        """SP: every head over this rank's token chunks, merged exactly across ranks."""
        b = q_nope.shape[0]
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope, self.w_uk)
        # Every rank needs every head's query for its own tokens: gather the head groups.
        q_all = comm.gather_heads(torch.cat((q_lat, q_pe), dim=-1))
        q_lat_all, q_pe_all = q_all.split([self.d_c, self.d_r], dim=-1)
        u, m, l = partial_attention(q_lat_all, q_pe_all, n, k_pe, valid, self.scale)
        global_max = m.clone()
        comm.max_(global_max)
        u, l = merge_partials(u, m, l, global_max)
        packed = torch.cat((u, l[..., None].to(u.dtype)), dim=-1)
        comm.sum_(packed)
        heads = slice(self.head_offset, self.head_offset + self.num_heads)
        u_mine = packed[:, heads, : self.d_c] / packed[:, heads, self.d_c :]
        o = torch.einsum("bhc,hvc->bhv", u_mine, self.w_uv)
        return self.linear(o.reshape(b, -1), self.w_o)


def _shard_ffn(module: nn.Module, config, rank: int, tp: int) -> nn.Module:
    """A 1/tp slice of a dense MLP or of every expert of a MoE (intermediate dimension)."""
    if isinstance(module, MoE):
        inter = config.moe_intermediate_size
        cols = _split(inter, tp, rank, "moe_intermediate_size")
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
    cols = _split(inter, tp, rank, "intermediate_size")
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
    """Everything one rank needs for decode; built from the full model, which is then freed."""

    def __init__(
        self,
        full: DeepseekForCausalLM,
        parallel: ParallelConfig,
        rank: int,
        shards_per_layer: list[list[LatentShard]],
        kernel: AttentionKernel = AttentionKernel.NATIVE,
    ) -> None:
        super().__init__()
        c = full.config
        self.config, self.parallel, self.rank = c, parallel, rank
        i, j = parallel.coords(rank)
        heads = _split(c.num_attention_heads, parallel.head_groups, j, "num_attention_heads")
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
        self.rope = full.rope
        self.latent_width = shards_per_layer[0][i].width
        self.kernel = self.use_kernel(kernel)

    def use_kernel(self, kernel: AttentionKernel) -> AttentionKernel:
        """Select the decode attention kernel (and with it the native decode-sized matmuls of
        `small_gemm`); returns the one in use.

        NATIVE runs where it can (fp32 weights on the CPU, a C++ compiler at build time) and
        otherwise falls back to TORCH with a warning, so a deployment never fails over it.
        """
        attn = [layer.attn for layer in self.layers]
        usable = kernel is AttentionKernel.NATIVE and all(
            native.supports(a.w_uk, a.w_uv) for a in attn
        )
        if usable and not native.available():
            usable = False
        if kernel is AttentionKernel.NATIVE and not usable:
            log.warning("native decode attention not usable here; using the torch kernel")
        # The decode-sized matmuls go with it (a library of their own; each call still
        # falls back to BLAS where the native product would not win).
        self.native_matmuls = usable and small_gemm.available()
        self.linear = small_gemm.linear if self.native_matmuls else F.linear
        # And the layers' glue (norms, rotary embeddings, the cache write) in native calls.
        self.native_layers = usable and decode_layer.available()
        for layer in self.layers:
            a = layer.attn
            a.native = usable
            a.linear = self.linear
            a.inputs = None
            if self.native_layers:
                a.bind_inputs(layer.input_norm, self.rope)
        return AttentionKernel.NATIVE if usable else AttentionKernel.TORCH

    def _norm(self, norm: RMSNorm, x: Tensor) -> Tensor:
        if self.native_layers:
            return decode_layer.rms_norm(x, norm.weight, norm.eps)
        return norm(x)

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
        mask in SP mode).
        """
        cos, sin = self.rope.cos_sin(positions)
        h = self.embed(token_ids)
        # TPLA / MLA-TP read whole blocks; the table is the same for every layer.
        block_ids, lengths = reads.block_ids, reads.lengths
        slots, valid = reads.slots, reads.valid
        if self.parallel.sp and (slots is None or valid is None):
            raise ValueError("an SP decode step reads per-token slots: use CacheReads.tokens")
        chunk = cache.chunk_tokens(len(token_ids))
        fused = self.native_layers and cache.kv.dtype == torch.float32
        for index, layer in enumerate(self.layers):
            if fused:
                q_nope, q_pe = layer.attn.inputs(h, cos, sin, cache.kv[index], write_slots)
            else:
                x = layer.input_norm(h)
                q_nope, q_pe = layer.attn.queries(x, self.rope, cos, sin)
                n_new, k_pe_new = layer.attn.new_latent(x, self.rope, cos, sin)
                keep = write_slots >= 0
                cache.write(index, write_slots[keep], n_new[keep], k_pe_new[keep])
            if self.parallel.sp:  # slots and valid are set (checked above)
                n, k_pe = cache.gather(index, slots)
                y = layer.attn.attend_sp(q_nope, q_pe, n, k_pe, valid, comm)
            else:
                rows = cache.rows(index, block_ids)
                y = layer.attn.attend(q_nope, q_pe, rows, chunk, lengths)
            comm.sum_(y)
            h = h + y
            f = ffn_forward(layer.ffn, self._norm(layer.post_norm, h), self.native_matmuls)
            comm.sum_(f)
            h = h + f
        logits = self.linear(self._norm(self.norm, h), self.lm_head)
        pad = self.vocab_size_padded - logits.shape[1]
        return F.pad(logits, (0, pad)) if pad else logits

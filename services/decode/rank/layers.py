"""A decode rank's layers: its share of one layer's weights, read from a weight source.

Rank (i, j) of a group with `tp = r * m` ranks holds latent slice i and head group j
(DESIGN §1 "TPLA decode"): the W_UK / W_UV columns of S_i for its heads, its heads' rows of
the query projection and columns of o_proj, the layer's norms, and the slice of the FFN
`common/parallel.py` gives it (common/loading/rank_slices.py). A linear weight kept in FP8 is
held as an `Fp8Weight` (common/model/fp8.py), applied by scaled_mm or dequantized on use
(fp8_gemm.py). The math around the attention kernel lives here (`attend_reference`, the
unfused path); which kernel runs it is the rank's backend (services/decode/rank/backends),
called from the step (rank/rank_model.py).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor, nn

from common.loading.rank_slices import rank_norm
from common.loading.weights import WeightSource
from common.model.fp8 import Fp8Weight, dense, held, linear
from common.model.mla import Linear, RMSNorm, project_latent, project_queries
from common.model.rope import RotaryEmbedding
from common.model.tpla import LatentShard, latent_norm, latent_slice_attention
from common.parallel import RmsNormMode


class NormBackend(Protocol):
    def rms_norm(self, norm: RMSNorm, x: Tensor) -> Tensor: ...


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
            self.q_a: nn.Parameter | Fp8Weight | None = held(src.linear(p + "q_a_proj.weight"))
            self.q_a_norm: RMSNorm | None = rank_norm(
                src, p + "q_a_layernorm.weight", c.attention_norm_eps
            )
            self.q_b = held(src.linear(p + "q_b_proj.weight", rows))
        else:
            self.q_a, self.q_a_norm = None, None
            self.q_b = held(src.linear(p + "q_proj.weight", rows))
        kv_a = p + "kv_a_proj_with_mqa.weight"
        # Exact mode needs the whole (small) latent projection to normalize exactly; sliced
        # mode holds only its slice's rows. The rope rows are replicated either way.
        exact = mode is RmsNormMode.EXACT
        latent_rows = slice(0, self.d_c) if exact else slice(shard.start, shard.end)
        self.kv_a_latent = held(src.linear(kv_a, latent_rows))
        self.kv_a_rope = held(src.linear(kv_a, slice(self.d_c, None)))
        self.gamma = nn.Parameter(src.tensor(p + "kv_a_layernorm.weight"))
        self.eps = c.attention_norm_eps
        # W_UK / W_UV of these heads, latent columns S_i: rows of kv_b_proj [h (d_n + d_v), w].
        kv = self.d_n + self.d_v
        w_kv = src.linear(
            p + "kv_b_proj.weight",
            slice(heads.start * kv, heads.stop * kv),
            slice(shard.start, shard.end),
        )
        self.uk, self.uv = split_kv_b(w_kv, self.num_heads, self.d_n, self.d_v)
        del w_kv
        self.w_o = held(
            src.linear(
                p + "o_proj.weight", cols=slice(heads.start * self.d_v, heads.stop * self.d_v)
            )
        )

    @property
    def w_uk(self) -> Tensor:
        """W_UK [h, d_n, w] of this rank's heads and latent columns."""
        return dense(self.uk)

    @property
    def w_uv(self) -> Tensor:
        """W_UV [h, d_v, w] of this rank's heads and latent columns."""
        return dense(self.uv)

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

    def attend_reference(
        self, q_nope: Tensor, q_pe: Tensor, n: Tensor, k_pe: Tensor, valid: Tensor
    ) -> Tensor:
        """`LatentColumns.attend` (rank/cache_split.py) unfused, on per-token gathered n [B, T, w],
        k_pe [B, T, d_r] and a mask [B, T]: the reference its kernels are tested against."""
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
        return linear(o.reshape(o.shape[0], -1), self.w_o)


def split_kv_b(
    w_kv: Tensor | Fp8Weight, heads: int, d_n: int, d_v: int
) -> tuple[nn.Parameter | Fp8Weight, nn.Parameter | Fp8Weight]:
    """Rows [h (d_n + d_v), w] of kv_b_proj -> W_UK [h, d_n, w] and W_UV [h, d_v, w]."""
    kv, width = d_n + d_v, w_kv.shape[-1]
    if isinstance(w_kv, Fp8Weight):
        uk = [(h * kv, h * kv + d_n) for h in range(heads)]
        uv = [(h * kv + d_n, (h + 1) * kv) for h in range(heads)]
        return (
            w_kv.take_rows(uk, (heads, d_n, width), "w_uk"),
            w_kv.take_rows(uv, (heads, d_v, width), "w_uv"),
        )
    w = w_kv.view(heads, kv, width)
    return nn.Parameter(w[:, :d_n].contiguous()), nn.Parameter(w[:, d_n:].contiguous())


class RankLayer(nn.Module):
    """A rank's share of one decoder layer: its attention, its FFN slice and the norms."""

    def __init__(self, src: WeightSource, layer: int, attn: RankAttention, ffn: nn.Module) -> None:
        super().__init__()
        eps, p = src.config.rms_norm_eps, f"model.layers.{layer}."
        self.input_norm = rank_norm(src, p + "input_layernorm.weight", eps)
        self.attn = attn
        self.post_norm = rank_norm(src, p + "post_attention_layernorm.weight", eps)
        self.ffn = ffn
        c = src.config
        self.post_ffn_norm = (
            rank_norm(src, p + "post_mlp_layernorm.weight", eps)
            if c.moe_output_norm and c.is_moe_layer(layer)
            else None
        )

    def ffn_output(self, backend: NormBackend, f: Tensor) -> Tensor:
        """The FFN's output summed over the ranks, as the residual takes it (A.X-K1 normalizes
        a MoE layer's)."""
        return f if self.post_ffn_norm is None else backend.rms_norm(self.post_ffn_norm, f)

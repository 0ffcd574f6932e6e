"""The lightning indexer of DeepSeek Sparse Attention: one layer's index queries, keys and head
weights (HF's DeepseekV32Indexer / GlmMoeDsaIndexer), and the index score they give.

For a query at position s, with x the layer's normalized input and c_q its q-LoRA output:

    q_h = wq_b(c_q)_h                 (H_I heads of d_I)
    k_t = LayerNorm(wk(x_t))          (one key per token, shared by every head)
    w_h = weights_proj(x_s)_h / sqrt(H_I)                       (fp32)
    I_{s,t} = sum_h w_h ReLU(q_h . k_t / sqrt(d_I))             (fp32)

RoPE rotates the first d_r dims of q_h and k_t (the opposite end from MLA's nope-then-rope),
laid out in halves (V3.2) or interleaved (GLM-5). The query attends over the `index_topk`
tokens of highest I (common/model/topk.py). Math only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.model.args import ModelConfig
from common.model.rope import rotate

# HF builds the key norm with this epsilon whatever the config says.
KEY_NORM_EPS = 1e-6
# Keys scored per tile: bounds the [rows, H_I, tile] fp32 scores a score call holds at once.
KEY_TILE = 4096


class HeadWeights(nn.Module):
    """`weights_proj`, applied in fp32 (HF keeps it so); its weight is read in fp32 by the
    loader (common.loading.weights.kept_float32)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, hidden, dtype=torch.float32))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.weight.float())


class Indexer(nn.Module):
    """One full layer's indexer weights, named like the checkpoint (`self_attn.indexer.*`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dsa, q_lora = config.dsa, config.q_lora_rank
        assert dsa is not None and q_lora is not None, "an indexer needs DSA and a q-LoRA"
        self.n_heads, self.head_dim = dsa.index_n_heads, dsa.index_head_dim
        self.d_r = config.qk_rope_head_dim
        self.interleaved = dsa.rope_interleave
        self.scale = self.head_dim**-0.5
        self.wq_b = nn.Linear(q_lora, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=KEY_NORM_EPS)
        self.weights_proj = HeadWeights(config.hidden_size, self.n_heads)

    def _rope(self, v: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        rot, rest = v.split([self.d_r, self.head_dim - self.d_r], dim=-1)
        return torch.cat((rotate(rot, cos, sin, self.interleaved), rest), dim=-1)

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Normalized layer inputs x [T, D] at cos / sin [T, d_r / 2] -> keys [T, d_I]."""
        return self._rope(self.k_norm(self.wk(x)), cos, sin)

    def queries(self, q_lora: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The q-LoRA output c_q [T, q_lora_rank] -> index queries [T, H_I, d_I]."""
        q = self.wq_b(q_lora).view(q_lora.shape[0], self.n_heads, self.head_dim)
        return self._rope(q, cos[:, None], sin[:, None])

    def head_weights(self, x: Tensor) -> Tensor:
        """x [T, D] -> w [T, H_I] in fp32, the 1/sqrt(H_I) folded in."""
        return self.weights_proj(x) * self.n_heads**-0.5


def index_scores(
    q: Tensor,
    w: Tensor,
    keys: Tensor,
    scale: float,
    decode: Callable[[Tensor], Tensor] = Tensor.float,
    tile: int = KEY_TILE,
) -> Tensor:
    """I [R, T] (fp32) of R queries q [R, H_I, d_I] with head weights w [R, H_I] over keys
    [R, T, *] (each row its own) or [T, *] (shared), `tile` keys at a time, each tile read
    into fp32 [.., d_I] keys by `decode` (a cache row format's, common/model/index_keys.py)."""
    qf = q.float()
    out = torch.empty(q.shape[0], keys.shape[-2], dtype=torch.float32, device=q.device)
    for t0 in range(0, keys.shape[-2], tile):
        k = decode(keys[..., t0 : t0 + tile, :])
        s = torch.einsum("rhd,rtd->rht" if k.ndim == 3 else "rhd,td->rht", qf, k)
        out[:, t0 : t0 + k.shape[-2]] = torch.einsum("rh,rht->rt", w, (s * scale).relu_())
    return out

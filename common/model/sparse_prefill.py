"""DeepSeek Sparse Attention in a packed prefill.

Every full layer computes its indexer keys for the new tokens (they are part of the prompt's
cache, shipped with its latents). A prompt whose context (its past and its new tokens)
exceeds `index_topk` attends sparsely: each query selects its own top-k over its causal
past (common/model/topk.py), queries in tiles whose index scores over the past are computed
key tile by key tile (common/model/indexer.py `index_scores`), never a prompt x prompt tensor
per head; it then attends, absorbed, over its gathered selected rows. A prompt within
`index_topk` is left to the dense path, exactly dense MLA. A shared layer reuses each
prompt's selection from the full layer before it. Math only.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import torch
from torch import Tensor

from common.model.indexer import index_scores
from common.model.mla import MLAttention
from common.model.sparse_attention import gathered_absorbed
from common.model.topk import mask_positions, topk_mask

# Query rows x selected rows gathered (and scored) at once: bounds a tile's memory.
TILE_ROWS = 2**17

Selection = tuple[Tensor, Tensor]  # positions [L, k] ascending, count [L]


class SparsePrefill:
    """One packed prefill's DSA state across its layers: the keys each full layer made and
    each sparse prompt's selection, which the shared layers after it reuse.

    `cu`: the prompts' row offsets; `starts`: each prompt's past length; `past_keys`: per
    prompt, its past's indexer keys per full layer (None without a past)."""

    def __init__(
        self,
        index_topk: int,
        cu: list[int],
        starts: list[int],
        past_keys: list[list[Tensor] | None],
    ) -> None:
        self.index_topk, self.cu, self.starts, self.past_keys = index_topk, cu, starts, past_keys
        self.keys: list[Tensor] = []  # per full layer: the new rows' keys, packed [T, d_I]
        self._selections: list[Selection | None] = [None] * len(starts)

    def sparse(self, prompt: int) -> bool:
        """Whether the prompt's last query has more than index_topk tokens."""
        return self.starts[prompt] + self.cu[prompt + 1] - self.cu[prompt] > self.index_topk

    @property
    def any_sparse(self) -> bool:
        return any(self.sparse(p) for p in range(len(self.starts)))

    def index(
        self, attn: MLAttention, x: Tensor, q_latent: Tensor, cos: Tensor, sin: Tensor
    ) -> None:
        """A full layer's keys for the new rows, and each sparse prompt's selection (a
        shared layer keeps the previous full layer's)."""
        indexer = attn.indexer
        if indexer is None:
            return
        keys = indexer.keys(x, cos, sin)
        layer = len(self.keys)
        self.keys.append(keys)
        for p, (lo, hi) in enumerate(zip(self.cu[:-1], self.cu[1:], strict=True)):
            if not self.sparse(p):
                continue
            past = self.past_keys[p]
            every = keys[lo:hi]
            if past is not None:
                every = torch.cat([past[layer].to(keys.dtype), every])
            q = indexer.queries(q_latent[lo:hi], cos[lo:hi], sin[lo:hi])
            w = indexer.head_weights(x[lo:hi])
            k, scale = self.index_topk, indexer.scale
            self._selections[p] = _select(q, w, every, self.starts[p], k, scale)

    def attend_batch(
        self,
        attn: MLAttention,
        q_nope: Tensor,
        q_pe: Tensor,
        n: Tensor,
        k_pe: Tensor,
        pasts: list[tuple[Tensor, Tensor] | None],
        dense: Callable[[int, slice], Tensor],
    ) -> Tensor:
        """A layer's attention for the packed batch: each sparse prompt over its selected
        rows (its past's latents `pasts[p]`, n and k_pe, before its own), the others by
        `dense(prompt, rows)`."""
        out = []
        for p, (start, end) in enumerate(pairwise(self.cu)):
            rows = slice(start, end)
            if not self.sparse(p):
                out.append(dense(p, rows))
                continue
            n_all, k_all, past = n[rows], k_pe[rows], pasts[p]
            if past is not None:
                n_all = torch.cat([past[0].to(n.dtype), n_all])
                k_all = torch.cat([past[1].to(k_pe.dtype), k_all])
            out.append(self.attend(attn, p, q_nope[rows], q_pe[rows], n_all, k_all))
        return torch.cat(out)

    def attend(
        self,
        attn: MLAttention,
        prompt: int,
        q_nope: Tensor,
        q_pe: Tensor,
        n: Tensor,
        k_pe: Tensor,
    ) -> Tensor:
        """A sparse prompt's attention: its queries q_nope [L, H, d_n], q_pe [L, H, d_r] over
        its whole latents n [P + L, d_c], k_pe [P + L, d_r] (past first) -> [L, H, d_v]."""
        selection = self._selections[prompt]
        if selection is None:
            raise ValueError("a shared DSA layer needs a full layer's selection before it")
        positions, count = selection
        step = max(TILE_ROWS // self.index_topk, 1)
        out = []
        for a in range(0, q_nope.shape[0], step):
            rows, pos = slice(a, a + step), positions[a : a + step]
            q = (q_nope[rows], q_pe[rows])
            out.append(gathered_absorbed(attn, *q, n[pos], k_pe[pos], count[rows]))
        return torch.cat(out)


def _select(q: Tensor, w: Tensor, keys: Tensor, start: int, k: int, scale: float) -> Selection:
    """Queries at positions start.. (q [L, H_I, d_I], w [L, H_I]) over keys [start + L, d_I]:
    each one's top-k of its causal past -> positions [L, k], count [L]."""
    length = q.shape[0]
    step = max(TILE_ROWS // max(keys.shape[0], 1), 1)
    positions, counts = [], []
    for a in range(0, length, step):
        b = min(a + step, length)
        scores = index_scores(q[a:b], w[a:b], keys[: start + b], scale)
        query_pos = torch.arange(start + a, start + b, device=q.device)
        valid = torch.arange(start + b, device=q.device)[None] <= query_pos[:, None]
        pos, count = mask_positions(topk_mask(scores, valid, k), k)
        positions.append(pos)
        counts.append(count)
    return torch.cat(positions), torch.cat(counts)

"""DeepSeek Sparse Attention's attention side: a query attends, in absorbed MLA, only over the
tokens its layer's indexer selected (common/model/indexer.py, topk.py).

Two forms of one computation. `select_decode` turns a decode step's index scores into a mask
over the rows the step reads, which the ordinary absorbed attention takes as its valid mask:
the single-process reference, bit-equal to dense MLA wherever a query has at most
`index_topk` tokens (the mask is then its valid mask). `gathered_absorbed` attends over rows
gathered at the selected positions (at most `index_topk` a query), what prefill and the
decode ranks run at long context. A "shared" layer (GLM) has no indexer and reuses the
selection of the full layer before it: `SelectionCarry` carries it through a step's layers.
Math only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from common.model.indexer import index_scores
from common.model.mla import MLAttention
from common.model.topk import topk_mask


@dataclass
class SelectionCarry:
    """The selection of the last full layer a step ran (how the caller holds it: a mask over
    the step's rows, or positions and counts), for the shared layers after it."""

    selection: object | None = None

    def reused(self) -> object:
        if self.selection is None:
            raise ValueError("a shared DSA layer needs a full layer's selection before it")
        return self.selection


def select_decode(
    attn: MLAttention,
    x: Tensor,
    q_latent: Tensor,
    cos_sin: tuple[Tensor, Tensor],
    keys: Tensor,
    valid: Tensor,
    carry: SelectionCarry,
) -> Tensor:
    """The selected rows [B, T] of one decode step: x [B, D] the layer's normalized input,
    q_latent its q-LoRA output, keys [B, T, d_I] the indexer keys of the rows `valid` [B, T]
    marks. A shared layer returns the carried selection."""
    indexer, dsa = attn.indexer, attn.dsa
    if indexer is None:
        selected = carry.reused()
        assert isinstance(selected, Tensor)
        return selected
    assert dsa is not None
    cos, sin = cos_sin
    q = indexer.queries(q_latent, cos, sin)
    scores = index_scores(q, indexer.head_weights(x), keys, indexer.scale)
    mask = topk_mask(scores, valid, dsa.index_topk)
    carry.selection = mask
    return mask


def gathered_absorbed(
    attn: MLAttention, q_nope: Tensor, q_pe: Tensor, n: Tensor, k_pe: Tensor, count: Tensor
) -> Tensor:
    """R queries q_nope [R, H, d_n], q_pe [R, H, d_r], each over its own gathered rows
    n [R, K, d_c], k_pe [R, K, d_r] of which the first count[r] are its selection ->
    [R, H, d_v]."""
    valid = torch.arange(n.shape[1], device=n.device)[None] < count[:, None]
    return attn.absorbed(q_nope[:, None], q_pe[:, None], n, k_pe, valid[:, None])[:, 0]

"""A decode rank's share of DeepSeek-V3's MTP module, the draft model of `TPLA_SPECULATIVE=mtp`.

MTP module 0 is checkpoint layer L = num_hidden_layers: its decoder layer is sliced like any
layer (latent slice i and head group j of its attention, from the side file's MTP spectra;
a 1/tp slice of its FFN) and caches its latents in pool layer L; the parts around it (the
embedding, enorm, hnorm, eh_proj, the head's norm and this rank's vocabulary rows of the
head) come from `RankMTPParts`. The pass itself runs in the step (RankModel.mtp_rows,
rank/draft_pass.py). V3 ships one module; chained drafts reuse it, as vLLM and SGLang do.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from common.group.comm import Comm
from common.loading.mtp_weights import RankMTPParts
from common.loading.rank_slices import rank_ffn
from common.loading.weights import WeightSource
from common.model.mtp import mtp_layer_index
from common.model.tpla import LatentShard
from common.parallel import ParallelConfig
from services.decode.rank.layers import RankAttention, RankLayer


class RankMTP(nn.Module):
    """MTP module 0 on one rank: `layer` (a `RankLayer` for index L) and `parts`."""

    def __init__(
        self,
        src: WeightSource,
        parallel: ParallelConfig,
        rank: int,
        shard: LatentShard,
        main: tuple[nn.Parameter, nn.Parameter],
    ) -> None:
        super().__init__()
        c = src.config
        index = mtp_layer_index(c, 0)
        heads = parallel.heads(rank, c.num_attention_heads)
        attn = RankAttention(src, index, heads, shard, parallel.rmsnorm)
        self.layer = RankLayer(src, index, attn, rank_ffn(src, index, parallel, rank))
        self.parts = RankMTPParts(src, 0, parallel, rank, main)
        self.cache_layer = index  # the pool's layer after the model's own
        self.vocab_offset = parallel.vocab_rows(rank, c.vocab_size).start


def global_argmax(local: Tensor, offset: int, comm: Comm) -> Tensor:
    """The argmax over the whole vocabulary of rows sharded by vocabulary slice: each rank's
    local logits [R, V_k] (its rows start at `offset`) -> token ids [R], the same on every
    rank (one all-gather; ties go to the lowest id, as torch.argmax's do)."""
    idx = local.argmax(-1)
    best = local.gather(-1, idx[:, None])[:, 0].float()
    # Float32 holds every id below 2^24 exactly, and the collectives carry fp32.
    mine = torch.stack((best, (idx + offset).float()), dim=-1)
    every = comm.all_gather(mine)  # [tp, R, 2], rank order = vocabulary order
    winner = every[..., 0].argmax(0)  # the first rank holding the maximum
    return every[..., 1].gather(0, winner[None])[0].to(torch.int64)

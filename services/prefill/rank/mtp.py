"""A prefill rank's share of DeepSeek-V3's MTP module 0, run over a batch's prompts for the
decode ranks' MTP cache layer.

The module's decoder layer (checkpoint layer L = num_hidden_layers) is sharded like the rank's
other layers (`head_layer`: its head group's attention over the whole latent, its FFN slice),
and the parts around it come from `RankMTPParts`: the embedding and the head by the rank's
vocabulary rows (shared with the rank's own when equal, as V3's are), enorm, hnorm, eh_proj
and the head's norm replicated. A prefill needs only the layer's latents
(common/model/mtp.py `mtp_latents`): the fused input of token t + 1 (its embedding's
vocabulary shards summed over the group) and the main model's hidden state at t (whole on
every rank after the last all-reduce), normed and projected by the layer's attention, which
keeps the whole latent: every rank gets the whole MTP latents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor, nn

from common.loading.mtp_weights import RankMTPParts
from common.loading.rank_slices import head_layer
from common.loading.weights import WeightSource
from common.model.causal_lm import DecoderLayer
from common.model.mtp import fuse, mtp_layer_index
from common.model.rope import RotaryEmbedding
from common.parallel import ParallelConfig
from services.prefill.rank.embedding import vocab_embedding


class PrefillRankMTP(nn.Module):
    """MTP module 0 on one prefill rank: `layer` (its share of decoder layer L) and `parts`;
    `main`: the rank's (embedding rows, lm_head rows), not held twice when equal."""

    def __init__(
        self,
        src: WeightSource,
        parallel: ParallelConfig,
        rank: int,
        main: tuple[nn.Parameter, nn.Parameter],
    ) -> None:
        super().__init__()
        c = src.config
        self.layer = head_layer(src, mtp_layer_index(c, 0), parallel, rank)
        self.parts = RankMTPParts(src, 0, parallel, rank, main, vocab_embedding=True)
        self.vocab = parallel.vocab_rows(rank, c.vocab_size)


class RankMTPStack:
    """The rank's MTP layer over one batch, as `mtp_latents` reads it: its input is fused from
    the main model's hidden state `hidden` [T, D]; `reduce` sums a partial over the group."""

    def __init__(
        self,
        mtp: PrefillRankMTP,
        hidden: Tensor,
        rope: RotaryEmbedding,
        reduce: Callable[[Tensor], Tensor],
    ) -> None:
        self.mtp, self.hidden, self.rope, self._reduce = mtp, hidden, rope, reduce

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        return [self.mtp.layer]

    def embed(self, input_ids: Tensor) -> Tensor:
        parts = self.mtp.parts
        e = self._reduce(vocab_embedding(input_ids, parts.embed.weight, self.mtp.vocab))
        return fuse(parts, e, self.hidden)

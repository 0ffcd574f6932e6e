"""A decode rank's part of DeepSeek Sparse Attention: its indexers and its index-key pool, and
the tokens each layer of a step attends over.

Every rank holds every full layer's indexer whole and computes its own selection. In MLA-TP
and TPLA each rank caches every token's key and scores them all: its inputs (the hidden state
after the group's all-reduce, which leaves bit-identical values on every rank, the replicated
weights and cache) and the operations are the same on every rank, so the selections are
identical by construction, with no collective for them (a test compares the ranks'
selections). In SP a rank keeps and scores the keys of its own chunks, and the ranks agree on
the global k-th score by the layout's all-gather (rank/cache_split.py).

A step whose tables are too narrow for any row to hold more than index_topk tokens attends
densely, as V3 does (`CacheSplit.covers`, decided by shapes alone: no host wait); it still
writes its new keys. A shared layer reuses the last full layer's selection of the step.
The sparse attention itself runs in torch on every backend (gathered rows); the backends
keep the dense steps' kernels.
"""

from __future__ import annotations

from torch import Tensor, nn

from common.group.comm import Comm
from common.kv.index_cache import index_layout
from common.kv.paged_cache import CacheLayout, CacheReads, PagedLatentCache
from common.kv.slots import token_slots
from common.loading.indexer_weights import load_indexer
from common.loading.weights import WeightSource
from common.model.dsa_config import DsaConfig
from common.model.index_keys import IndexKeyFormat
from common.model.indexer import Indexer, index_scores
from common.model.rope import RotaryEmbedding
from common.model.topk import mask_positions
from services.decode.rank.backends import DecodeBackend
from services.decode.rank.cache_split import CacheSplit, Selection
from services.decode.rank.layers import RankLayer


class RankSparse(nn.Module):
    """The indexers of cache layers 0..`layers`-1 (the model's, then MTP) that run one, and,
    once bound, the rank's index-key pool."""

    def __init__(self, src: WeightSource, layers: int) -> None:
        super().__init__()
        dsa = src.config.dsa
        assert dsa is not None
        self.dsa: DsaConfig = dsa
        self.layers = layers
        loaded = {n: load_indexer(src, n) for n in range(layers)}
        self.indexers = nn.ModuleDict({str(n): m for n, m in loaded.items() if m is not None})
        self.head_dim = dsa.index_head_dim
        self.format: IndexKeyFormat | None = None
        self.pool: PagedLatentCache | None = None
        self.last: Selection | None = None  # the step's last full layer's

    def layout(self, fmt: IndexKeyFormat, block_size: int) -> CacheLayout:
        """The key pool's layout, keys held in `fmt` from now on."""
        self.format = fmt
        return index_layout(self.dsa.key_layers(self.layers), fmt, block_size)

    def bind(self, pool: PagedLatentCache) -> None:
        self.pool = pool

    def indexer(self, layer: int) -> Indexer:
        indexer = self.indexers[str(layer)]
        assert isinstance(indexer, Indexer)
        return indexer

    def select(
        self,
        index: int,
        layer: RankLayer,
        h: Tensor,
        rope_args: tuple[RotaryEmbedding, Tensor, Tensor],
        write_slots: Tensor,
        reads: CacheReads,
        comm: Comm,
        split: CacheSplit,
        backend: DecodeBackend,
    ) -> Selection | None:
        """Cache layer `index`'s new keys written at `write_slots`, and the tokens its rows
        attend over: None where the step attends densely."""
        pool, fmt = self.pool, self.format
        assert pool is not None and fmt is not None, "no index-key pool bound"
        _, cos, sin = rope_args
        full = self.dsa.is_full(index)
        x = backend.rms_norm(layer.input_norm, h)
        if full:
            keys = fmt.encode(self.indexer(index).keys(x, cos, sin))
            key_layer = self.dsa.key_layer(index)
            pool.write(key_layer, write_slots, keys, keys[:, :0])
        if split.covers(reads, pool.layout.block_size, self.dsa.index_topk):
            return None
        if not full:
            assert self.last is not None, "a shared DSA layer needs a full layer before it"
            return self.last
        indexer, k = self.indexer(index), self.dsa.index_topk
        q_latent = _q_latent(layer, x, backend)
        q = fmt.queries(indexer.queries(q_latent, cos, sin))
        rows, valid = split.index_rows(pool, key_layer, reads)
        scores = index_scores(q, indexer.head_weights(x), rows, indexer.scale, fmt.decode)
        mask = split.select(scores, valid, k, comm)
        local, count = mask_positions(mask, k)
        slots = token_slots(reads.block_ids, local, pool.layout.block_size)
        self.last = Selection(slots, count)
        return self.last


def _q_latent(layer: RankLayer, x: Tensor, backend: DecodeBackend) -> Tensor:
    """The q-LoRA output of the layer's normalized input (the rank holds q_a whole)."""
    attn = layer.attn
    assert attn.q_a is not None and attn.q_a_norm is not None, "DSA needs the q-LoRA"
    return backend.rms_norm(attn.q_a_norm, backend.linear(x, attn.q_a))

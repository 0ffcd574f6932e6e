"""One decode rank's model: its share of every layer, run one token per sequence a step.

Rank (i, j) of a group with `tp = r * m` ranks holds its layers (rank/layers.py: latent
slice i and head group j of the attention), a 1/tp slice of every FFN (dense MLP, each routed
expert and the shared experts) and a 1/tp slice of the vocabulary. Norms, the router, the
small kv_a projection and the embedding are replicated. Each layer does two all-reduces of
the hidden state (after attention, after the FFN); logits are gathered to the leader. The
step hands each kernel to the rank's backend, each collective to its `Comm`, and what its
layout decides (where tokens are cached, how attention joins the group's) to its
`CacheSplit` (rank/cache_split.py). Given a spectrum for one layer more than the model has,
the rank holds MTP module 0 too (rank/mtp.py), run by `mtp_rows` over its own cache layer,
after the model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.group.comm import Comm
from common.kv.paged_cache import CacheLayout, CacheReads, PagedLatentCache
from common.loading.rank_slices import rank_ffn, rank_norm
from common.loading.weights import ModelWeights, WeightSource
from common.model.causal_lm import DeepseekForCausalLM
from common.model.fp8 import Fp8Weight, share_workspace
from common.model.index_keys import key_format
from common.model.rope import RotaryEmbedding, scale_queries
from common.model.tpla import latent_shard
from common.parallel import ParallelConfig
from services.decode.rank.backends import DecodeBackend, TorchBackend
from services.decode.rank.cache_split import cache_split
from services.decode.rank.layers import RankAttention, RankLayer
from services.decode.rank.mtp import RankMTP, global_argmax
from services.decode.rank.sparse_rank import RankSparse


class RankModel(nn.Module):
    """Everything one rank needs for decode, read from a `WeightSource`: a checkpoint (each
    tensor sliced as it is read) or an already loaded full model. `spectra` holds each cache
    layer's latent spectrum in the serving basis (its slice's energy, `latent_shard`), or
    None for e_i = 1/r; none given: the model's layers, all None.

    The step is device-generic PyTorch; what a kernel can speed up goes through the rank's
    `DecodeBackend` (`use_backend`), chosen once at start-up.
    """

    def __init__(
        self,
        source: WeightSource | DeepseekForCausalLM,
        parallel: ParallelConfig,
        rank: int,
        spectra: Sequence[Tensor | None] | None = None,
        backend: DecodeBackend | None = None,
    ) -> None:
        super().__init__()
        src = ModelWeights(source) if isinstance(source, DeepseekForCausalLM) else source
        c = src.config
        self.config, self.parallel, self.rank = c, parallel, rank
        self.split = cache_split(parallel, rank)
        heads = parallel.heads(rank, c.num_attention_heads)
        columns = parallel.latent_columns(rank, c.kv_lora_rank)
        spectra = list(spectra) if spectra is not None else [None] * c.num_hidden_layers
        shards = [latent_shard(columns, parallel.latent_groups, s) for s in spectra]
        self.layers = nn.ModuleList(
            RankLayer(
                src,
                n,
                RankAttention(src, n, heads, shards[n], parallel.rmsnorm),
                rank_ffn(src, n, parallel, rank),
            )
            for n in range(c.num_hidden_layers)
        )
        self.embed = nn.Embedding.from_pretrained(
            src.tensor("model.embed_tokens.weight"), freeze=False
        )
        self.norm = rank_norm(src, "model.norm.weight", c.rms_norm_eps)
        self.vocab_size_padded = parallel.padded_vocab(c.vocab_size)
        rows = parallel.vocab_rows(rank, c.vocab_size)
        self.lm_head = nn.Parameter(src.tensor("lm_head.weight", rows))
        self.rope = RotaryEmbedding(c, self.lm_head.device)
        self.latent_width = columns.stop - columns.start
        self.mtp: RankMTP | None = None
        if len(shards) > c.num_hidden_layers:
            main = (self.embed.weight, self.lm_head)
            self.mtp = RankMTP(src, parallel, rank, shards[c.num_hidden_layers], main)
        # DSA: every cache layer's indexer (rank/sparse_rank.py); its key pool is bound later.
        self.sparse = RankSparse(src, len(shards)) if c.dsa is not None else None
        share_workspace(self)
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
        mtp = [self.mtp.layer] if self.mtp is not None else []
        backend.bind([*self.layers, *mtp], self.rope)
        self.backend = backend
        return backend

    def cache_layout(self, block_size: int, dtype: torch.dtype) -> CacheLayout:
        return CacheLayout(
            self.config.num_hidden_layers + (self.mtp is not None),
            self.latent_width,
            self.config.qk_rope_head_dim,
            block_size,
            dtype,
        )

    def index_layout(
        self, block_size: int, key_dtype: str, dtype: torch.dtype
    ) -> CacheLayout | None:
        """DSA: the indexer keys' pool in format `key_dtype` (common/model/index_keys.py) of
        a model computing in `dtype`; None without DSA."""
        if self.sparse is None:
            return None
        return self.sparse.layout(key_format(key_dtype, self.sparse.head_dim, dtype), block_size)

    def bind_index_pool(self, pool: PagedLatentCache) -> None:
        """DSA: the index-key pool of the `index_layout` asked for last."""
        assert self.sparse is not None
        self.sparse.bind(pool)

    def parameter_bytes(self) -> int:
        """The weights' bytes: parameters, and FP8 weights' values and scales (buffers)."""
        held = [*self.parameters(), *self.buffers()]
        return sum(p.numel() * p.element_size() for p in held)

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

        `write_slots` [B] is where each new token's latent goes on this rank (the cache's
        trash slot for a padding row, or in SP mode a token another rank owns); `reads`
        addresses the cached history (its slots / valid mask in SP mode). Every input is on
        the model's device.
        """
        h = self.decode_hidden(token_ids, positions, write_slots, reads, cache, comm)
        return self.logits(h)

    @torch.inference_mode()
    def decode_hidden(
        self,
        token_ids: Tensor,
        positions: Tensor,
        write_slots: Tensor,
        reads: CacheReads,
        cache: PagedLatentCache,
        comm: Comm,
    ) -> Tensor:
        """`decode_step` up to the last layer's output: the hidden state [B, D] before the
        final norm (what the MTP draft pass reads)."""
        self.split.check(reads)
        angles = self.angles(positions)
        h = self.embed(token_ids)
        for index, layer in enumerate(self.layers):
            h = self.layer_step(index, layer, h, angles, write_slots, reads, cache, comm)
        return h

    def angles(self, positions: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """The rows' rotary cos and sin and their query factor (None: unscaled)."""
        cos, sin = self.rope.cos_sin(positions)
        return cos, sin, self.rope.query_scale(positions)

    def layer_step(
        self,
        index: int,
        layer: RankLayer,
        h: Tensor,
        angles: tuple[Tensor, Tensor, Tensor | None],
        write_slots: Tensor,
        reads: CacheReads,
        cache: PagedLatentCache,
        comm: Comm,
    ) -> Tensor:
        """One layer (cache layer `index`) over the rows' hidden state h [B, D]; `angles`
        as `angles` gives them."""
        be, rope, split = self.backend, self.rope, self.split
        cos, sin, q_scale = angles
        q_nope, q_pe = be.attention_inputs(index, layer, rope, h, cos, sin, cache, write_slots)
        q_nope, q_pe = scale_queries(q_nope, q_pe, q_scale)
        picked = None
        if self.sparse is not None:
            at = (rope, cos, sin)
            picked = self.sparse.select(index, layer, h, at, write_slots, reads, comm, split, be)
        if picked is None:
            y = split.attend(layer.attn, q_nope, q_pe, cache, index, reads, comm, be)
        else:
            y = split.attend_selected(layer.attn, q_nope, q_pe, cache, index, picked, comm, be)
        comm.sum_(y)
        h = h + y
        f = be.ffn(layer.ffn, be.rms_norm(layer.post_norm, h))
        comm.sum_(f)
        return h + layer.ffn_output(be, f)

    @torch.inference_mode()
    def mtp_rows(
        self,
        next_ids: Tensor,
        hidden: Tensor,
        positions: Tensor,
        write_slots: Tensor,
        reads: CacheReads,
        cache: PagedLatentCache,
        comm: Comm,
    ) -> tuple[Tensor, Tensor]:
        """The MTP module at rows of positions t: token t + 1 [R] and the main model's hidden
        state at t [R, D] -> its output hidden state [R, D] (chaining reads it) and its greedy
        draft of token t + 2 [R], the same on every rank. common/model/mtp.py's `mtp_decode`
        is the same math on the whole layer."""
        mtp = self.mtp
        assert mtp is not None
        be, p = self.backend, mtp.parts
        e = be.rms_norm(p.enorm, p.embed(next_ids))
        fused = torch.cat((e, be.rms_norm(p.hnorm, hidden)), dim=-1)
        w = p.eh_proj if isinstance(p.eh_proj, Fp8Weight) else p.eh_proj.weight
        x = be.linear(fused, w)
        angles = self.angles(positions)
        h = self.layer_step(mtp.cache_layer, mtp.layer, x, angles, write_slots, reads, cache, comm)
        local = be.linear(be.rms_norm(p.norm, h), p.lm_head)
        return h, global_argmax(local, mtp.vocab_offset, comm)

    def logits(self, h: Tensor) -> Tensor:
        """The final norm and this rank's vocabulary rows, padded to the common width."""
        be = self.backend
        logits = be.linear(be.rms_norm(self.norm, h), self.lm_head)
        pad = self.vocab_size_padded - logits.shape[1]
        return F.pad(logits, (0, pad)) if pad else logits

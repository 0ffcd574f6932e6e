"""The native (C++) decode attention kernel against the per-token einsum reference."""

from __future__ import annotations

import shutil

import pytest
import torch

from common.kv.paged_cache import CacheReads, block_ids_from_slots
from common.model.tpla import latent_slice_attention
from common.native import latent_attention
from tests.paged import random_cache

# Where a compiler exists the kernel must build and load: a broken build fails here instead
# of silently running every test on the torch fallback.
pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler"
)


def test_native_kernel_builds_and_loads() -> None:
    assert latent_attention.available()


def _case(lengths, heads, width, d_r, d_n, d_v, block_size, seed=0, spread=1.0):
    cache, slots, valid, lens = random_cache(lengths, width, d_r, block_size, seed=seed)
    g = torch.Generator().manual_seed(seed + 11)
    b = len(lengths)
    q_nope = torch.randn(b, heads, d_n, generator=g) * spread
    q_pe = torch.randn(b, heads, d_r, generator=g) * spread
    w_uk = torch.randn(heads, d_n, width, generator=g) * 0.2
    w_uv = torch.randn(heads, d_v, width, generator=g) * 0.2
    return cache, slots, valid, lens, q_nope, q_pe, w_uk, w_uv


@pytest.mark.parametrize(
    ("lengths", "heads", "width", "d_r", "d_n", "d_v", "block_size"),
    [
        ([1], 1, 8, 8, 4, 4, 4),  # a single token, a single head
        ([37, 5, 16, 64], 8, 32, 8, 12, 10, 16),  # ragged, partial and exactly-full blocks
        ([130, 129], 16, 64, 16, 32, 32, 16),  # past one chunk (120 tokens) and a block edge
        ([250, 3, 241], 4, 128, 16, 32, 32, 16),  # few heads (dot-product path), 3 chunks
        ([300], 3, 20, 6, 7, 5, 8),  # widths that are no multiple of the vector length
        ([150], 8, 72, 16, 32, 24, 16),  # one sequence: heads swept four at a time
        ([90], 7, 24, 8, 16, 12, 8),  # one sequence, 7 heads: a group of four, a pair, one
        ([61, 62], 17, 40, 8, 9, 13, 4),  # odd head count: 6-row tiles and a remainder
        ([9, 200], 128, 64, 16, 16, 16, 16),  # many heads: the transposed-query path
    ],
)
def test_native_matches_reference(lengths, heads, width, d_r, d_n, d_v, block_size) -> None:
    cache, slots, valid, lens, q_nope, q_pe, w_uk, w_uv = _case(
        lengths, heads, width, d_r, d_n, d_v, block_size, seed=len(lengths) + heads
    )
    layer, scale, beta = 1, 0.3, 0.6
    n, k_pe = cache.gather(layer, slots)
    reference = latent_slice_attention(
        q_nope[:, None], q_pe[:, None], n, k_pe, valid[:, None], w_uk, w_uv, scale, beta
    )[:, 0]
    ids = block_ids_from_slots(slots, block_size)
    for threads in (1, 3):
        out = latent_attention.paged_latent_attention(
            q_nope,
            q_pe,
            cache.kv[layer],
            ids,
            lens,
            block_size,
            w_uk,
            w_uv,
            scale,
            beta,
            threads=threads,
        )
        assert out.shape == (len(lengths), heads, d_v)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_native_softmax_is_stable_for_large_scores() -> None:
    """Scores in the hundreds, the maximum in a late chunk: the online softmax rescales."""
    cache, slots, valid, lens, q_nope, q_pe, w_uk, w_uv = _case(
        [500, 333], 8, 32, 8, 16, 16, 16, seed=3, spread=30.0
    )
    cache.kv[0, int(slots[0, 450])] *= 5.0  # one dominant token far from the start
    n, k_pe = cache.gather(0, slots)
    reference = latent_slice_attention(
        q_nope[:, None], q_pe[:, None], n, k_pe, valid[:, None], w_uk, w_uv, 1.0, 1.0
    )[:, 0]
    out = latent_attention.paged_latent_attention(
        q_nope,
        q_pe,
        cache.kv[0],
        block_ids_from_slots(slots, 16),
        lens,
        16,
        w_uk,
        w_uv,
        1.0,
        1.0,
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


def test_native_rejects_bad_plans_without_reading_out_of_bounds() -> None:
    cache, slots, _, lens, q_nope, q_pe, w_uk, w_uv = _case([20, 7], 4, 16, 8, 8, 8, 8)
    ids = block_ids_from_slots(slots, 8)
    args = (q_nope, q_pe, cache.kv[0])
    weights = (w_uk, w_uv, 0.5, 1.0)
    bad = ids.clone()
    bad[0, 1] = cache.num_blocks  # one past the pool
    with pytest.raises(ValueError, match="block id"):
        latent_attention.paged_latent_attention(*args, bad, lens, 8, *weights)
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="block id"):
        latent_attention.paged_latent_attention(*args, bad, lens, 8, *weights)
    for length in (0, ids.shape[1] * 8 + 1):
        with pytest.raises(ValueError, match="length"):
            latent_attention.paged_latent_attention(
                *args, ids, torch.tensor([length, 7]), 8, *weights
            )
    with pytest.raises(ValueError, match="fp32"):
        latent_attention.paged_latent_attention(
            q_nope.double(), q_pe, cache.kv[0], ids, lens, 8, *weights
        )
    with pytest.raises(ValueError, match="contiguous"):
        latent_attention.paged_latent_attention(
            q_nope.transpose(0, 1), q_pe, cache.kv[0], ids, lens, 8, *weights
        )
    with pytest.raises(ValueError, match="shapes"):
        latent_attention.paged_latent_attention(
            q_nope, q_pe[..., :4].contiguous(), cache.kv[0], ids, lens, 8, *weights
        )
    with pytest.raises(ValueError, match="int64"):
        latent_attention.paged_latent_attention(*args, ids.int(), lens, 8, *weights)


def test_rank_attention_kernels_agree(tmp_path) -> None:
    """The rank step's `attend` with the native kernel and with the torch kernel,
    on a TPLA rank (r = 2, equal shards, beta = 1/2) and an MLA-TP rank (a head group) of a
    real (tiny) checkpoint, against `attend_reference`."""
    from common.group.comm import Comm
    from common.loading.loader import load_model
    from common.loading.weights import ModelWeights
    from common.model.tpla import latent_shards
    from common.parallel import ParallelConfig, RmsNormMode
    from services.decode.rank.backends import TorchBackend
    from services.decode.rank.backends.native_backend import NativeBackend
    from services.decode.rank.cache_split import LatentColumns
    from services.decode.rank.layers import RankAttention
    from tests.tiny import save_hf

    save_hf("v2-greedy", tmp_path, std=0.05)
    model = load_model(tmp_path)
    attn = model.model.layers[1].self_attn
    heads = attn.num_heads
    for shard, group in (
        (latent_shards(ParallelConfig(2, 2).latent_slices(attn.d_c))[1], slice(0, heads)),
        (latent_shards(ParallelConfig(1, 1).latent_slices(attn.d_c))[0], slice(heads // 2, heads)),
    ):
        rank = RankAttention(ModelWeights(model), 1, group, shard, RmsNormMode.EXACT)
        cache, slots, valid, lens = random_cache([21, 4, 140], shard.width, attn.d_r, 8, seed=5)
        g = torch.Generator().manual_seed(1)
        # Non-contiguous queries, as the engine's split of the query projection makes them.
        q = torch.randn(3, rank.num_heads, attn.d_n + attn.d_r, generator=g)
        q_nope, q_pe = q.split([attn.d_n, attn.d_r], dim=-1)
        n, k_pe = cache.gather(0, slots)
        reads = CacheReads(block_ids_from_slots(slots, 8), lens)
        with torch.no_grad():
            reference = rank.attend_reference(q_nope, q_pe, n, k_pe, valid)
            outputs = {}
            for backend in (NativeBackend(), TorchBackend()):
                split = LatentColumns(ParallelConfig(), 0)
                out = split.attend(rank, q_nope, q_pe, cache, 0, reads, Comm(1), backend)
                outputs[backend.name] = out
        for out in outputs.values():
            torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)

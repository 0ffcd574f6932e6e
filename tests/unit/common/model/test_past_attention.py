"""Tiled attention over a cached past against the untiled math: the whole score matrix under
the causal mask `key <= P + query`, softmaxed at once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from common.model.past_attention import absorbed_over_past, expanded_over_past, key_tile

HEADS, D_N, D_R, D_V, D_C = 4, 16, 8, 12, 32
SCALE = 0.17


def untiled(q_nope: Tensor, q_pe: Tensor, n: Tensor, k_pe: Tensor, kv_b: Tensor) -> Tensor:
    """The reference: expanded keys and values for every token, all scores at once."""
    q_len, total = q_nope.shape[0], n.shape[0]
    kv = F.linear(n, kv_b).view(total, HEADS, D_N + D_V)
    k_nope, v = kv.split([D_N, D_V], dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, Q, d]
    k = torch.cat((k_nope, k_pe[:, None].expand(-1, HEADS, -1)), dim=-1).transpose(0, 1)
    valid = torch.ones(q_len, total, dtype=torch.bool).tril(total - q_len)
    scores = (q @ k.transpose(1, 2) * SCALE).masked_fill(~valid, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.transpose(0, 1)).transpose(0, 1)


@pytest.mark.parametrize(
    ("past", "queries", "tile"),
    [(0, 9, 4), (37, 5, 16), (40, 24, 16), (3, 40, 7), (64, 1, 1000), (50, 30, None)],
)
@pytest.mark.parametrize("over", [expanded_over_past, absorbed_over_past])
def test_tiles_equal_the_untiled_softmax(past: int, queries: int, tile: int | None, over) -> None:
    g = torch.Generator().manual_seed(past * 100 + queries)
    total = past + queries
    q_nope = torch.randn(queries, HEADS, D_N, generator=g, dtype=torch.float64)
    q_pe = torch.randn(queries, HEADS, D_R, generator=g, dtype=torch.float64)
    n = torch.randn(total, D_C, generator=g, dtype=torch.float64)
    k_pe = torch.randn(total, D_R, generator=g, dtype=torch.float64)
    kv_b = torch.randn(HEADS * (D_N + D_V), D_C, generator=g, dtype=torch.float64) * 0.3
    got = over(q_nope, q_pe, n, k_pe, kv_b, SCALE, tile)
    torch.testing.assert_close(got, untiled(q_nope, q_pe, n, k_pe, kv_b), atol=1e-10, rtol=1e-9)


def test_the_tile_bounds_the_scores_held_at_once() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # V3's 128 heads over an 8K chunk: 256 keys a tile on a GPU (1 GiB of fp32 scores).
    assert key_tile(128, 8192, cuda) == 256
    assert key_tile(8, 1024, cpu) == 512
    assert key_tile(128, 8192, cpu) == 16  # the floor

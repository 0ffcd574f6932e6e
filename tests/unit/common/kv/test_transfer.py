"""A prompt's shard cut chunk by chunk (`cut_chunk`) lands, slot for slot, where the whole
shard lands: TPLA latent slices and SP token ranges, chunks that start inside a block."""

from __future__ import annotations

import itertools

import pytest
import torch

from common.kv.transfer import cut_chunk, cut_shard
from common.kv.wire import shard_segments, shard_slots
from common.messages import KvTargetInfo

BS = 4


def _placed(shards) -> dict[int, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Slot -> the row [L, w + d_r] the receiver writes there; the segments both ends cut
    agree with the slots (their groups of tokens run over consecutive slots)."""
    out: dict[int, torch.Tensor] = {}
    for shard in shards:
        slots = shard_slots(shard.header())
        cut = shard_segments(shard.header())
        grouped = cut.group_slots[:, None] + torch.arange(cut.group)
        assert torch.equal(grouped.reshape(-1), slots)
        for i, slot in enumerate(slots.tolist()):
            assert slot not in out, "a slot written twice"
            out[slot] = shard.kv[:, i]
    return out


@pytest.mark.parametrize(
    "target",
    [
        KvTargetInfo(1, "a", "", 8, 8, (7, 3, 9, 2, 5, 11)),  # a TPLA latent slice
        # SP: positions 0-3 and 8-11 and 16-20 (a ragged last chunk) on this rank
        KvTargetInfo(0, "a", "", 0, 16, (6, 2, 8, 10), (0, 4, 8, 12, 16, 21)),
    ],
)
def test_chunks_land_where_the_whole_shard_lands(target: KvTargetInfo) -> None:
    g = torch.Generator().manual_seed(0)
    rows = 21
    n = [torch.randn(rows, 16, generator=g) for _ in range(2)]
    k_pe = [torch.randn(rows, 3, generator=g) for _ in range(2)]
    whole = _placed([cut_shard(n, k_pe, 0, rows, target, "r", BS)])
    bounds = [0, 3, 9, 10, 17, 21]
    chunks = [cut_chunk(n, k_pe, lo, hi, target, "r", BS) for lo, hi in itertools.pairwise(bounds)]
    got = _placed([c for c in chunks if c.kv.shape[1]])
    assert got.keys() == whole.keys()
    for slot, row in whole.items():
        assert torch.equal(got[slot], row)

"""Step buckets: every size lands in the smallest bucket that holds it."""

from __future__ import annotations

import pytest

from services.decode.group.buckets import batch_bucket, batch_buckets, width_bucket, width_buckets


def test_batch_buckets_are_powers_of_two_then_max_batch() -> None:
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert [batch_bucket(b, 24) for b in (1, 2, 3, 5, 9, 17, 24)] == [1, 2, 4, 8, 16, 24, 24]
    for max_batch in (1, 7, 32):
        assert {batch_bucket(b, max_batch) for b in range(1, max_batch + 1)} == set(
            batch_buckets(max_batch)
        )
    with pytest.raises(ValueError):
        batch_bucket(33, 32)


def test_width_buckets_hold_their_blocks_and_waste_under_half() -> None:
    assert width_buckets(20) == [1, 2, 3, 4, 6, 8, 12, 16, 20]
    for blocks in range(1, 300):
        width = width_bucket(blocks)
        assert blocks <= width < 1.5 * blocks or width == blocks == 1
        assert width_bucket(blocks, 256) == min(width, 256) if blocks <= 256 else True
    with pytest.raises(ValueError):
        width_bucket(21, 20)

"""Step buckets: every size lands in the smallest bucket that holds it."""

from __future__ import annotations

import pytest

from common.step_shapes import (
    StepShape,
    batch_bucket,
    batch_buckets,
    step_shapes,
    width_bucket,
    width_buckets,
)


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


def test_width_buckets_grow_eightfold_from_a_thousand_tokens_to_the_context_limit() -> None:
    assert width_buckets(20, 16) == [20]
    assert width_buckets(10240, 16) == [64, 512, 4096, 10240]
    assert width_buckets(4096, 64) == [16, 128, 1024, 4096]
    for blocks in range(1, 10241, 7):
        width = width_bucket(blocks, 10240, 16)
        assert blocks <= width and width in width_buckets(10240, 16)
        assert width == 64 or width < 8 * blocks or width == 10240
    with pytest.raises(ValueError):
        width_bucket(21, 20, 16)


def test_a_deepseek_v3_group_captures_at_most_48_graphs() -> None:
    """163,840 positions at 16 tokens a block, batch 128 (k8s/overlays/gpu), MTP drafts on
    (k = 1 at up to 4 sequences: 8 rows)."""
    plain = step_shapes(128, 163840 // 16, 16)
    drafting = step_shapes(128, 163840 // 16, 16, draft_rows=4 * 2)
    assert len(plain) == 32 and len(drafting) == 48
    assert {s.batch for s in drafting if s.drafts} == {1, 2, 4, 8}
    assert drafting[0] == StepShape(128, 10240) and drafting[-1] == StepShape(1, 64)

"""Chunked SP's round-robin bookkeeping: which rank owns a position, and where it sits there."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.chunks import chunk_owner, local_index, local_length
from common.parallel import ParallelConfig, ParallelMode


@settings(max_examples=60, deadline=None)
@given(total=st.integers(0, 200), chunk=st.integers(1, 9), ranks=st.integers(1, 4))
def test_round_robin_bookkeeping(total: int, chunk: int, ranks: int) -> None:
    seen: dict[int, list[int]] = {r: [] for r in range(ranks)}
    for pos in range(total):
        owner = chunk_owner(pos, chunk, ranks)
        assert local_index(pos, chunk, ranks) == len(seen[owner])  # contiguous local order
        seen[owner].append(pos)
    lengths = [local_length(total, r, chunk, ranks) for r in range(ranks)]
    par = ParallelConfig(tp=ranks, mode=ParallelMode.SP, chunk_size=chunk)
    # A growing sequence stays balanced: no rank holds more than one chunk more than another.
    assert max(lengths) - min(lengths) <= chunk
    for r in range(ranks):
        assert lengths[r] == len(seen[r])
        flat = [p for lo, hi in par.owned_ranges(r, total) for p in range(lo, hi)]
        assert flat == seen[r]

"""The selection rule (common/model/topk.py): the k highest scores, ties by position; the
static-shape mask equals the stable-sort reference; merging ranks' candidates by the
threshold selects exactly what one rank holding every token would."""

from __future__ import annotations

import pytest
import torch

from common.model.topk import (
    candidates,
    mask_positions,
    threshold,
    topk_mask,
    topk_mask_reference,
    within,
)


def _tied_scores(rows: int, tokens: int, seed: int) -> torch.Tensor:
    """Scores drawn from a few values, so ties at the k-th score are the rule, not luck."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, (rows, tokens), generator=gen).float() * 0.5


@pytest.mark.parametrize("k", [1, 3, 8, 31, 40])
def test_mask_equals_the_stable_sort_reference_under_ties(k: int) -> None:
    scores = _tied_scores(16, 32, k)
    ends = torch.randint(0, 32, (16, 1), generator=torch.Generator().manual_seed(k))
    valid = torch.arange(32)[None] <= ends
    got = topk_mask(scores, valid, k)
    assert torch.equal(got, topk_mask_reference(scores, valid, k))
    assert torch.equal(got.sum(-1), valid.sum(-1).clamp(max=k))


def test_ties_go_to_the_lower_position() -> None:
    scores = torch.tensor([[1.0, 2.0, 1.0, 2.0, 1.0]])
    valid = torch.ones_like(scores, dtype=torch.bool)
    assert topk_mask(scores, valid, 3).tolist() == [[True, True, False, True, False]]


def test_positions_come_out_ascending_with_their_count() -> None:
    mask = torch.tensor([[False, True, False, True, True], [True, False, False, False, False]])
    pos, count = mask_positions(mask, 4)
    assert count.tolist() == [3, 1]
    assert pos[0, :3].tolist() == [1, 3, 4] and pos[1, :1].tolist() == [0]


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("k", [2, 5, 12])
def test_threshold_over_ranks_candidates_equals_one_rank(ranks: int, k: int) -> None:
    """SP: tokens dealt over ranks in chunks of 4; each rank offers its own k best, the
    threshold of all offers selects, on each rank, exactly its part of the global choice."""
    rows, tokens, chunk = 6, 40, 4
    scores = _tied_scores(rows, tokens, 7 * ranks + k)
    lengths = torch.tensor([1, 3, 9, 17, 33, 40])
    positions = torch.arange(tokens)
    valid = positions[None] < lengths[:, None]
    expected = topk_mask(scores, valid, k)
    owner = (positions // chunk) % ranks
    offers = []
    for rank in range(ranks):
        mine = positions[owner == rank]
        at = mine.expand(rows, -1)
        offers.append(candidates(scores[:, mine], valid[:, mine], at, k))
    kth = threshold(torch.cat([o[0] for o in offers], -1), torch.cat([o[1] for o in offers], -1), k)
    for rank in range(ranks):
        mine = positions[owner == rank]
        got = within(scores[:, mine], mine.expand(rows, -1), valid[:, mine], kth)
        assert torch.equal(got, expected[:, mine])

"""A prefill rank's embedding lookup by vocabulary shard: each rank holds the rows of its
vocabulary slice, looks up the ids that fall in it (zero for the others), and the group's sum
is every id's row exactly once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def vocab_embedding(input_ids: Tensor, rows: Tensor, vocab: slice) -> Tensor:
    """The embedding of the ids that fall in `vocab` (rows [V_rank, D] are its rows), zero
    for the others: summed over the ranks, every id's row exactly once."""
    local = input_ids - vocab.start
    held = (local >= 0) & (local < rows.shape[0])
    h = F.embedding(torch.where(held, local, 0), rows)
    return torch.where(held[:, None], h, 0)

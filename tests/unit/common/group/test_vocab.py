"""`gather_vocab`: uneven vocabulary shards joined in vocabulary order on rank 0 alone."""

from __future__ import annotations

import pytest
import torch

from common.group.comm import Comm
from common.group.vocab import gather_vocab
from common.parallel import ParallelConfig
from tests.shard_checkpoints import run_group


@pytest.mark.parametrize(("tp", "vocab"), [(1, 7), (2, 10), (3, 10), (4, 13)])
def test_shards_join_in_vocabulary_order_on_rank_0(tp: int, vocab: int) -> None:
    whole = torch.randn(3, vocab, generator=torch.Generator().manual_seed(tp))
    layout = ParallelConfig(tp=tp)

    def rank(r: int, comm: Comm) -> torch.Tensor | None:
        return gather_vocab(comm, whole[:, layout.vocab_rows(r, vocab)], vocab)

    got = run_group(tp, rank)
    assert got[0] is not None and torch.equal(got[0], whole)
    assert all(g is None for g in got[1:])


def test_a_shard_of_no_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="5 columns is no rank's of 10"):
        run_group(3, lambda r, comm: gather_vocab(comm, torch.zeros(1, 5), 10))

"""A vocabulary-split row of logits gathered whole on rank 0.

Each rank of a group holds `ParallelConfig.vocab_rows` of the LM head, so its logits are
[rows, V_rank] with V_rank uneven when tp does not divide V. A collective gathers equal shapes:
every shard is padded to the widest (`padded_vocab`) and rank 0 keeps the real columns
(`vocab_columns`), in vocabulary order.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from common.group.comm import Comm
from common.parallel import ParallelConfig, span


def gather_vocab(comm: Comm, shard: Tensor, vocab_size: int) -> Tensor | None:
    """This rank's logits [rows, V_rank] -> the whole logits [rows, vocab_size] on rank 0,
    None on the other ranks. Every rank of `comm` calls it with its own shard."""
    layout = ParallelConfig(tp=comm.tp)
    rank_width = shard.shape[-1]
    padded = layout.padded_vocab(vocab_size)
    widths = {span(layout.vocab_rows(r, vocab_size)) for r in range(comm.tp)}
    if rank_width not in widths:
        raise ValueError(f"a vocabulary shard of {rank_width} columns is no rank's of {vocab_size}")
    parts = comm.gather(F.pad(shard, (0, padded - rank_width)))
    if parts is None:
        return None
    whole = parts.transpose(0, 1).reshape(shard.shape[0], comm.tp * padded)
    return whole[:, layout.vocab_columns(vocab_size)]

"""Block-table addressing: token position -> cache slot (DESIGN §6).

A paged cache stores token p of a sequence at offset p % block_size of the sequence's block
p // block_size, so its flat slot is table[p // block_size] * block_size + p % block_size.
Every reader and writer of the cache (the decode step's writes, the per-token reads, the KV
receiver, the Triton reference) computes it here.
"""

from __future__ import annotations

from torch import Tensor


def token_slots(table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Flat cache slots of `positions` [..., T] in block tables `table` [..., nb] (the same
    leading dims; an index tensor of int64). A position past the table reads its last block, so
    callers that pass padding positions mask them; padding entries (-1) give negative slots."""
    index = (positions // block_size).clamp(max=table.shape[-1] - 1)
    return table.gather(-1, index) * block_size + positions % block_size

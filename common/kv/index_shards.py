"""DSA: a prompt's indexer keys cut per decode rank, as shards of the rank's index-key pool.

The keys go where the latents go (common/kv/transfer.py `cut_chunk`): to every rank, whole,
in MLA-TP and TPLA (each rank scores every token); to the chunk owner in SP. Encoded in the
group's key format first (common/model/index_keys.py), so a shard is the pool's rows as they
are stored, and lands like a latent shard (`Shard.index_keys` routes it to the key pool).
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from common.kv.transfer import Shard, cut_chunk
from common.messages import KvTargetInfo
from common.model.index_keys import IndexKeyFormat


def cut_index_chunk(
    keys: list[Tensor],
    lo: int,
    hi: int,
    target: KvTargetInfo,
    request_id: str,
    block_size: int,
    fmt: IndexKeyFormat,
) -> Shard:
    """`cut_chunk` of the keys (per full layer, [rows, d_I], row 0 the first token the target
    is sent): `target`'s part of rows [lo, hi), in the pool's rows of `fmt`."""
    rows = [fmt.encode(k[:hi]) for k in keys]
    whole = dataclasses.replace(target, latent_start=0, latent_width=fmt.width)
    shard = cut_chunk(rows, [r[:, :0] for r in rows], lo, hi, whole, request_id, block_size)
    return dataclasses.replace(shard, index_keys=True)

"""How a prefill group's rank gets its model: a `RankModelLoader` (the group's modules take
one), and `load_group_rank`, the one serving uses: the share of
services/prefill/rank/prefill_rank_model.py, whose prefill gives the whole latents (equal on
every rank) and this rank's vocabulary shard of the logits, which `gather_vocab` joins on the
leader."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.group.comm import Comm
from services.prefill.config import PrefillGroupConfig, rank_layout
from services.prefill.rank.prefill_rank_model import PrefillRankModel, load_prefill_rank

# (the group's config, this rank, its Comm, its device) -> the rank's model share.
RankModelLoader = Callable[[PrefillGroupConfig, int, Comm, torch.device], PrefillRankModel]


def load_group_rank(
    cfg: PrefillGroupConfig, rank: int, comm: Comm, device: torch.device
) -> PrefillRankModel:
    """A `RankModelLoader`: rank `rank`'s share of the serving model (the MTP layer's too
    with `cfg.mtp`), read shard-wise onto `device`."""
    return load_prefill_rank(
        cfg.model,
        cfg.reparam,
        rank_layout(cfg),
        rank,
        comm,
        dtype=cfg.dtype,
        device=device,
        weight_dtype=cfg.weight_dtype,
        kernels=cfg.kernels,
        mtp=cfg.mtp,
    )

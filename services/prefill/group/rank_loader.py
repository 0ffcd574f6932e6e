"""How a prefill group's rank gets its model: a `RankModelLoader` (the group's modules take
one), and `load_group_rank`, the one serving uses (its loading progress against its share's
estimated stored bytes, `expect_share`): the share of
services/prefill/rank/prefill_rank_model.py, whose prefill gives the whole latents (equal on
every rank) and this rank's vocabulary shard of the logits, which `gather_vocab` joins on the
leader."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.group.comm import Comm
from common.model.args import ModelConfig
from common.runtime.load_meter import current_meter
from common.tpla.rank_memory import prefill_rank_tensors
from common.tpla.share_bytes import share_bytes
from services.prefill.config import PrefillGroupConfig, rank_layout
from services.prefill.rank.prefill_rank_model import PrefillRankModel, load_prefill_rank

# (the group's config, this rank, its Comm, its device) -> the rank's model share.
RankModelLoader = Callable[[PrefillGroupConfig, int, Comm, torch.device], PrefillRankModel]


def load_group_rank(
    cfg: PrefillGroupConfig, rank: int, comm: Comm, device: torch.device
) -> PrefillRankModel:
    """A `RankModelLoader`: rank `rank`'s share of the serving model (the MTP layer's too
    with `cfg.mtp`), read shard-wise onto `device`."""
    expect_share(cfg, rank)
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


def expect_share(cfg: PrefillGroupConfig, rank: int) -> None:
    """Tell this thread's loading meter (if metered) rank `rank`'s share in stored bytes, the
    total its progress is shown against; an estimate that cannot be made leaves it unknown
    (the load itself names what is wrong)."""
    meter = current_meter()
    if meter is None:
        return
    try:
        c = ModelConfig.from_dir(cfg.model)
        tensors = prefill_rank_tensors(c, rank_layout(cfg), rank, 1 if cfg.mtp else 0)
        meter.expect(share_bytes(cfg.model, tensors))
    except (ValueError, OSError):
        return

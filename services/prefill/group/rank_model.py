"""What a prefill rank runs, as the group sees it: a model sharded over the group's `Comm`
whose prefill gives the whole latents (equal on every rank) and this rank's vocabulary
shard of the logits, which `gather_vocab` joins on the leader. The group's modules take a
`RankModelLoader` and never name the model they run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from common.group.comm import Comm
from common.model.args import ModelConfig
from common.model.model import PastLatents, PrefillOutput
from services.prefill.group.config import PrefillGroupConfig


class PrefillRankModel(Protocol):
    config: ModelConfig

    def prefill(
        self,
        input_ids: Tensor,
        seq_lens: list[int],
        *,
        all_logits: bool = False,
        past: Sequence[PastLatents | None] | None = None,
    ) -> PrefillOutput:
        """Packed prompts -> this rank's vocabulary shard of the logits and the whole
        per-layer latents."""
        ...

    def gather_vocab(self, shard: Tensor) -> Tensor | None:
        """Every rank's logits shard joined into the whole logits on rank 0 (None on the
        others); a collective: every rank calls it."""
        ...


# (the group's config, this rank, its Comm, its device) -> the rank's model share.
RankModelLoader = Callable[[PrefillGroupConfig, int, Comm, torch.device], PrefillRankModel]

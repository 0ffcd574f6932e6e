"""The stand-in for a prefill rank's sharded model: every rank holds the whole
`DeepseekForCausalLM` and returns its vocabulary slice of the logits, so the group's
plumbing (plans, the vocabulary gather, per-rank KV shipping, faults) runs before the
sharded model does. It costs every rank the whole model's memory; the sharded
PrefillRankModel replaces this module."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from common.group.comm import Comm
from common.loading.serving_model import load_prefill_model
from common.model.model import DeepseekForCausalLM, PastLatents, PrefillOutput
from common.parallel import ParallelConfig
from services.prefill.group.config import PrefillGroupConfig


class ReplicatedRankModel:
    def __init__(self, model: DeepseekForCausalLM, comm: Comm, rank: int) -> None:
        self.model, self.comm, self.rank = model, comm, rank
        self.config = model.config
        self._par = ParallelConfig(tp=comm.tp)

    def prefill(
        self,
        input_ids: Tensor,
        seq_lens: list[int],
        *,
        all_logits: bool = False,
        past: Sequence[PastLatents | None] | None = None,
    ) -> PrefillOutput:
        out = self.model.prefill(input_ids, seq_lens, all_logits=all_logits, past=past)
        rows = self._par.vocab_rows(self.rank, self.config.vocab_size)
        return PrefillOutput(out.logits[:, rows].contiguous(), out.n, out.k_pe)

    def gather_vocab(self, shard: Tensor) -> Tensor | None:
        vocab = self.config.vocab_size
        padded = self._par.padded_vocab(vocab)
        parts = self.comm.gather(F.pad(shard, (0, padded - shard.shape[-1])))
        if parts is None:
            return None
        whole = parts.permute(1, 0, 2).reshape(shard.shape[0], -1)  # [rows, tp * padded]
        return whole[:, torch.tensor(self._par.vocab_columns(vocab), device=shard.device)]


def load_replicated_rank(
    cfg: PrefillGroupConfig, rank: int, comm: Comm, device: torch.device
) -> ReplicatedRankModel:
    """A `RankModelLoader`: the whole serving model on `device`."""
    model = load_prefill_model(
        cfg.model, cfg.reparam, cfg.dtype, cfg.attention_backend, str(device), cfg.weight_dtype
    )
    return ReplicatedRankModel(model, comm, rank)

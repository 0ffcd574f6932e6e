"""What a prefill worker runs its batches on: the whole model in this process (tp = 1,
`LocalRunner`), or a prefill group of ranks (services/prefill/group/leader.py).

The worker's batcher stays the same either way: it plans a batch (`BatchPlan`), calls
`prefill` for the batch's logits (whole, on this process) and latents (whole: every rank of
a group holds them), samples, and calls `ship` for each job's KV sends, futures of the bytes
each decode rank acknowledged.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
from torch import Tensor

from common.kv.transfer import KvSender
from common.model.args import ModelConfig
from common.model.causal_lm import DeepseekForCausalLM, PastLatents, PrefillOutput
from common.model.index_keys import index_format
from common.model.mtp import MTPLayer, whole_prefill_with_mtp
from services.prefill.batch.batch_plan import BatchPlan, JobPlan
from services.prefill.shipping import Send, Shipper


class PrefillRunner(abc.ABC):
    config: ModelConfig
    device: torch.device  # where the worker's logits and latents live
    transport: str  # the KV transport's name (metrics)
    # Its output holds the MTP layer's latents as one more layer: the worker sends each
    # prompt's last hidden state with its first token (the decode ranks' first drafts).
    sends_hidden: bool = False

    @abc.abstractmethod
    def prefill(self, plan: BatchPlan, past: list[PastLatents | None] | None) -> PrefillOutput:
        """The batch's whole logits and latents; `past`: each job's cached prefix (the
        leader's lookup), or None when no job has one."""

    @abc.abstractmethod
    def ship(
        self,
        job: JobPlan,
        n: list[Tensor],
        k_pe: list[Tensor],
        timed: Callable[[int, str, Send], Send] | None = None,
        rows: tuple[int, int] | None = None,
        keys: Sequence[Tensor] = (),
    ) -> list[Future[int]]:
        """Start `job`'s KV sends from its latents (positions `skip` on; only rows [lo, hi)
        of them with `rows`, a chunk), and a DSA model's indexer keys alike: each resolves to
        the bytes a decode rank acknowledged, or fails with the send's error."""

    @property
    def failed(self) -> BaseException | None:
        """Why the runner can serve no more batches (a group's rank died), else None."""
        return None

    def check(self) -> None:  # noqa: B027 - optional hook
        """Look for a failure between batches (an idle group's rank that died)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class LocalRunner(PrefillRunner):
    """The whole model here; this process ships every decode rank's shard. With `mtp` (the
    decode ranks run MTP drafts), its latents over the prompts are one more layer of the
    batch's output (`whole_prefill_with_mtp`), shipped and cached with the others."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        sender: KvSender,
        mtp: MTPLayer | None = None,
        index_cache_dtype: str = "model",
    ) -> None:
        self.model, self.mtp = model, mtp
        self.sends_hidden = mtp is not None
        self.config = model.config
        self.device = model.lm_head.weight.device
        self.transport = sender.name
        dtype = model.lm_head.weight.dtype
        fmt = index_format(model.config, index_cache_dtype, dtype)
        self.shipper = Shipper(sender, self.device, key_format=fmt)

    def prefill(self, plan: BatchPlan, past: list[PastLatents | None] | None) -> PrefillOutput:
        ids, model, layer = plan.ids(self.device), self.model, self.mtp
        if layer is None:
            return model.prefill(ids, plan.lens, all_logits=plan.all_logits, past=past)
        next_ids = plan.next_ids(self.device)
        return whole_prefill_with_mtp(
            model, layer, ids, plan.lens, next_ids, all_logits=plan.all_logits, past=past
        )

    def ship(
        self,
        job: JobPlan,
        n: list[Tensor],
        k_pe: list[Tensor],
        timed: Callable[[int, str, Send], Send] | None = None,
        rows: tuple[int, int] | None = None,
        keys: Sequence[Tensor] = (),
    ) -> list[Future[int]]:
        return self.shipper.ship(job.order, n, k_pe, timed=timed, rows=rows, keys=keys)

    def close(self) -> None:
        self.shipper.close()

"""One prefill rank's model: its share of every layer, run over a batch's packed prompts.

Rank k of a tp=N prefill group (MLA-TP: `ParallelConfig` with one latent group) holds the
whole latent projection of every layer (kv_a and its norm, so every rank computes the whole
latent n, k_pe of each token), its head group's query rows, kv_b rows and o_proj columns, a
1/N slice of every FFN (`rank_ffn`: dense columns, the routed experts by `TPLA_MOE_PARALLEL`,
the shared experts by columns, the router replicated) and 1/N of the vocabulary, for the
embedding and the LM head. Under `ep` its MoE layers size their routed rows to the slots
their experts take (`size_to_held`: about T * k / N rows, not T * k on every rank). It runs
`packed_prefill`, the whole model's loop: the embedding (a masked lookup), each layer's
attention output and FFN output are summed over the group (`Comm.sum_`), and the logits are
this rank's vocabulary shard (`gather_vocab` joins them).
With `mtp` (the decode groups run MTP drafts) it holds its share of the MTP layer too
(services/prefill/rank/mtp.py), whose latents over the prompts are one more layer of its
output, as the tp = 1 worker's are.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.group.comm import Comm
from common.loading.loader import serving_dtype
from common.loading.rank_slices import head_layer, rank_norm
from common.loading.serving_kernels import PrefillKernels
from common.loading.serving_model import open_serving_weights, require_mtp
from common.loading.weights import ModelWeights, WeightSource
from common.model.causal_lm import (
    DecoderLayer,
    DeepseekForCausalLM,
    PastLatents,
    PrefillOutput,
    packed_prefill,
)
from common.model.fp8 import share_workspace
from common.model.moe import size_to_held
from common.model.mtp import prefill_with_mtp, prompt_own_next_ids
from common.model.prefill_attention import PrefillAttention, SdpaPrefillAttention
from common.model.rope import RotaryEmbedding
from common.parallel import ParallelConfig, ParallelError
from common.runtime.kernel_choice import KernelConfig
from services.prefill.rank.embedding import vocab_embedding
from services.prefill.rank.mtp import PrefillRankMTP, RankMTPStack


class PrefillRankModel(nn.Module):
    """Everything one prefill rank needs, read from a `WeightSource` (a checkpoint, each
    tensor sliced as it is read) or an already loaded whole model; `comm` is its group.
    `mtp`: its share of MTP module 0 too, from a source that serves it (built with
    `mtp=True`)."""

    def __init__(
        self,
        source: WeightSource | DeepseekForCausalLM,
        parallel: ParallelConfig,
        rank: int,
        comm: Comm,
        attention: PrefillAttention | None = None,
        *,
        mtp: bool = False,
    ) -> None:
        super().__init__()
        src = ModelWeights(source) if isinstance(source, DeepseekForCausalLM) else source
        c = src.config
        if not parallel.splits_heads_only:
            raise ParallelError(f"a prefill group splits by heads (mla-tp), not {parallel.label}")
        if comm.tp != parallel.tp or not 0 <= rank < parallel.tp:
            raise ParallelError(f"rank {rank} of a group of {comm.tp} for tp={parallel.tp}")
        parallel.check(c)
        self.config, self.parallel, self.rank, self.comm = c, parallel, rank, comm
        self.vocab = parallel.vocab_rows(rank, c.vocab_size)
        self.layers = nn.ModuleList(
            head_layer(src, n, parallel, rank) for n in range(c.num_hidden_layers)
        )
        self.embed_rows = nn.Parameter(src.tensor("model.embed_tokens.weight", self.vocab))
        self.norm = rank_norm(src, "model.norm.weight", c.rms_norm_eps)
        self.lm_head = nn.Parameter(src.tensor("lm_head.weight", self.vocab))
        self.mtp = (
            PrefillRankMTP(src, parallel, rank, (self.embed_rows, self.lm_head)) if mtp else None
        )
        self.rope = RotaryEmbedding(c, self.lm_head.device)
        self.prefill_attention: PrefillAttention = attention or SdpaPrefillAttention()
        share_workspace(self)
        size_to_held(self)

    @property
    def device(self) -> torch.device:
        return self.lm_head.device

    def place(self, device: torch.device | str) -> None:
        """Move the weights and the rotary tables to `device`."""
        self.to(device)
        self.rope = RotaryEmbedding(self.config, device)

    def parameter_bytes(self) -> int:
        """The weights' bytes this rank holds: parameters, and FP8 weights' values and scales
        (buffers); what `tpla plan` sizes a prefill rank by."""
        held = [*self.parameters(), *self.buffers()]
        return sum(p.numel() * p.element_size() for p in held)

    # -- LayerStack ------------------------------------------------------------------------

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        return cast(Sequence[DecoderLayer], self.layers)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.reduce(vocab_embedding(input_ids, self.embed_rows, self.vocab))

    def reduce(self, partial: Tensor) -> Tensor:
        self.comm.sum_(partial)
        return partial

    def logits(self, h: Tensor) -> Tensor:
        """This rank's vocabulary shard of the logits [R, V_rank]."""
        return F.linear(self.norm(h), self.lm_head)

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: Tensor,
        seq_lens: list[int],
        *,
        all_logits: bool = False,
        absorbed: bool = False,
        past: Sequence[PastLatents | None] | None = None,
        next_ids: Tensor | None = None,
    ) -> PrefillOutput:
        """`DeepseekForCausalLM.prefill` over this rank's share; every rank of the group calls
        it with the same batch. `n` / `k_pe` are the whole latents (equal on every rank), the
        logits this rank's vocabulary shard [rows, V_rank] (`self.vocab`), `hidden` whole.
        With the MTP layer, its latents are the last layer (`prefill_with_mtp`, as on the tp = 1
        worker; `next_ids` as there, each prompt's last row its own token when not given)
        and each `past` holds its cached ones last."""
        mtp = self.mtp
        if mtp is None:
            return packed_prefill(
                self, input_ids, seq_lens, all_logits=all_logits, absorbed=absorbed, past=past
            )

        def mtp_stack(hidden: Tensor) -> RankMTPStack:
            return RankMTPStack(mtp, hidden, self.rope, self.reduce)

        return prefill_with_mtp(
            self,
            mtp_stack,
            input_ids,
            seq_lens,
            prompt_own_next_ids(input_ids, seq_lens) if next_ids is None else next_ids,
            all_logits=all_logits,
            absorbed=absorbed,
            past=past,
        )


def load_prefill_rank(
    model_dir: str | Path,
    reparam: str | None,
    parallel: ParallelConfig,
    rank: int,
    comm: Comm,
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    weight_dtype: str = "auto",
    kernels: KernelConfig | None = None,
    mtp: bool = False,
) -> PrefillRankModel:
    """Rank `rank`'s share of the serving model (rotated when `reparam` is set), read from
    the checkpoint slice by slice straight onto `device` (an FP8 checkpoint's linears kept
    FP8 where `weight_dtype` says so), on the kernels `kernels` asks for (all `auto` when
    None); `mtp`: with its share of the MTP layer (ValueError naming the model if it has
    none)."""
    chosen = PrefillKernels.select(kernels or KernelConfig(), device, serving_dtype(dtype))
    weights, _ = open_serving_weights(model_dir, reparam, dtype, device, weight_dtype, mtp=mtp)
    if mtp:
        require_mtp(weights, model_dir)
    model = PrefillRankModel(weights, parallel, rank, comm, mtp=mtp)
    model.prefill_attention = chosen.attention_backend()
    chosen.weights.apply(model)
    return model

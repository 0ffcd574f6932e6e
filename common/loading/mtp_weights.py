"""DeepSeek-V3's MTP layers read from a weight source: whole (`build_mtp_layer`), or a rank's
share of the parts around the decoder layer (`RankMTPParts`).

The decoder layer of MTP module k is checkpoint layer L = num_hidden_layers + k, so a rank
takes its share of it with the same slicers as any layer (`head_layer`, `rank_ffn` and the
decode rank's `RankLayer` given index L) from a source built with `mtp=True`.

V3 stores an embedding and an output head in every MTP layer; the report says they are the
main model's. Given the main model, a stored copy equal to the main model's tensor is
dropped and the main model's parameter is used (one copy in memory); a copy that differs is
kept; a layer without them uses the main model's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from common.loading.checkpoint import CheckpointError
from common.loading.loader import serving_dtype
from common.loading.model_builder import fill_module
from common.loading.rank_slices import place_linear, rank_norm
from common.loading.weights import CheckpointWeights, WeightSource
from common.model.causal_lm import DeepseekForCausalLM
from common.model.fp8 import Fp8Weight, Weight, share_workspace
from common.model.mtp import SHARED_WITH_MAIN, MTPLayer, mtp_layer_index
from common.parallel import ParallelConfig


def _main_tensor(main: DeepseekForCausalLM, name: str) -> nn.Parameter | None:
    return dict(main.named_parameters()).get(name)


def build_mtp_layer(src: WeightSource, k: int, main: DeepseekForCausalLM | None = None) -> MTPLayer:
    """MTP module k, whole, from `src` (a source built with `mtp=True`)."""
    c = src.config
    index = mtp_layer_index(c, k)
    prefix = f"model.layers.{index}."
    with torch.device("meta"):
        layer = MTPLayer(c, index)
    fill_module(layer, src, prefix, skip=frozenset(name for name, _ in SHARED_WITH_MAIN))
    for name, main_name in SHARED_WITH_MAIN:
        module, leaf = name.rsplit(".", 1)
        value = _shared_tensor(src, prefix + name, main_name, main)
        if isinstance(value, nn.Parameter):
            setattr(layer.get_submodule(module), leaf, value)
        elif module == "embed_tokens":
            layer.embed_tokens.weight = nn.Parameter(value, requires_grad=False)
        else:
            place_linear(layer.shared_head, "head", value)
    share_workspace(layer)
    return layer.eval()


def _shared_tensor(
    src: WeightSource, stored: str, main_name: str, main: DeepseekForCausalLM | None
) -> Weight | nn.Parameter:
    """The layer's copy of a main-model tensor, or the main model's own when equal."""
    ours = _main_tensor(main, main_name) if main is not None else None
    if not src.has(stored):
        if ours is not None:
            return ours
        return src.linear(main_name) if main_name == "lm_head.weight" else src.tensor(main_name)
    value = src.linear(stored) if stored.endswith("head.weight") else src.tensor(stored)
    if (
        ours is not None
        and not isinstance(value, Fp8Weight)
        and value.shape == ours.shape
        and torch.equal(value.to(ours.device), ours.detach())
    ):
        return ours
    return value


def load_mtp_layers(
    model_dir: str | Path,
    *,
    main: DeepseekForCausalLM | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    keep_fp8: bool = False,
) -> list[MTPLayer]:
    """Every MTP module of the checkpoint in `model_dir`, in order (an empty list for a
    model without `num_nextn_predict_layers`)."""
    src = CheckpointWeights(model_dir, serving_dtype(dtype), device, keep_fp8=keep_fp8, mtp=True)
    return [build_mtp_layer(src, k, main) for k in range(src.mtp_layers)]


class RankMTPParts(nn.Module):
    """A rank's share of MTP module k around its decoder layer: the embedding, enorm, hnorm,
    eh_proj and shared_head.norm replicated (eh_proj is small beside an MoE layer, and
    replicating it costs no collective), the head's vocabulary rows as the rank's lm_head.
    `vocab_embedding`: the embedding's rows are the rank's vocabulary rows too (a prefill
    rank's, whose lookup is summed over the group). Given the rank's own embedding and
    lm_head, equal copies are not held twice."""

    def __init__(
        self,
        src: WeightSource,
        k: int,
        parallel: ParallelConfig,
        rank: int,
        main: tuple[nn.Parameter, nn.Parameter] | None = None,
        *,
        vocab_embedding: bool = False,
    ) -> None:
        super().__init__()
        c = src.config
        p = f"model.layers.{mtp_layer_index(c, k)}."
        if not src.has(p + "eh_proj.weight"):
            raise CheckpointError(f"the weight source does not serve MTP module {k}")
        embed, head = (p + name if src.has(p + name) else main for name, main in SHARED_WITH_MAIN)
        vocab = parallel.vocab_rows(rank, c.vocab_size)
        embed_weight = src.tensor(embed, vocab) if vocab_embedding else src.tensor(embed)
        head_rows = src.tensor(head, vocab)
        self.embed = nn.Embedding.from_pretrained(embed_weight, freeze=False)
        self.lm_head = nn.Parameter(head_rows)
        if main is not None:
            if torch.equal(main[0].detach(), embed_weight.to(main[0].device)):
                self.embed.weight = main[0]
            if torch.equal(main[1].detach(), head_rows.to(main[1].device)):
                self.lm_head = main[1]
        self.enorm = rank_norm(src, p + "enorm.weight", c.rms_norm_eps)
        self.hnorm = rank_norm(src, p + "hnorm.weight", c.rms_norm_eps)
        with torch.device("meta"):
            self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        place_linear(self, "eh_proj", src.linear(p + "eh_proj.weight"))
        self.norm = rank_norm(src, p + "shared_head.norm.weight", c.rms_norm_eps)
        share_workspace(self)

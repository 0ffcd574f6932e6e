"""A DSA layer's indexer read from a weight source, whole: every decode rank and every prefill
rank holds its own copy (the indexer is small beside the layer, and replicating it keeps each
rank's selection a function of what the rank already has)."""

from __future__ import annotations

import torch

from common.loading.model_builder import fill_module
from common.loading.weights import WeightSource
from common.model.indexer import Indexer


def load_indexer(src: WeightSource, layer: int) -> Indexer | None:
    """Layer `layer`'s indexer (`model.layers.{layer}.self_attn.indexer.*`), or None where the
    layer runs none (a dense model, a shared DSA layer)."""
    c = src.config
    if c.dsa is None or not c.dsa.is_full(layer):
        return None
    with torch.device("meta"):
        indexer = Indexer(c)
    fill_module(indexer, src, f"model.layers.{layer}.self_attn.indexer.")
    return indexer

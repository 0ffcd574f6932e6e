"""DsaConfig: the DeepSeek Sparse Attention part of an MLA architecture (DeepSeek-V3.2, GLM-5).

Every attention layer of a DSA model is MLA whose queries attend only over the `index_topk`
cached tokens its lightning indexer scores highest (common/model/indexer.py). A "full" layer
runs its own indexer and keeps an indexer key per token; a "shared" layer (GLM's
`indexer_types`) has neither and reuses the selection of the full layer before it. An MTP
layer (index >= num_hidden_layers) is full: the public V3.2 and GLM-5 weight maps hold an
indexer in it (`model.layers.61.self_attn.indexer.*`, `model.layers.78.self_attn.indexer.*`).

The index-key pool numbers only the full layers: `key_layer` maps a cache layer to its row
of that pool. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FULL = "full"
SHARED = "shared"


class DsaConfigError(ValueError):
    """The DSA part of a config cannot be served as given."""


@dataclass(frozen=True)
class DsaConfig:
    index_topk: int  # tokens each query attends over (at most)
    index_n_heads: int  # H_I
    index_head_dim: int  # d_I (its first d_r dims are rotated)
    rope_interleave: bool  # the indexer's RoPE layout (V3.2: halves, GLM-5: interleaved)
    layer_types: tuple[str, ...]  # FULL / SHARED per main layer

    def __post_init__(self) -> None:
        if self.index_topk < 1 or self.index_n_heads < 1 or self.index_head_dim < 1:
            raise DsaConfigError("index_topk, index_n_heads and index_head_dim must be positive")
        if any(t not in (FULL, SHARED) for t in self.layer_types):
            raise DsaConfigError(f"indexer_types must be {FULL!r} or {SHARED!r} per layer")
        if self.layer_types and self.layer_types[0] != FULL:
            # A shared layer reuses the selection of a full layer before it.
            raise DsaConfigError("the first layer's indexer must be 'full'")

    def is_full(self, layer: int) -> bool:
        """Whether cache layer `layer` runs its own indexer (MTP layers do)."""
        return layer >= len(self.layer_types) or self.layer_types[layer] == FULL

    def key_layers(self, num_layers: int) -> int:
        """How many of the first `num_layers` cache layers keep indexer keys."""
        return sum(self.is_full(n) for n in range(num_layers))

    def key_layer(self, layer: int) -> int:
        """The index-key pool's row of full cache layer `layer`."""
        if not self.is_full(layer):
            raise ValueError(f"layer {layer} shares its selection: it keeps no indexer keys")
        return self.key_layers(layer)


def indexer_types(raw: Mapping[str, Any], num_layers: int) -> list[str]:
    """GLM's per-layer indexer types exactly as HF's GlmMoeDsaConfig derives them: the
    config's `indexer_types`, else `index_topk_pattern` ("F" / "S" per layer, or a list),
    else full where max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0."""
    types = raw.get("indexer_types")
    if types is not None:
        return list(types)
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            letters = {"F": FULL, "S": SHARED}
            if any(c not in letters for c in pattern):
                raise DsaConfigError(f"index_topk_pattern {pattern!r} is not made of F and S")
            return [letters[c] for c in pattern]
        return list(pattern)
    freq = max(raw.get("index_topk_freq", 1), 1)
    offset = raw.get("index_skip_topk_offset", 2)
    return [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(num_layers)]


def dsa_from_raw(raw: Mapping[str, Any], num_layers: int) -> DsaConfig | None:
    """The DSA config of a normalized config dict (a DSA family's `normalize` sets
    `indexer_types`), or None for a dense MLA model."""
    types = raw.get("indexer_types")
    if types is None:
        return None
    if len(types) != num_layers:
        raise DsaConfigError(f"indexer_types has {len(types)} entries for {num_layers} layers")
    return DsaConfig(
        index_topk=int(raw["index_topk"]),
        index_n_heads=int(raw["index_n_heads"]),
        index_head_dim=int(raw["index_head_dim"]),
        rope_interleave=bool(raw["indexer_rope_interleave"]),
        layer_types=tuple(types),
    )

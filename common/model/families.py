"""The MLA model families this engine serves: one registry from a checkpoint's `model_type` to
what that family switches on, so a new family is a table entry plus its differences.

A family's `normalize` turns its HF `config.json` into the DeepSeek-V3 key set that
`ModelConfig.from_hf_dict` reads (legacy keys renamed, a multimodal wrapper's `text_config`
lifted out, defaults that differ from V3's filled in); what the family does differently in the
math is a feature of `ModelConfig` that the family's `normalize` sets, never a check of the
family's name in the model code. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.model.dsa_config import FULL, DsaConfigError, indexer_types

RawConfig = dict[str, Any]


class UnknownFamily(ValueError):
    """A `model_type` no family here serves."""


def _deepseek_v2(raw: RawConfig) -> RawConfig:
    # V2 checkpoints route greedily over softmax scores unless they say otherwise.
    return {"topk_method": "greedy", "scoring_func": "softmax", **_present(raw)}


def _deepseek_v3(raw: RawConfig) -> RawConfig:
    return {"topk_method": "noaux_tc", "scoring_func": "sigmoid", **_present(raw)}


def _deepseek_v32(raw: RawConfig) -> RawConfig:
    """V3 plus an indexer in every layer, its RoPE in halves (HF's DeepseekV32Indexer)."""
    present = _present(raw)
    layers = present["num_hidden_layers"]
    return {
        **_dsa_defaults(index_n_heads=64),
        **present,
        **_dsa_fixed(present, [FULL] * layers, indexer_rope_interleave=False),
    }


def _glm_moe_dsa(raw: RawConfig) -> RawConfig:
    """V3.2's architecture with GLM's dims, interleaved indexer RoPE and per-layer indexer
    types (a "shared" layer reuses the full layer's selection before it)."""
    present = _present(raw)
    layers = present["num_hidden_layers"]
    return {
        **_dsa_defaults(index_n_heads=32),
        "rms_norm_eps": 1e-5,
        **present,
        **_dsa_fixed(present, indexer_types(present, layers), indexer_rope_interleave=True),
    }


def _dsa_defaults(index_n_heads: int) -> RawConfig:
    """HF's defaults for what a DSA config may leave out."""
    return {
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": index_n_heads,
    }


def _dsa_fixed(raw: RawConfig, types: list[str], indexer_rope_interleave: bool) -> RawConfig:
    """What HF's DSA models fix whatever the config says: MLA's RoPE interleaved, the
    indexer's as the family lays it out, the q-LoRA and latent norms at eps 1e-6, V3's
    router (sigmoid scores, the correction bias, group-limited top-k), the MoE layers by
    `first_k_dense_replace` alone (HF reads `mlp_layer_types`, derived from it; a config
    whose `mlp_layer_types` says otherwise is refused)."""
    layers = raw["num_hidden_layers"]
    dense = min(raw.get("first_k_dense_replace", 3), layers)
    derived = ["dense"] * dense + ["sparse"] * (layers - dense)
    if raw.get("mlp_layer_types", derived) != derived:
        raise DsaConfigError("mlp_layer_types other than first_k_dense_replace's are not served")
    return {
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "indexer_types": types,
        "indexer_rope_interleave": indexer_rope_interleave,
        "rope_interleave": True,
        "latent_norm_eps": 1e-6,
        "first_k_dense_replace": dense,
        "moe_layer_freq": 1,
    }


def _present(raw: RawConfig) -> RawConfig:
    """`raw` without its null values (a null means "the family's default")."""
    return {k: v for k, v in raw.items() if v is not None}


@dataclass(frozen=True)
class Family:
    """One family of MLA checkpoints."""

    name: str
    model_types: tuple[str, ...]
    # The HF transformers model the family is held exact against (tests), as a module path.
    reference: str
    # The family's config.json -> the V3 key set ModelConfig reads.
    normalize: Callable[[RawConfig], RawConfig] = field(default=_present)


FAMILIES: tuple[Family, ...] = (
    Family("DeepSeek-V2", ("deepseek_v2",), "transformers.models.deepseek_v2", _deepseek_v2),
    Family("DeepSeek-V3", ("deepseek_v3",), "transformers.models.deepseek_v3", _deepseek_v3),
    Family("DeepSeek-V3.2", ("deepseek_v32",), "transformers.models.deepseek_v32", _deepseek_v32),
    Family("GLM-5", ("glm_moe_dsa",), "transformers.models.glm_moe_dsa", _glm_moe_dsa),
)


def model_types() -> tuple[str, ...]:
    """Every `model_type` served, in the registry's order."""
    return tuple(t for f in FAMILIES for t in f.model_types)


def family_of(model_type: str | None) -> Family:
    """The family serving `model_type`; UnknownFamily naming the ones served."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise UnknownFamily(f"model_type {model_type!r} is not one of {model_types()}")

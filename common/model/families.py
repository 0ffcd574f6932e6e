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


def _text_model(raw: RawConfig) -> RawConfig:
    """A multimodal wrapper's text model: its `text_config` (with the wrapper's
    quantization_config, which covers the whole checkpoint), or `raw` itself. The wrapper's
    own `model_type` stays the config's (ModelConfig reads it before normalizing)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    quant = (
        {"quantization_config": raw["quantization_config"]} if "quantization_config" in raw else {}
    )
    return {**quant, **text}


# HF DeepseekV3Config's defaults where they differ from ModelConfig's: the families built on
# it take them for keys their config.json leaves out, as transformers does.
_V3_DEFAULTS: RawConfig = {"norm_topk_prob": True, "routed_scaling_factor": 2.5}


def _kimi(raw: RawConfig) -> RawConfig:
    # K2 / K2-Thinking are DeepSeek-V3 (`kimi_k2`, remote code); K2.5 / K2.6 wrap the same
    # text model with a vision tower (`kimi_k25`: text_config, weights under language_model.).
    return _deepseek_v3({**_V3_DEFAULTS, **_present(_text_model(raw))})


def _glm4_moe_lite(raw: RawConfig) -> RawConfig:
    out = _deepseek_v3({**_V3_DEFAULTS, "routed_scaling_factor": 1.8, **_present(raw)})
    # transformers' default: the first layer dense, MoE from the second on.
    out.setdefault("mlp_layer_types", ["dense"] + ["sparse"] * (out["num_hidden_layers"] - 1))
    return out


# Mistral 4's rope when its config gives none (HF Mistral4Config's default).
_MISTRAL4_ROPE: RawConfig = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 128.0,
    "original_max_position_embeddings": 8192,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def _mistral4(raw: RawConfig) -> RawConfig:
    text = _present(_text_model(raw))
    if text.get("model_type") != "mistral4":
        raise UnknownFamily(
            f"model_type {raw.get('model_type')!r} wraps {text.get('model_type')!r}, not mistral4"
        )
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or _MISTRAL4_ROPE)
    rope.setdefault("rope_type", rope.get("type", "yarn"))
    return {
        # Softmax scores in the model dtype, groups ranked by their top two, the kept weights
        # normalized and then scaled.
        "topk_method": "group_limited_greedy",
        "scoring_func": "softmax",
        "router_in_model_dtype": True,
        "group_top2": True,
        "norm_then_scale": True,
        "norm_topk_prob": True,
        "n_shared_experts": 1,
        "max_position_embeddings": 1048576,
        **text,
        "rope_parameters": rope,
        # The query scaling is applied at every position (beta 0 is none).
        "query_scale_beta": float(rope.get("llama_4_scaling_beta") or 0.0),
        "query_scale_period": int(rope.get("original_max_position_embeddings") or 1),
    }


def _sarvam_mla(raw: RawConfig) -> RawConfig:
    # The released config is written for its remote code; translated as HF's SarvamMLAConfig
    # does: num_experts / num_shared_experts renamed, head_dim and q_head_dim derived, rope type
    # deepseek_yarn is YaRN.
    out = {"first_k_dense_replace": 1, **_V3_DEFAULTS, **_present(raw)}
    for legacy, key in (
        ("num_experts", "n_routed_experts"),
        ("num_shared_experts", "n_shared_experts"),
    ):
        if legacy in out:
            out.setdefault(key, out.pop(legacy))
    out.pop("head_dim", None)
    out.pop("q_head_dim", None)
    rope = out.get("rope_scaling") or {}
    if "deepseek_yarn" in (rope.get("type"), rope.get("rope_type")):
        out.pop("rope_scaling")
        yarn = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "yarn"}
        out["rope_parameters"] = {**(out.get("rope_parameters") or {}), **yarn}
    return _deepseek_v3(out)


def _axk1(raw: RawConfig) -> RawConfig:
    out = _deepseek_v3({**_V3_DEFAULTS, "n_group": 8, "topk_group": 4, **_present(raw)})
    # Its router has no score correction bias (a zero one) and an RMSNorm closes each MoE
    # layer; the dense layers come from the legacy keys when mlp_layer_types is not given.
    out["router_bias"] = False
    out["moe_output_norm"] = True
    if "mlp_layer_types" not in out:
        first, freq = out.get("first_k_dense_replace", 1), out.get("moe_layer_freq", 1)
        out["mlp_layer_types"] = [
            "sparse" if i >= first and i % freq == 0 else "dense"
            for i in range(out["num_hidden_layers"])
        ]
    return out


def _youtu(raw: RawConfig) -> RawConfig:
    # Dense (its config keeps none of V3's MoE keys) with the LM head tied to the embedding.
    out = {"tie_word_embeddings": True, **_present(raw), "n_routed_experts": 0}
    return _deepseek_v3(out)


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
    Family("Kimi K2", ("kimi_k2", "kimi_k25"), "transformers.models.deepseek_v3", _kimi),
    Family(
        "GLM-4.7-Flash", ("glm4_moe_lite",), "transformers.models.glm4_moe_lite", _glm4_moe_lite
    ),
    Family("Mistral Small 4", ("mistral4", "mistral3"), "transformers.models.mistral4", _mistral4),
    Family("Sarvam", ("sarvam_mla",), "transformers.models.sarvam_mla", _sarvam_mla),
    Family("A.X-K1", ("axk1",), "transformers.models.axk1", _axk1),
    Family("Youtu-LLM", ("youtu",), "transformers.models.youtu", _youtu),
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

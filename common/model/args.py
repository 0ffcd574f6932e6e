"""ModelConfig: the architecture of an MLA checkpoint, parsed from HF `config.json` through its
family (common/model/families.py).

Only what the math needs lives here. Both the hub layout (`rope_scaling`) and the
transformers-5 layout (`rope_parameters`) are accepted; anything we cannot run exactly is
rejected with a `ConfigError` rather than silently approximated.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.model.dsa_config import DsaConfig, DsaConfigError, dsa_from_raw
from common.model.families import UnknownFamily, family_of

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


class ConfigError(ValueError):
    """The checkpoint's config describes something this engine cannot run exactly."""


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature m = 0.1 * mscale * ln(factor) + 1 (1 when not stretched)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling parameters, named as in DeepSeek's configs."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ConfigError(
                "yarn rope scaling needs factor > 0 and original_max_position_embeddings > 0"
            )

    @property
    def rope_attention_factor(self) -> float:
        """Multiplier on cos/sin; DeepSeek sets mscale == mscale_all_dim so this is usually 1."""
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one MLA model of a served family (names follow DESIGN §1 and the HF
    config)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int  # d_c
    qk_nope_head_dim: int  # d_n
    qk_rope_head_dim: int  # d_r
    v_head_dim: int  # d_v
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True
    # MoE; n_routed_experts == 0 means every layer is a dense MLP.
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    # DeepSeek-V3's multi-token-prediction modules, stored as layers num_hidden_layers + k.
    num_nextn_predict_layers: int = 0
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # What a family does differently (common/model/families.py sets these from its config):
    # "dense" / "sparse" per layer where the family lists them (GLM-4.7-Flash, A.X-K1); else
    # the first_k_dense_replace / moe_layer_freq rule.
    mlp_layer_types: tuple[str, ...] = ()
    # noaux_tc steers by a score correction bias the checkpoint stores; A.X-K1 has none.
    router_bias: bool = True
    # The router's logits and scores in the model dtype instead of float32 (Mistral 4).
    router_in_model_dtype: bool = False
    # Groups ranked by the sum of their two best experts, else by the best (noaux_tc always
    # ranks by two: `ranks_groups_by_top2`); Mistral 4's softmax router does too.
    group_top2: bool = False
    # The kept weights normalized (norm_topk_prob) and then scaled, not normalized or scaled
    # (DeepSeek-V2); noaux_tc always does both (`norm_and_scale`), and so does Mistral 4.
    norm_then_scale: bool = False
    # An RMSNorm over each MoE layer's whole output (A.X-K1's post_mlp_layernorm).
    moe_output_norm: bool = False
    # Queries at position p times 1 + beta ln(1 + floor(p / period)) (Mistral 4); 0: none.
    query_scale_beta: float = 0.0
    query_scale_period: int = 1
    # DeepSeek Sparse Attention (V3.2, GLM-5): each layer's lightning indexer; None: dense MLA.
    dsa: DsaConfig | None = None
    # The q-LoRA and latent RMSNorms' epsilon where a family fixes it apart from rms_norm_eps
    # (HF builds them with 1e-6 whatever the config says); None: rms_norm_eps.
    latent_norm_eps: float | None = None

    def __post_init__(self) -> None:
        try:
            family_of(self.model_type)
        except UnknownFamily as exc:
            raise ConfigError(str(exc)) from None
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_nextn_predict_layers < 0:
            raise ConfigError("num_nextn_predict_layers cannot be negative")
        if self.mlp_layer_types and (
            len(self.mlp_layer_types) != self.num_hidden_layers
            or set(self.mlp_layer_types) - {"dense", "sparse"}
        ):
            raise ConfigError(
                f"mlp_layer_types must name 'dense' or 'sparse' for each of the "
                f"{self.num_hidden_layers} layers"
            )
        if "sparse" in self.mlp_layer_types and not self.n_routed_experts:
            raise ConfigError("mlp_layer_types names a sparse layer but the model has no experts")
        if self.query_scale_period <= 0:
            raise ConfigError("the query scaling's original_max_position_embeddings must be > 0")
        if self.qk_rope_head_dim % 2:
            raise ConfigError("qk_rope_head_dim must be even (RoPE rotates pairs)")
        if self.dsa is not None:
            if self.q_lora_rank is None:
                raise ConfigError("sparse attention's indexer reads the q-LoRA: q_lora_rank")
            if self.dsa.index_head_dim < self.qk_rope_head_dim:
                raise ConfigError("index_head_dim must hold the qk_rope_head_dim rotated dims")
        if self.n_routed_experts:
            if self.topk_method not in TOPK_METHODS:
                raise ConfigError(f"topk_method {self.topk_method!r} is not one of {TOPK_METHODS}")
            if self.scoring_func not in SCORING_FUNCS:
                raise ConfigError(
                    f"scoring_func {self.scoring_func!r} is not one of {SCORING_FUNCS}"
                )
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ConfigError("num_experts_per_tok must be in [1, n_routed_experts]")
            if self.n_routed_experts % self.n_group:
                raise ConfigError("n_routed_experts must be divisible by n_group")
            if not 0 < self.topk_group <= self.n_group:
                raise ConfigError("topk_group must be in [1, n_group]")
            if self.moe_intermediate_size <= 0:
                raise ConfigError("moe_intermediate_size must be positive for a MoE model")
            if self.moe_layer_freq <= 0:
                raise ConfigError("moe_layer_freq must be positive")

    @property
    def attention_norm_eps(self) -> float:
        """The epsilon of the q-LoRA and latent RMSNorms."""
        return self.rms_norm_eps if self.latent_norm_eps is None else self.latent_norm_eps

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """(d_n + d_r)^-1/2, times m^2 under YaRN (official DeepSeek behaviour)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def ranks_groups_by_top2(self) -> bool:
        return self.group_top2 or self.topk_method == "noaux_tc"

    @property
    def norm_and_scale(self) -> bool:
        return self.norm_then_scale or self.topk_method == "noaux_tc"

    def is_moe_layer(self, layer: int) -> bool:
        if layer < len(self.mlp_layer_types):
            return self.mlp_layer_types[layer] == "sparse"
        # Official DeepSeek rule (an MTP layer's too, past the listed ones). HF-native
        # DeepseekV2 ignores moe_layer_freq; all released checkpoints use moe_layer_freq == 1,
        # where the two agree.
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse an HF `config.json` dict (hub or transformers-5 layout) of any family
        (common/model/families.py), through its family's `normalize`."""
        model_type = raw.get("model_type")
        try:
            raw = family_of(model_type).normalize(raw)
        except (UnknownFamily, DsaConfigError) as exc:
            raise ConfigError(str(exc)) from None
        # quantization_config says how the weights are stored, not what the model is: the
        # loader reads it (`common.loading.checkpoint.Quantization`).
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ConfigError("attention_bias / mlp_bias are not used by DeepSeek checkpoints")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (DeepSeek uses silu)")
        rope_theta, scaling = _parse_rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        n_routed = raw.get("n_routed_experts") or 0
        try:
            dsa = dsa_from_raw(raw, raw["num_hidden_layers"])
        except DsaConfigError as exc:
            raise ConfigError(str(exc)) from None
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            q_lora_rank=raw.get("q_lora_rank"),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            # DeepSeek-V2 checkpoints always store q_pe/k_pe in interleaved pairs; V3 says so.
            rope_interleave=bool(raw.get("rope_interleave", True)),
            n_routed_experts=n_routed,
            n_shared_experts=raw.get("n_shared_experts") or 0,
            moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
            topk_method=raw["topk_method"],
            scoring_func=raw["scoring_func"],
            n_group=raw.get("n_group") or 1,
            topk_group=raw.get("topk_group") or 1,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
            moe_layer_freq=raw.get("moe_layer_freq") or 1,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            eos_token_ids=eos_ids,
            mlp_layer_types=tuple(raw.get("mlp_layer_types") or ()),
            router_bias=bool(raw.get("router_bias", True)),
            router_in_model_dtype=bool(raw.get("router_in_model_dtype", False)),
            group_top2=bool(raw.get("group_top2", False)),
            norm_then_scale=bool(raw.get("norm_then_scale", False)),
            moe_output_norm=bool(raw.get("moe_output_norm", False)),
            query_scale_beta=float(raw.get("query_scale_beta", 0.0)),
            query_scale_period=int(raw.get("query_scale_period", 1)),
            dsa=dsa,
            latent_norm_eps=raw.get("latent_norm_eps"),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_hf_dict(raw)


def _parse_rope(raw: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "yarn":
        raise ConfigError(f"rope type {rope_type!r} is not supported (default or yarn)")
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if original is None:
        raise ConfigError("yarn rope scaling needs original_max_position_embeddings")
    if factor is None:
        factor = raw["max_position_embeddings"] / original
    return theta, YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale", 1.0)),
        mscale_all_dim=float(params.get("mscale_all_dim", 0.0)),
    )

"""Tiny random checkpoints of every MLA family beside DeepSeek's own (common/model/families.py),
each built with its HF transformers 5 class and written as the family's released checkpoints
are laid out: Kimi K2 as `kimi_k2`, K2.5 / K2.6 and Mistral Small 4 inside their multimodal
wrappers (with a vision tensor the engine skips), Sarvam with its legacy config keys, A.X-K1
with its MoE output norm at the layer level (its dense layers' too) and no router bias."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.tiny import BASE, YARN

RawConfig = dict[str, Any]
_MOE_KEYS = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size")
_V3 = dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, rope_parameters=YARN)


def _kimi_k2(raw: RawConfig, weights: dict[str, torch.Tensor]) -> RawConfig:
    return {**raw, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}


def _wrapped(wrapper: str, text_type: str, prefix: str) -> Callable[..., RawConfig]:
    """A vision wrapper's layout: the text model's weights under `prefix` (its lm_head too,
    or at the top for transformers 5's `model.language_model.`), a vision tensor beside."""

    def wrap(raw: RawConfig, weights: dict[str, torch.Tensor]) -> RawConfig:
        for name in list(weights):
            if prefix == "model.language_model." and name.startswith("lm_head."):
                continue
            ours = name.removeprefix("model.") if prefix.startswith("model.") else name
            weights[prefix + ours] = weights.pop(name)
        weights["vision_tower.patch_embed.proj.weight"] = torch.ones(4, 3)
        weights[
            "multi_modal_projector.linear_1.weight"
            if wrapper == "mistral3"
            else "mm_projector.proj.0.weight"
        ] = torch.ones(2, 2)
        text = {**raw, "model_type": text_type}
        # The wrapper's own tie flag (HF Kimi_K25Config's default) is not the text model's.
        return {
            "model_type": wrapper,
            "text_config": text,
            "vision_config": {"hidden_size": 4},
            "tie_word_embeddings": True,
        }

    return wrap


def _sarvam_legacy(raw: RawConfig, weights: dict[str, torch.Tensor]) -> RawConfig:
    out = {
        k: v
        for k, v in raw.items()
        if k not in ("n_routed_experts", "n_shared_experts", "rope_parameters")
    }
    rope = {k: v for k, v in raw["rope_parameters"].items() if k != "rope_type"}
    return {
        **out,
        "num_experts": raw["n_routed_experts"],
        "num_shared_experts": raw["n_shared_experts"],
        "head_dim": raw["kv_lora_rank"] + raw["qk_rope_head_dim"],
        "q_head_dim": raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"],
        "rope_scaling": {**rope, "type": "deepseek_yarn"},
    }


def _axk1_released(raw: RawConfig, weights: dict[str, torch.Tensor]) -> RawConfig:
    for name in list(weights):
        if name.endswith("e_score_correction_bias"):
            del weights[name]
        elif ".mlp.post_mlp_layernorm." in name:
            weights[name.replace(".mlp.post_mlp_layernorm.", ".post_mlp_layernorm.")] = weights.pop(
                name
            )
    for layer, kind in enumerate(raw["mlp_layer_types"]):
        if kind == "dense":  # stored, unused
            weights[f"model.layers.{layer}.post_mlp_layernorm.weight"] = torch.full(
                (raw["hidden_size"],), 3.0
            )
    out = {k: v for k, v in raw.items() if k != "mlp_layer_types"}
    return {**out, "first_k_dense_replace": 1}


# name -> (HF config class, HF model class, config overrides, checkpoint layout or None)
FAMILY_VARIANTS: dict[str, tuple[str, str, dict[str, Any], Callable[..., RawConfig] | None]] = {
    "kimi-k2": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _V3, _kimi_k2),
    "kimi-k25": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        _V3,
        _wrapped("kimi_k25", "kimi_k2", "language_model."),
    ),
    "glm4-moe-lite": (
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        dict(
            q_lora_rank=24,
            num_attention_heads=10,
            qk_nope_head_dim=12,
            v_head_dim=16,
            mlp_layer_types=["sparse", "dense", "sparse"],
            routed_scaling_factor=1.8,
        ),
        None,
    ),
    "mistral4": (
        "Mistral4Config",
        "Mistral4ForCausalLM",
        dict(
            q_lora_rank=24,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            rope_parameters={
                **YARN,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5,
                "original_max_position_embeddings": 8,
            },
        ),
        _wrapped("mistral3", "mistral4", "model.language_model."),
    ),
    "sarvam-mla": (
        "SarvamMLAConfig",
        "DeepseekV3ForCausalLM",
        dict(q_lora_rank=None, rope_parameters=YARN, rope_interleave=False),
        _sarvam_legacy,
    ),
    "axk1": (
        "AXK1Config",
        "AXK1ForCausalLM",
        dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True),
        _axk1_released,
    ),
    "youtu": (
        "YoutuConfig",
        "YoutuForCausalLM",
        dict(q_lora_rank=24, tie_word_embeddings=True),
        None,
    ),
}


def build_family(variant: str, seed: int = 0, std: float = 0.15, **config: Any) -> torch.nn.Module:
    import transformers

    cfg_name, model_name, overrides, _ = FAMILY_VARIANTS[variant]
    base = {k: v for k, v in BASE.items() if k != "first_k_dense_replace"}
    if variant == "youtu":
        base = {k: v for k, v in base.items() if k not in _MOE_KEYS}
    elif "mlp_layer_types" not in overrides:
        base["first_k_dense_replace"] = BASE["first_k_dense_replace"]
    cfg = getattr(transformers, cfg_name)(**{**base, **overrides, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, std)
        for name, b in model.named_buffers():
            # A.X-K1 routes without a bias: its stays zero.
            if "e_score_correction_bias" in name and variant != "axk1":
                b.normal_(0.0, 0.3)
    return model


def save_family(variant: str, out: Path, **kwargs: Any) -> torch.nn.Module:
    """The HF model, saved at `out` in its family's released layout."""
    model = build_family(variant, **kwargs)
    model.save_pretrained(out)
    layout = FAMILY_VARIANTS[variant][3]
    if layout is not None:
        path = out / "model.safetensors"
        weights = load_file(str(path))
        raw = layout(json.loads((out / "config.json").read_text()), weights)
        save_file(weights, str(path), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(raw, indent=1))
    return model


def pack_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' symmetric pack-quantized INT4 of w [R, C]: the words [R, C / 8]
    (value + 8, value j of a word in bits 4j..4j+3), the bf16 group scales [R, C / group] and
    the dequantized weight in float32 (what the checkpoint means)."""
    rows, cols = w.shape
    g = w.float().view(rows, cols // group, group)
    scale = (g.abs().amax(-1, keepdim=True) / 7).clamp(min=1e-8).to(torch.bfloat16)
    q = (g / scale.float()).round().clamp(-8, 7).to(torch.int32)
    codes = (q.view(rows, cols) + 8).view(rows, cols // 8, 8)
    words = (codes << torch.arange(0, 32, 4, dtype=torch.int32)).sum(-1, dtype=torch.int32)
    return words, scale[..., 0], (q.float() * scale.float()).view(rows, cols)


INT4_GROUP = 16  # Kimi's is 32; 16 lets the tiny experts' columns split over tp = 2


def save_kimi_int4(out: Path, **kwargs: Any) -> torch.nn.Module:
    """A tiny Kimi-K2.6-shaped checkpoint: `kimi_k25`'s wrapper, the routed experts stored
    one by one as pack-quantized INT4 with bf16 group scales (compressed-tensors), the rest
    in float32. The HF model returned holds the dequantized experts: the exact reference."""
    model = save_family("kimi-k25", out, **kwargs)
    path = out / "model.safetensors"
    weights = load_file(str(path))
    expert = re.compile(
        r"^language_model\.(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
    )
    for name in list(weights):
        if not (m := expert.match(name)):
            continue
        words, scale, dq = pack_int4(weights.pop(name), INT4_GROUP)
        base = name.removesuffix("weight")
        weights[base + "weight_packed"], weights[base + "weight_scale"] = words, scale
        weights[base + "weight_shape"] = torch.tensor(dq.shape, dtype=torch.int32)
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        with torch.no_grad():  # the HF model's fused experts take the dequantized values
            if proj == "down_proj":
                model.get_parameter(prefix + ".down_proj")[e] = dq
            else:
                fused = model.get_parameter(prefix + ".gate_up_proj")[e]
                half = fused.shape[0] // 2
                (fused[:half] if proj == "gate_proj" else fused[half:]).copy_(dq)
    save_file(weights, str(path), metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": INT4_GROUP,
                },
                "input_activations": None,
            }
        },
        "ignore": [
            "lm_head",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|down)_proj.*",
        ],
    }
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    return model

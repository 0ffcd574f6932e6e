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


# --- the families' tokenizers: their special tokens and chat templates' shapes ------------------

KIMI_MERGES = [b"he", b"ll", b"hell", b"hello", b"12", b"123", b"1234", b"it", b"'s", b"it's"]
KIMI_BASE = 256 + len(KIMI_MERGES)
# Kimi's names for its first special ids (its tokenizer_config.json's added_tokens_decoder).
KIMI_SPECIALS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
KIMI_ADDED = {KIMI_BASE + k: token for k, token in enumerate(KIMI_SPECIALS)}
# Kimi K2's template's shape (the tests' own): role markers, the role's name, <|im_middle|>,
# the text, <|im_end|>; tools declared in a system turn; earlier calls in Kimi's section.
KIMI_TEMPLATE = (
    "{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}<|im_user|>user"
    "{% elif m['role'] == 'assistant' %}<|im_assistant|>assistant{% else %}<|im_system|>"
    "{{ m['role'] }}{% endif %}<|im_middle|>{{ m['content'] }}"
    "{% if m.get('tool_calls') %}<|tool_calls_section_begin|>{% for c in m['tool_calls'] %}"
    "<|tool_call_begin|>{{ c['id'] }}<|tool_call_argument_begin|>"
    "{{ c['function']['arguments'] }}<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>"
    "{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def save_kimi_tokenizer(out: Path, model_type: str | None = None) -> Path:
    """Kimi K2's tokenizer files over a tiny tiktoken BPE (the 256 bytes and KIMI_MERGES):
    tiktoken.model, a tokenizer_config.json naming tokenization_kimi.py with the added tokens
    and the template, and that .py file, which must never run."""
    import base64

    ranks = [bytes([b]) for b in range(256)] + KIMI_MERGES
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(ranks)]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    config = {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]",
        "eos_token": "<|im_end|>",
        "added_tokens_decoder": {
            str(i): {"content": c, "special": True} for i, c in KIMI_ADDED.items()
        },
        "chat_template": KIMI_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "tokenization_kimi.py").write_text("raise SystemExit('checkpoint code ran')\n")
    if model_type is not None:
        _set_model_type(out, model_type)
    return out


GLM_SPECIALS = [
    "[gMASK]",
    "<sop>",
    "<|endoftext|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
]
# GLM-4.7's template's shape: earlier calls as <tool_call>NAME<arg_key>..., each value a
# string as itself, JSON otherwise (it iterates the arguments' items).
GLM_TEMPLATE = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}<|observation|>"
    "<tool_response>{{ m['content'] }}</tool_response>{% else %}<|{{ m['role'] }}|>"
    "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}{% set f = c['function'] %}"
    "<tool_call>{{ f['name'] }}{% for k, v in f['arguments'].items() %}<arg_key>{{ k }}"
    "</arg_key><arg_value>{{ v | tojson if v is not string else v }}</arg_value>{% endfor %}"
    "</tool_call>{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% endif %}"
)
MISTRAL_SPECIALS = [
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
]
# Mistral's v11 template's shape: tools before the last user turn, calls as
# [TOOL_CALLS]NAME[ARGS]JSON.
MISTRAL_TEMPLATE = (
    "<s>{% for m in messages %}{% if m['role'] == 'user' %}{% if tools and loop.last %}"
    "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m['content'] }}"
    "[/INST]{% elif m['role'] == 'assistant' %}{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}[TOOL_CALLS]{{ c['function']['name'] }}[ARGS]"
    "{{ c['function']['arguments'] }}{% endfor %}</s>{% elif m['role'] == 'tool' %}"
    "[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}"
)
# config.json model_type -> (special tokens, template, bos, eos)
FAMILY_TOKENIZERS = {
    "glm4_moe_lite": (GLM_SPECIALS, GLM_TEMPLATE, None, "<|endoftext|>"),
    "mistral3": (MISTRAL_SPECIALS, MISTRAL_TEMPLATE, "<s>", "</s>"),
}


def save_family_tokenizer(out: Path, model_type: str, vocab_size: int = 400) -> Path:
    """A byte-level BPE trained here with the family's special tokens and its template's
    shape, and config.json's model_type (the checkpoint's config kept if there is one)."""
    from tests.tiny import CORPUS, train_tokenizer

    specials, template, bos, eos = FAMILY_TOKENIZERS[model_type]
    backend = train_tokenizer(vocab_size, CORPUS)
    backend.add_special_tokens(specials)
    backend.save(str(out / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": eos, "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    _set_model_type(out, model_type)
    return out


def _set_model_type(out: Path, model_type: str) -> None:
    model = {"max_position_embeddings": 4096}
    if (out / "config.json").is_file():  # a checkpoint's: its own context and model_type
        model = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({"model_type": model_type, **model}))

"""Tiny models for the tests: random DeepSeek-V2/V3 checkpoints built with HF transformers, a
byte-level BPE tokenizer trained in-process with a chat template, and the random windows the
TPLA tests calibrate on. Every test folder builds its models here."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from common.model.causal_lm import DeepseekForCausalLM
    from common.tpla.calibration import LatentStatistics

BASE: dict[str, Any] = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "rope_theta": 10000.0,
}

# name -> (model class name, config overrides). Together they cover q_lora_rank null/set, the
# three gating methods (noaux_tc with a non-zero correction bias), YaRN, dense-then-MoE layers
# and both rope layouts.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "v2-greedy": ("v2", dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0)),
    "v2-group-yarn": (
        "v2",
        dict(
            q_lora_rank=24,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            rope_parameters=YARN,
        ),
    ),
    "v3-noaux-yarn": (
        "v3",
        dict(
            q_lora_rank=24,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=YARN,
        ),
    ),
    "v3-qnull-halfrope": (
        "v3",
        dict(
            q_lora_rank=None,
            n_group=2,
            topk_group=1,
            rope_interleave=False,
            first_k_dense_replace=2,
        ),
    ),
}


# DeepSeek Sparse Attention (V3.2, GLM-5): index_topk far below the tests' prompts, so the
# indexer's selection decides what every query attends over. GLM's 4 layers run F F S F
# (index_topk_freq 2 from layer 2): a shared layer reuses layer 1's selection.
DSA = dict(q_lora_rank=24, index_topk=8, index_n_heads=16, index_head_dim=16)
DSA_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "v32-sparse": (
        "v32",
        dict(
            DSA,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            rope_parameters=YARN,
        ),
    ),
    "glm-shared": (
        "glm",
        dict(
            DSA,
            num_hidden_layers=4,
            qk_nope_head_dim=24,
            v_head_dim=20,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            rms_norm_eps=1e-5,
            index_topk_freq=2,
            index_skip_topk_offset=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
}


SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "héllo wörld 你好 🙂 hello world",
    "the quick brown fox jumps over the lazy dog",
    "naïve café résumé 東京 世界 你好世界 🙂🙂 🚀 emoji 🎉",
    "Grüße aus München, ça va? señor piñata",
    "def main():\n    return 42  # ascii code",
] * 20


# A DeepSeek-V3.1-style template (tests' own): `thinking` (or `enable_thinking`) opens <think>
# after the generation prompt, else </think> closes it; an earlier answer's reasoning is not
# shown.
THINKING_TEMPLATE = (
    "{% if thinking is not defined %}{% set thinking = enable_thinking is defined and "
    "enable_thinking %}{% endif %}{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' %}</think>{% endif %}{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% if thinking %}<think>{% else %}"
    "</think>{% endif %}{% endif %}"
)
THINK_TOKENS = ("<think>", "</think>")


def train_tokenizer(vocab_size: int, corpus: Sequence[str]) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def build_hf(variant: str, seed: int = 0, std: float = 0.15, **config: Any) -> torch.nn.Module:
    import transformers

    kind, overrides = {**VARIANTS, **DSA_VARIANTS}[variant]
    name = {"v2": "DeepseekV2", "v3": "DeepseekV3", "v32": "DeepseekV32", "glm": "GlmMoeDsa"}[kind]
    cfg_cls = getattr(transformers, f"{name}Config")
    model_cls = getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**BASE, **overrides, **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)  # non-trivial gammas, so folding them is tested too
            else:
                p.normal_(0.0, std)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.3)
    return model


def save_hf(variant: str, out: Path, **kwargs: Any) -> torch.nn.Module:
    model = build_hf(variant, **kwargs)
    model.save_pretrained(out)
    return model


def add_mtp_layer(out: Path, seed: int = 7) -> Path:
    """A random MTP module appended to a saved tiny checkpoint as layer num_hidden_layers
    (with its own indexer in a DSA model, as V3.2's and GLM-5's hold one), its embedding and
    head the main model's (as V3 stores them)."""
    from safetensors.torch import load_file, save_file

    from common.model.args import ModelConfig
    from common.model.mtp import MTPLayer

    raw = json.loads((out / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_hf_dict(raw)
    index = config.num_hidden_layers
    with torch.device("meta"):
        layer = MTPLayer(config, index)
    tensors = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for name, p in layer.state_dict().items():
        mean, std = (1.0, 0.1) if "norm" in name else (0.0, 0.15)
        value = mean + std * torch.randn(p.shape, generator=gen)
        tensors[f"model.layers.{index}.{name}"] = value.to(p.dtype)
    tensors[f"model.layers.{index}.embed_tokens.weight"] = tensors[
        "model.embed_tokens.weight"
    ].clone()
    tensors[f"model.layers.{index}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(out / "model.safetensors"))
    return out


def hf_greedy(hf: torch.nn.Module, ids: torch.Tensor, steps: int) -> list[int]:
    """`steps` greedy tokens after `ids` by HF's whole forward over the sequence each step."""
    seq = ids.tolist()
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def save_tokenizer(out: Path, vocab_size: int = 320) -> Path:
    """The tokenizer files of a model directory: tokenizer.json and a config with the chat
    template and the bos / eos tokens."""
    train_tokenizer(vocab_size, CORPUS).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": TEMPLATE})
    )
    return out


def save_reasoning_tokenizer(
    out: Path, vocab_size: int = 320, specials: Sequence[str] = (), model_type: str = "deepseek_v3"
) -> Path:
    """A reasoning model's tokenizer files (`vocab_size` ids in all): <think> and </think> as
    added tokens that are not special (as DeepSeek's are), `specials` after them, the
    V3.1-style template, and config.json's `model_type` (a 4096-token context when there is
    no checkpoint). No template with a model_type of "deepseek_v32" (its format is code)."""
    backend = train_tokenizer(vocab_size - len(THINK_TOKENS) - len(specials), CORPUS)
    backend.add_tokens([tokenizers.AddedToken(t, normalized=False) for t in THINK_TOKENS])
    backend.add_special_tokens(list(specials))
    assert backend.get_vocab_size() == vocab_size
    backend.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    if model_type != "deepseek_v32":
        config["chat_template"] = THINKING_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    model = {"max_position_embeddings": 4096}
    if (out / "config.json").is_file():  # a checkpoint's: its own context and model_type
        model = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**model, "model_type": model_type}))
    return out


def save_tiny_chat_model(out: Path, variant: str = "v2-greedy", **kwargs: Any) -> Path:
    """A tiny checkpoint plus a real byte-level BPE tokenizer and chat template (vocab 320)."""
    save_hf(variant, out, vocab_size=320, **kwargs)
    return save_tokenizer(out, 320)


def random_windows(count: int, length: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen) for _ in range(count)]


def calibrate(model: DeepseekForCausalLM, seed: int = 0) -> LatentStatistics:
    """Latent statistics of a tiny model over three random windows of 64 tokens."""
    from common.tpla.calibration import collect_latent_statistics

    windows = random_windows(3, 64, model.config.vocab_size, seed)
    return collect_latent_statistics(model, windows, progress=False)

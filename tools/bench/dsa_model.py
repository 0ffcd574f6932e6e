"""`dsa-v32-bench`: a named tiny model of DeepSeek-V3.2's shape for the decode benchmarks at
long context: V3.2's per-token attention (d_c 512, d_r 64, d_n 128, d_v 128, a q-LoRA, an
indexer of 128-dim keys choosing 2048 tokens) and 163,840 positions (V3.2's YaRN), with few
layers and heads and a small vocabulary and MoE, so a CPU holds 128K-token caches. Random
weights (seeded): step times do not depend on the values. Materialized once per process
into a temporary directory, as a checkpoint the engine loads like any other.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

NAME = "dsa-v32-bench"
CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v32",
    "architectures": ["DeepseekV32ForCausalLM"],
    "vocab_size": 2048,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "index_topk": 2048,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rope_theta": 10000,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def model_dir(name: str) -> str:
    """`name`'s directory: the bench model materialized when `name` is NAME, else `name`
    (a model directory) as it is."""
    return str(_materialized()) if name == NAME else name


@functools.cache
def _materialized() -> Path:
    from common.model.args import ModelConfig
    from common.model.causal_lm import DeepseekForCausalLM

    out = Path(tempfile.mkdtemp(prefix=f"{NAME}-"))
    (out / "config.json").write_text(json.dumps(CONFIG))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = DeepseekForCausalLM(ModelConfig.from_hf_dict(CONFIG))
    state = {}
    for key, value in model.state_dict().items():
        t = torch.empty(value.shape, dtype=value.dtype)
        state[key] = t.normal_(1.0, 0.1) if "norm" in key else t.normal_(0.0, 0.05)
    save_file(state, str(out / "model.safetensors"))
    return out

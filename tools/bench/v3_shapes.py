"""DeepSeek-V3's architecture at sizes a benchmark chooses: q LoRA, decoupled RoPE, noaux_tc
sigmoid routing over expert groups with a shared expert, the first layer dense. The
benchmarks that write random V3-shaped checkpoints give only their sizes."""

from __future__ import annotations

from typing import Any

V3_ARCHITECTURE: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "tie_word_embeddings": False,
}


def v3_shaped(**sizes: Any) -> dict[str, Any]:
    """A config.json dict: V3's architecture with these sizes (vocab_size, hidden_size, ...)."""
    return {**V3_ARCHITECTURE, **sizes}

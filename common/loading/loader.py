"""Load HF-format DeepSeek-V2/V3 safetensors checkpoints into `DeepseekForCausalLM`.

Accepts a single `model.safetensors` or shards listed in `model.safetensors.index.json`,
either expert layout (per-expert hub tensors `mlp.experts.N.gate_proj.weight`, stacked here,
or transformers-5 fused `mlp.experts.gate_up_proj`) and DeepSeek-V3's block FP8 weights
(dequantized while reading, `common.loading.checkpoint`). Every missing, unexpected or
mis-shaped tensor is reported by name in one `CheckpointError`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.loading.checkpoint import CheckpointError, UnsupportedQuantization, checkpoint_files
from common.loading.model_builder import build_model
from common.loading.weights import CheckpointWeights
from common.model.causal_lm import DeepseekForCausalLM

__all__ = [
    "DTYPES",
    "CheckpointError",
    "UnsupportedQuantization",
    "checkpoint_files",
    "load_model",
    "serving_dtype",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def serving_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> DeepseekForCausalLM:
    """Build the model from `model_dir` (config.json + safetensors) on `device`."""
    src = CheckpointWeights(model_dir, serving_dtype(dtype), device)
    return build_model(src).to_device(device)

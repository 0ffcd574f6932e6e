"""Load HF-format DeepSeek-V2/V3 safetensors checkpoints into `DeepseekForCausalLM`.

Accepts a single `model.safetensors` or shards listed in `model.safetensors.index.json`, and
either expert layout: per-expert hub tensors (`mlp.experts.N.gate_proj.weight`, stacked here)
or transformers-5 fused tensors (`mlp.experts.gate_up_proj`). Every missing, unexpected or
mis-shaped tensor is reported by name in one `CheckpointError`.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from common.model.args import ModelConfig
from common.model.model import DeepseekForCausalLM

_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match its config."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        raise CheckpointError(
            f"no model.safetensors or model.safetensors.index.json in {model_dir}"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"checkpoint shards listed in the index are missing: {missing}")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _fuse_experts(
    parts: dict[str, dict[int, dict[str, Tensor]]], config: ModelConfig
) -> dict[str, Tensor]:
    fused: dict[str, Tensor] = {}
    for prefix, experts in parts.items():
        if sorted(experts) != list(range(config.n_routed_experts)):
            raise CheckpointError(
                f"{prefix}: expected experts 0..{config.n_routed_experts - 1}, found {len(experts)}"
            )
        try:
            fused[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat((e["gate_proj"], e["up_proj"])) for _, e in sorted(experts.items())]
            )
            fused[f"{prefix}.down_proj"] = torch.stack(
                [e["down_proj"] for _, e in sorted(experts.items())]
            )
        except KeyError as exc:
            raise CheckpointError(f"{prefix}: an expert lacks {exc}") from exc
    return fused


def read_state_dict(model_dir: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, Tensor]:
    """Checkpoint tensors renamed to our parameter names and cast to `dtype`."""
    state: dict[str, Tensor] = {}
    experts: dict[str, dict[int, dict[str, Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for name, tensor in iter_tensors(checkpoint_files(model_dir)):
        if name.endswith("weight_scale_inv") or tensor.dtype in (
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        ):
            raise CheckpointError(
                f"{name}: FP8 block-quantized weights are not supported; convert the checkpoint "
                "to bf16 first (DeepSeek's fp8_cast_bf16.py)"
            )
        layer = _LAYER.match(name)
        if name.endswith("rotary_emb.inv_freq"):
            continue  # derived from the config
        if layer and int(layer.group(1)) >= config.num_hidden_layers:
            continue  # multi-token-prediction layers (V3) are not used for serving
        expert = _EXPERT.match(name)
        if expert:
            experts[expert.group(1)][int(expert.group(2))][expert.group(3)] = tensor
            continue
        state[name] = tensor
    state.update(_fuse_experts(experts, config))
    if config.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight", torch.empty(0))
    return {k: v.to(dtype) for k, v in state.items()}


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> DeepseekForCausalLM:
    """Build the model from `model_dir` (config.json + safetensors) on `device`."""
    model_dir = Path(model_dir)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    config = ModelConfig.from_dir(model_dir)
    state = read_state_dict(model_dir, config, dtype)
    with torch.device("meta"):
        model = DeepseekForCausalLM(config)
    expected = dict(model.state_dict())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or misshaped:
        lines = (
            [f"missing: {k}" for k in missing[:20]]
            + [f"unexpected: {k}" for k in unexpected[:20]]
            + misshaped[:20]
        )
        raise CheckpointError(
            f"{model_dir} does not match its config.json:\n  " + "\n  ".join(lines)
        )
    model.load_state_dict(state, assign=True)
    model.eval()
    return model.to_device(device)

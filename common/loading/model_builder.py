"""A model, or one of its decoder layers, built from a `WeightSource` one tensor at a time
(nothing held twice): a weight the source keeps quantized (FP8, INT4) takes its module's place
and dequantizes on use."""

from __future__ import annotations

import torch
from torch import Tensor

from common.loading.weights import WeightSource, kept_float32
from common.model.causal_lm import DecoderLayer, DeepseekForCausalLM
from common.model.fp8 import DequantizedOnUse, Weight, share_workspace


def build_model(src: WeightSource) -> DeepseekForCausalLM:
    """The full model from `src`, one tensor at a time (nothing is held twice). A weight the
    source keeps in FP8 replaces its `nn.Linear` (or stacked expert parameter)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(src.config)
    fill_module(model, src)
    share_workspace(model)
    return model.eval()


def build_layer(src: WeightSource, index: int) -> DecoderLayer:
    """Decoder layer `index` alone, from `src`: the tensors `build_model` gives that layer."""
    with torch.device("meta"):
        layer = DecoderLayer(src.config, index)
    fill_module(layer, src, f"model.layers.{index}.")
    share_workspace(layer)
    return layer.eval()


def fill_module(
    module: torch.nn.Module, src: WeightSource, prefix: str = "", skip: frozenset[str] = frozenset()
) -> None:
    """Assign every tensor of `module` (built on the meta device) from `src`, named
    `prefix + name` there; names in `skip` stay on the meta device for the caller."""
    linears = {f"{k}.weight" for k, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    state: dict[str, Tensor] = {}
    for name in module.state_dict():
        if name in skip:
            continue
        value: Weight
        full = prefix + name
        if name.endswith("experts.gate_up_proj"):
            value = src.gate_up(full.removesuffix(".gate_up_proj"))
        elif name.endswith("experts.down_proj"):
            value = src.down(full.removesuffix(".down_proj"))
        elif name in linears:
            value = src.linear(full)
        else:
            value = src.tensor(full, dtype=torch.float32 if kept_float32(full) else None)
        if isinstance(value, DequantizedOnUse):
            path, _, leaf = name.rpartition(".")
            if leaf == "weight":  # an nn.Linear: the FP8 weight takes the module's place
                path, _, leaf = path.rpartition(".")
            parent = module.get_submodule(path)
            delattr(parent, leaf)
            setattr(parent, leaf, value)
            key = f"{path}.{leaf}" if path else leaf
            state.update({f"{key}.{k}": v for k, v in value.state_dict().items()})
        else:
            state[name] = value
    module.load_state_dict(state, assign=True, strict=not skip)

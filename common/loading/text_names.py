"""Which of a checkpoint's tensors the served model reads, under which of our names.

A multimodal wrapper (Kimi K2.5 / K2.6, Mistral Small 4) stores its text model under a prefix
(`language_model.model.layers.N...`, or transformers 5's `model.language_model.layers.N...`)
beside a vision tower and projector, which this engine does not serve (a request with an
image is refused at the router). A.X-K1 stores its MoE output norm for its dense layers too,
where the model does not use it (as in HF transformers). Torch-free.
"""

from __future__ import annotations

import re

from common.model.args import ModelConfig

# stored prefix -> ours, the first that matches
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""))
_VISION = re.compile(r"^(model\.)?(vision_tower|vision_model|mm_projector|multi_modal_projector)\.")
_MOE_OUTPUT_NORM = re.compile(r"^model\.layers\.(\d+)\.post_mlp_layernorm\.weight$")


def served_name(stored: str, config: ModelConfig) -> str | None:
    """Our name for stored tensor `stored`, or None where the served model does not read it."""
    if _VISION.match(stored):
        return None
    name = stored
    for prefix, ours in _TEXT_PREFIXES:
        if stored.startswith(prefix):
            name = ours + stored.removeprefix(prefix)
            break
    norm = _MOE_OUTPUT_NORM.match(name)
    if norm and not (config.moe_output_norm and config.is_moe_layer(int(norm.group(1)))):
        return None
    return name

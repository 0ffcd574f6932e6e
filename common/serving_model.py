"""Load a model in the latent basis the serving stack uses (prefill and decode must agree).

`reparam` names a TPLA side file in the model directory (`tpla_pca` -> `tpla_pca.json`). It
folds gamma and rotates the latent exactly, and supplies per-layer spectra from which each
decode rank derives its shard constants. Without one, TPLA uses the identity basis with
e_i = 1/r.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from torch import Tensor

from common.model.attn_backend import select_backend
from common.model.loader import load_model
from common.model.model import DeepseekForCausalLM


def side_file_path(model_dir: str | Path, reparam: str) -> Path:
    name = reparam if reparam.endswith(".json") else f"{reparam}.json"
    return Path(model_dir) / name


def load_serving_model(
    model_dir: str | Path, reparam: str | None, dtype: str = "float32"
) -> tuple[DeepseekForCausalLM, list[Tensor | None]]:
    """The model (rotated when `reparam` is set) and its per-layer latent spectra."""
    model = load_model(model_dir, dtype=dtype)
    if not reparam:
        return model, [None] * model.config.num_hidden_layers
    from common.tpla.convert import apply_reparameterization, load_side_file

    path = side_file_path(model_dir, reparam)
    if not path.is_file():
        # Serving still works, just with the paper's weakest basis: say so loudly.
        warnings.warn(
            f"TPLA side file {path} not found: using the identity basis with "
            "e_i = 1/r (run `tpla convert` to calibrate)",
            stacklevel=2,
        )
        return model, [None] * model.config.num_hidden_layers
    return model, list(apply_reparameterization(model, load_side_file(path)))


def load_prefill_model(
    model_dir: str | Path,
    reparam: str | None,
    dtype: str = "float32",
    attention_backend: str = "auto",
    device: str = "cpu",
) -> DeepseekForCausalLM:
    """The serving model for a prefill on `device`: its attention on `attention_backend`
    (`select_backend`: auto, sdpa, native, flash-attn). Decode ranks load `load_serving_model`
    and never prefill, so only here is a prefill kernel chosen (and built, on first use)."""
    # Rotated on the CPU (the reparameterization's checks run in fp64), then placed.
    model = load_serving_model(model_dir, reparam, dtype)[0].to_device(device)
    model.prefill_backend = select_backend(attention_backend, model.lm_head.weight.device)
    return model

"""Load a model in the latent basis the serving stack uses (prefill and decode must agree).

`reparam` names a TPLA side file in the model directory (`tpla_pca` -> `tpla_pca.json`; the
values `auto` and `none` as common/loading/side_file_choice.py reads them). It folds gamma and
rotates the latent exactly, and supplies per-layer spectra from which each decode rank derives
its shard constants. Without one, TPLA uses the identity basis with e_i = 1/r.

The weights are read from the checkpoint tensor by tensor (`CheckpointWeights`), rotated as
they are read: a decode rank builds only its share from them, the prefill worker the whole
model, neither ever holding a second copy. `weight_dtype` (TPLA_WEIGHT_DTYPE) says whether an
FP8 checkpoint's linear weights stay FP8 (`keeps_fp8`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from common.loading.loader import serving_dtype
from common.loading.model_builder import build_model
from common.loading.mtp_weights import build_mtp_layer
from common.loading.serving_kernels import PrefillKernels
from common.loading.side_file_choice import resolve_reparam, side_file_path
from common.loading.weights import CheckpointWeights
from common.model.causal_lm import DeepseekForCausalLM
from common.model.mtp import MTPLayer
from common.runtime.kernel_choice import KernelConfig

# `quantized` keeps a checkpoint's FP8 or INT4 weights as stored; `float8` is its older name.
WEIGHT_DTYPES = ("auto", "quantized", "float8", "dequantize")


def keeps_fp8(weight_dtype: str, device: str | torch.device) -> bool:
    """Whether an FP8 checkpoint's linear weights stay FP8 on `device`: `auto` keeps them on
    CUDA (memory) and dequantizes them at load on the CPU (speed)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {weight_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    if weight_dtype == "auto":
        return torch.device(device).type == "cuda"
    return weight_dtype in ("quantized", "float8")


def open_serving_weights(
    model_dir: str | Path,
    reparam: str | None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    weight_dtype: str = "auto",
    mtp: bool = False,
) -> tuple[CheckpointWeights, list[Tensor | None]]:
    """The checkpoint's weights (in the side file's basis when `reparam` is set), read on
    demand in `dtype` onto `device` (an FP8 checkpoint's linears kept FP8 where `weight_dtype`
    says so), and the per-layer latent spectra of the model's own layers. `mtp`: the source
    serves the MTP layers too (in the side file's basis when it covers them), and the spectra
    go on with theirs (None for one the side file does not cover)."""
    keep = keeps_fp8(weight_dtype, device)
    src = CheckpointWeights(model_dir, serving_dtype(dtype), device, keep_fp8=keep, mtp=mtp)
    layers = src.config.num_hidden_layers
    extra = src.mtp_layers if mtp else 0
    name = resolve_reparam(model_dir, reparam)
    if name is None:
        return src, [None] * (layers + extra)
    from common.loading.side_file import basis_rotations, load_side_file

    side = load_side_file(side_file_path(model_dir, name))
    attn = "model.layers.{}.self_attn."
    rotations = basis_rotations(
        side,
        src.config,
        (src.tensor(attn.format(i) + "kv_a_proj_with_mqa.weight") for i in range(layers)),
        lambda i: src.tensor(attn.format(i) + "kv_a_layernorm.weight"),
    )
    if rotations is not None:
        src.use_basis(rotations)
    covered: list[Tensor | None] = list(side.mtp_spectra())[:extra]
    return src, [*side.spectra(), *covered, *[None] * (extra - len(covered))]


def load_serving_model(
    model_dir: str | Path,
    reparam: str | None,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    weight_dtype: str = "auto",
) -> tuple[DeepseekForCausalLM, list[Tensor | None]]:
    """The whole model (rotated when `reparam` is set) on `device`, and its latent spectra."""
    src, spectra = open_serving_weights(model_dir, reparam, dtype, device, weight_dtype)
    return build_model(src).to_device(device), spectra


def load_prefill_model(
    model_dir: str | Path,
    reparam: str | None,
    dtype: str = "float32",
    kernels: KernelConfig | None = None,
    device: str = "cpu",
    weight_dtype: str = "auto",
) -> DeepseekForCausalLM:
    """The serving model for a prefill on `device`, on the kernels `kernels` asks for (all
    `auto` when None: `PrefillKernels`, chosen before the weights load). Decode ranks build
    their share with `open_serving_weights` and never prefill, so only here and in a prefill
    rank's share is a prefill kernel chosen."""
    chosen = PrefillKernels.select(kernels or KernelConfig(), device, serving_dtype(dtype))
    # The latent rotation is computed on the CPU in fp64 as each tensor is read, then placed.
    model = load_serving_model(model_dir, reparam, dtype, device, weight_dtype)[0]
    chosen.weights.apply(model)
    model.prefill_attention = chosen.attention_backend()
    return model


def load_prefill_mtp(
    model_dir: str | Path,
    reparam: str | None,
    main: DeepseekForCausalLM,
    dtype: str = "float32",
    device: str = "cpu",
    weight_dtype: str = "auto",
) -> MTPLayer:
    """MTP module 0, whole, in the serving basis (as the decode ranks hold it), sharing the
    main prefill model's embedding and head: what a prefill runs over a prompt for the
    ranks' MTP cache layer."""
    src, _ = open_serving_weights(model_dir, reparam, dtype, device, weight_dtype, mtp=True)
    require_mtp(src, model_dir)
    return build_mtp_layer(src, 0, main)


def require_mtp(src: CheckpointWeights, model_dir: str | Path) -> None:
    """ValueError naming the model unless `src` (built with `mtp=True`) serves an MTP layer."""
    if not src.mtp_layers:
        raise ValueError(
            f"TPLA_SPECULATIVE=mtp: the model at {model_dir} has no MTP layer "
            "(num_nextn_predict_layers is 0 or absent); use ngram or none"
        )

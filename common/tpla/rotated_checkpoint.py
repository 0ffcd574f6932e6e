"""A reparameterized copy of a checkpoint (`tpla convert --out`): the side file's rotation
applied to each layer's latent tensors, written with the source's names, shards and layout.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from common.loading.checkpoint import Quantization, checkpoint_files
from common.loading.side_file import (
    LayerReparameterization,
    Reparameterization,
    SideFileError,
    fingerprint,
    save_side_file,
    side_file_name,
)
from common.tpla.convert import reparameterized_weights

log = logging.getLogger(__name__)

ATTN = "model.layers.{}.self_attn."


def convert_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    side: Reparameterization,
    *,
    dtype: torch.dtype | None = None,
) -> Reparameterization:
    """Write a reparameterized copy of `model_dir` into `out_dir`; return its side file.

    Tensor names, shard files and the expert layout are those of the source; only the three
    latent tensors of each layer change (and every tensor's dtype when `dtype` is given).
    Non-weight files (config, tokenizer, ...) are copied; stale TPLA side files are not.
    """
    src, out = Path(model_dir), Path(out_dir)
    if src.resolve() == out.resolve():
        raise SideFileError("--out must differ from --model (the source is read while writing)")
    if side.rotation_applied:
        raise SideFileError("this side file is already applied to its checkpoint")
    if Quantization.from_dir(src).method is not None:
        # Rotating block-quantized weights would need requantizing; the side file alone
        # applies R at load time instead (after dequantizing).
        raise SideFileError(
            "cannot write a rotated copy of a quantized checkpoint; serve it with the side file"
        )
    out.mkdir(parents=True, exist_ok=True)
    rotations = {
        i: (layer.rotation if layer.rotation is not None else torch.eye(side.kv_lora_rank))
        for i, layer in enumerate(side.layers)
    }
    kv_a_out: dict[int, Tensor] = {}
    rounded = False
    for file in checkpoint_files(src):
        with safe_open(str(file), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        rounded |= _rotate_shard(tensors, rotations, dtype)
        for i in rotations:
            name = ATTN.format(i) + "kv_a_proj_with_mqa.weight"
            if name in tensors:
                kv_a_out[i] = tensors[name]
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(out / file.name),
            metadata={"format": "pt"},
        )
    if sorted(kv_a_out) != list(range(len(side.layers))):
        raise SideFileError("the checkpoint lacks some layers' kv_a_proj_with_mqa weights")
    if rounded:
        log.warning(
            "the rotated latent weights were rounded to the checkpoint's 16-bit dtype, so MLA "
            "outputs change by that rounding; pass --dtype float32 for an exact conversion"
        )
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and not item.name.startswith("tpla_"):
            shutil.copy2(item, out / item.name)
    if dtype is not None:
        _set_config_dtype(out / "config.json", dtype)
    converted = Reparameterization(
        method=side.method,
        seed=side.seed,
        kv_lora_rank=side.kv_lora_rank,
        layers=tuple(LayerReparameterization(None, layer.spectrum) for layer in side.layers),
        rotation_applied=True,
        fingerprint=fingerprint([kv_a_out[i] for i in range(side.main_layers)]),
        calibration_tokens=side.calibration_tokens,
        calibration_source=side.calibration_source,
        mtp_layers=side.mtp_layers,
    )
    save_side_file(out / side_file_name(side.method), converted)
    return converted


def _rotate_shard(
    tensors: dict[str, Tensor], rotations: dict[int, Tensor], dtype: torch.dtype | None
) -> bool:
    """One shard file's tensors, in place: cast to `dtype` (when given) and each layer's three
    latent tensors reparameterized by its rotation. Whether a rotated weight was rounded to a
    16-bit dtype."""
    if dtype is not None:
        # Cast before rotating, so R is applied in float64 and rounded once, to `dtype`.
        tensors.update({k: v.to(dtype) for k, v in tensors.items() if v.is_floating_point()})
    rounded = False
    for i, r in rotations.items():
        names = [
            ATTN.format(i) + n
            for n in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight")
        ]
        present = [n in tensors for n in names]
        if not any(present):
            continue
        if not all(present):
            raise SideFileError(f"layer {i}'s latent tensors are split across shard files")
        a, g, b = reparameterized_weights(*(tensors[n] for n in names), r)
        rounded |= a.dtype in (torch.bfloat16, torch.float16)
        tensors.update(zip(names, (a, g, b), strict=True))
    return rounded


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = name
    path.write_text(json.dumps(config, indent=2) + "\n")

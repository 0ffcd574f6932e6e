"""A TPLA side file (`tpla_<method>.json` beside a checkpoint): the latent basis R and each
layer's rotated spectrum, how it is written and read, and how a loader checks that it belongs
to the weights at hand (`basis_rotations`). `tpla convert` writes one; the loaders replay it.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from common.model.args import ModelConfig


class Method(enum.Enum):
    """The reparameterization methods, by their CLI / JSON name."""

    IDENTITY = "identity"
    HADAMARD = "hadamard"
    PCA = "pca"

    @property
    def needs_calibration(self) -> bool:
        """Only PCA's basis depends on data; every method's spectrum does."""
        return self is Method.PCA


SIDE_FILE_FORMAT = "tpla-reparameterization/1"


class SideFileError(ValueError):
    """A reparameterization side file is malformed or does not belong to this checkpoint."""


@dataclass(frozen=True)
class LayerReparameterization:
    """One layer's rotation R (None: identity or already applied) and rotated spectrum."""

    rotation: Tensor | None
    spectrum: Tensor  # E[n_k^2] per rotated latent dimension, float64


@dataclass(frozen=True)
class Reparameterization:
    """What a side file holds: method, seed, per-layer R and spectra, calibration note.

    `rotation_applied` is true for the side file of a converted checkpoint, whose weights
    already contain R (and folded gamma); `fingerprint` identifies the weights it applies to.
    """

    method: Method
    seed: int
    kv_lora_rank: int
    layers: tuple[LayerReparameterization, ...]
    rotation_applied: bool
    fingerprint: str
    calibration_tokens: int
    calibration_source: str
    # The last `mtp_layers` entries of `layers` are the model's MTP modules' (layers
    # num_hidden_layers + k); the fingerprint covers the model's own layers only.
    mtp_layers: int = 0

    @property
    def main_layers(self) -> int:
        return len(self.layers) - self.mtp_layers

    def spectra(self) -> list[Tensor]:
        """The model's own layers' spectra (what the decode ranks' shards come from)."""
        return [layer.spectrum for layer in self.layers[: self.main_layers]]

    def mtp_spectra(self) -> list[Tensor]:
        return [layer.spectrum for layer in self.layers[self.main_layers :]]


def side_file_name(method: Method) -> str:
    return f"tpla_{method.value}.json"


def fingerprint(kv_a_weights: Iterable[Tensor]) -> str:
    """sha256 of every layer's kv_a_proj_with_mqa weight rounded to bf16.

    Rounding to bf16 makes the same checkpoint fingerprint identically whether it is stored
    or loaded in bf16 or fp32.
    """
    digest = hashlib.sha256()
    for w in kv_a_weights:
        digest.update(kv_a_bits(w))
    return digest.hexdigest()


def kv_a_bits(w: Tensor) -> bytes:
    """One layer's kv_a_proj_with_mqa weight as `fingerprint` hashes it (rounded to bf16)."""
    return w.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().tobytes()


def basis_rotations(
    side: Reparameterization,
    config: ModelConfig,
    kv_a_weights: Iterable[Tensor],
    gamma: Callable[[int], Tensor],
) -> list[Tensor] | None:
    """Check that `side` belongs to these weights; each layer's R to apply (identity where
    the side file has none; the MTP modules' after the model's layers, when the side file
    covers them), or None for a converted checkpoint's side file (R applied).

    `kv_a_weights` yields each layer's kv_a_proj_with_mqa weight in the serving dtype (one at
    a time is enough: only their fingerprint is kept); `gamma(i)` is layer i's kv_a_layernorm
    weight. A fingerprint mismatch (other weights, or R applied twice) is an error.
    """
    c = config
    mismatch = side.kv_lora_rank != c.kv_lora_rank or side.main_layers != c.num_hidden_layers
    if mismatch or side.mtp_layers > c.num_nextn_predict_layers:
        raise SideFileError(
            f"side file is for d_c={side.kv_lora_rank} with {side.main_layers} layers and "
            f"{side.mtp_layers} MTP layers; the model has d_c={c.kv_lora_rank} with "
            f"{c.num_hidden_layers} layers and {c.num_nextn_predict_layers} MTP layers"
        )
    if fingerprint(kv_a_weights) != side.fingerprint:
        raise SideFileError(
            "the side file was made for different weights (retrained model, or the "
            f"{side.method.value} rotation is already applied); regenerate it with `tpla convert`"
        )
    if side.rotation_applied:
        for i in range(c.num_hidden_layers):
            if not torch.all(gamma(i) == 1):
                raise SideFileError("rotation_applied is set but kv_a_layernorm is not folded")
        return None
    return [
        rep.rotation if rep.rotation is not None else torch.eye(c.kv_lora_rank)
        for rep in side.layers
    ]


def _encode(t: Tensor) -> str:
    return base64.b64encode(
        t.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
    ).decode()


def _decode(text: str, d: int) -> Tensor:
    try:
        raw = np.frombuffer(base64.b64decode(text, validate=True), dtype="<f4")
    except (ValueError, TypeError) as exc:
        raise SideFileError(f"rotation is not valid base64 float32: {exc}") from exc
    if raw.size != d * d:
        raise SideFileError(f"rotation has {raw.size} entries, expected {d * d}")
    r = torch.from_numpy(raw.astype(np.float64)).view(d, d)
    # Stored in float32: snap back to the nearest orthogonal matrix (polar factor) in float64.
    u, _, vh = torch.linalg.svd(r)
    return u @ vh


def save_side_file(path: str | Path, side: Reparameterization) -> None:
    """Write `side` as JSON (rotations as base64 little-endian float32, row-major)."""
    doc = {
        "format": SIDE_FILE_FORMAT,
        "method": side.method.value,
        "seed": side.seed,
        "kv_lora_rank": side.kv_lora_rank,
        "num_layers": len(side.layers),
        "mtp_layers": side.mtp_layers,
        "rotation_applied": side.rotation_applied,
        "fingerprint": side.fingerprint,
        "calibration": {"tokens": side.calibration_tokens, "source": side.calibration_source},
        "layers": [
            {
                "spectrum": [float(v) for v in layer.spectrum.tolist()],
                "rotation": None if layer.rotation is None else _encode(layer.rotation),
            }
            for layer in side.layers
        ],
    }
    Path(path).write_text(json.dumps(doc) + "\n")


def load_side_file(path: str | Path) -> Reparameterization:
    """Read a side file written by `save_side_file`, validating every field."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != SIDE_FILE_FORMAT:
            raise SideFileError(f"{path}: format is {doc.get('format')!r}, not {SIDE_FILE_FORMAT}")
        d = int(doc["kv_lora_rank"])
        layers = []
        for entry in doc["layers"]:
            spectrum = torch.tensor(entry["spectrum"], dtype=torch.float64)
            if spectrum.shape != (d,) or not bool((spectrum >= 0).all()):
                raise SideFileError(f"{path}: a spectrum is not {d} non-negative numbers")
            rot = entry["rotation"]
            layers.append(
                LayerReparameterization(None if rot is None else _decode(rot, d), spectrum)
            )
        if len(layers) != int(doc["num_layers"]):
            raise SideFileError(f"{path}: num_layers does not match the layer entries")
        return Reparameterization(
            method=Method(doc["method"]),
            seed=int(doc["seed"]),
            kv_lora_rank=d,
            layers=tuple(layers),
            rotation_applied=bool(doc["rotation_applied"]),
            fingerprint=str(doc["fingerprint"]),
            calibration_tokens=int(doc["calibration"]["tokens"]),
            calibration_source=str(doc["calibration"]["source"]),
            mtp_layers=int(doc.get("mtp_layers", 0)),
        )
    except OSError as exc:
        raise SideFileError(f"cannot read side file {path}: {exc}") from exc
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, SideFileError):
            raise
        raise SideFileError(f"{path} is not a valid TPLA side file: {exc!r}") from exc

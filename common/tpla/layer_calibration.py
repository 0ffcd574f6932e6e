"""A checkpoint's latent statistics collected layer by layer, without loading the model.

What `tpla convert` calibrates on. Every window's hidden state is kept between layers (the
calibration activations: tokens x hidden floats); then, for each layer in order, its weights
are read from the checkpoint (an FP8 checkpoint's dequantized block by block as read), every
window is pushed through it, its latents are accumulated, and the layer is freed. The MTP
modules follow the model's layers the same way, module k fed the previous stage's hidden
states. Peak memory is one layer's weights plus the activations (and the embedding: read at
the start for the first layer's input, again in each MTP module), whatever the depth.

A config that names MTP modules the checkpoint does not store calibrates the model's layers
only, as serving reads such a checkpoint (the MTP layers are read only when asked for).

Each window goes through each layer alone, by the code of the whole model's prefill
(`packed_prefill` on a one-layer stack), and each layer's sums accumulate the windows in
order, so the statistics equal `collect_latent_statistics` on the loaded model bit for bit,
and so does the side file built from them (tests/unit/common/tpla/test_layer_calibration.py).
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from common.loading.model_builder import build_layer
from common.loading.mtp_weights import build_mtp_layer
from common.loading.side_file import kv_a_bits
from common.loading.weights import CheckpointWeights
from common.model.args import ModelConfig
from common.model.causal_lm import DecoderLayer, packed_prefill
from common.model.prefill_attention import PrefillAttention, SdpaPrefillAttention
from common.model.rope import RotaryEmbedding
from common.tpla.calibration import CalibrationError, LatentStatistics, accumulate_latents

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointCalibration:
    """A checkpoint's latent statistics, with what a side file needs of its weights."""

    config: ModelConfig
    stats: LatentStatistics
    fingerprint: str  # of the model's layers' kv_a_proj_with_mqa weights (side_file.fingerprint)


class OneLayer:
    """One decoder layer as a `LayerStack` for `packed_prefill`: its input is given (the layer
    below's output, or an MTP module's fused input) and its logits are never needed."""

    def __init__(self, layer: DecoderLayer, rope: RotaryEmbedding, first: Tensor) -> None:
        self.layer, self.rope, self.first = layer, rope, first
        self.prefill_attention: PrefillAttention = SdpaPrefillAttention()

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        return [self.layer]

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.first

    def reduce(self, partial: Tensor) -> Tensor:
        return partial

    def logits(self, h: Tensor) -> Tensor:
        return h[:, :0]


def _through(layer: DecoderLayer, rope: RotaryEmbedding, ids: Tensor, first: Tensor) -> Tensor:
    """The layer's output [T, D] over one window, fed `first` [T, D]."""
    out = packed_prefill(OneLayer(layer, rope, first), ids, [len(ids)])
    assert out.hidden is not None
    return out.hidden


def stored_mtp_modules(src: CheckpointWeights) -> int:
    """The MTP modules to calibrate: the config's, when the checkpoint stores any layer past
    the model's; else none (a config that names modules the checkpoint lacks)."""
    c = src.config
    if not c.num_nextn_predict_layers:
        return 0
    prefix = f"model.layers.{c.num_hidden_layers}."
    if any(name.startswith(prefix) for name in src.reader.tensors):
        return c.num_nextn_predict_layers
    log.warning(
        "config.json names %d MTP layer(s) but the checkpoint stores none: calibrating the "
        "model's %d layers only (serving reads it the same way)",
        c.num_nextn_predict_layers,
        c.num_hidden_layers,
    )
    return 0


def calibrate_checkpoint(
    model_dir: str | Path,
    windows: Sequence[Tensor],
    *,
    source: str = "",
    progress: bool = True,
) -> CheckpointCalibration:
    """Sum n n^T per layer (float64) over `windows` (token ids, each prefilled alone), the MTP
    modules' after the model's, reading one layer of the checkpoint at a time (float32, on the
    CPU, as `load_model` reads it)."""
    if not windows:
        raise CalibrationError("no calibration windows (is the text shorter than 2 tokens?)")
    src = CheckpointWeights(model_dir, torch.float32)
    if stored_mtp_modules(src):
        src = CheckpointWeights(model_dir, torch.float32, mtp=True)
    c = src.config
    rope = RotaryEmbedding(c, "cpu")
    digest = hashlib.sha256()
    sums: list[Tensor] = []
    bar = tqdm(
        total=c.num_hidden_layers + src.mtp_layers,
        desc="calibrate",
        unit="layer",
        file=sys.stderr,
        disable=not progress,
    )
    with torch.inference_mode(), bar:
        embed = src.tensor("model.embed_tokens.weight")
        hidden = [F.embedding(w, embed) for w in windows]
        del embed
        for index in range(c.num_hidden_layers):
            layer = build_layer(src, index)
            digest.update(kv_a_bits(layer.self_attn.kv_a_proj_with_mqa.weight))
            sums.append(_calibrate_layer(layer, rope, windows, hidden, lambda _w, h: h))
            del layer
            bar.update()
        mtp_tokens = []
        live = list(windows)  # the windows long enough for the next module
        for k in range(src.mtp_layers):
            module = build_mtp_layer(src, k)
            # Module k reads token t + k + 1 and the previous stage's hidden state at t, at
            # the positions of a window that have that token.
            kept = [j for j, w in enumerate(live) if len(w) > k + 1]
            live = [live[j] for j in kept]
            hidden = [hidden[j][: len(w) - k - 1] for j, w in zip(kept, live, strict=True)]
            ids = [w[k + 1 :] for w in live]
            sums.append(_calibrate_layer(module, rope, ids, hidden, module.fuse))
            mtp_tokens.append(sum(len(i) for i in ids))
            del module
            bar.update()
    tokens = sum(len(w) for w in windows)
    stats = LatentStatistics(tuple(sums), tokens, source, tuple(mtp_tokens))
    return CheckpointCalibration(c, stats, digest.hexdigest())


def _calibrate_layer(
    layer: DecoderLayer,
    rope: RotaryEmbedding,
    windows: Sequence[Tensor],
    hidden: list[Tensor],
    first: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    """Push every window through `layer` (its input `first(ids, hidden state below)`),
    replacing each window's hidden state by the layer's output as it goes; the layer's sum
    of n n^T."""
    d_c = layer.self_attn.d_c
    total = torch.zeros(d_c, d_c, dtype=torch.float64)
    with accumulate_latents(layer.self_attn.kv_a_layernorm, total):
        for j, ids in enumerate(windows):
            hidden[j] = _through(layer, rope, ids, first(ids, hidden[j]))
    return total

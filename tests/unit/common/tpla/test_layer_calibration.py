"""`tpla convert`'s calibration, layer by layer (common/tpla/layer_calibration.py), writes the
side file the whole-model calibration writes, byte for byte: on the demo (V2, an MTP layer in
its own shard), a random V2 (grouped gating, YaRN), a random V3 in block FP8 with an MTP layer
(dequantized block by block as read), for every method, and every other family's tiny
checkpoint in its released layout. A V3 config that names an MTP layer its checkpoint does not
store calibrates the model's layers, as serving reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from common.loading.checkpoint import CheckpointError
from common.loading.loader import load_model
from common.loading.mtp_weights import load_mtp_layers
from common.loading.side_file import Method, save_side_file
from common.tpla.calibration import collect_latent_statistics
from common.tpla.convert import build_reparameterization, reparameterization_from
from common.tpla.layer_calibration import calibrate_checkpoint
from tests.shard_checkpoints import (
    FP8_CONFIG,
    MTP_CONFIG,
    mtp_state,
    quantize,
    random_state,
    save_checkpoint,
)
from tests.tiny import save_hf
from tests.tiny_families import FAMILY_VARIANTS, save_family, save_kimi_int4

DEMO = Path(__file__).resolve().parents[4] / "models" / "demo"
SOURCE = "test windows"


def windows(vocab: int, lengths: tuple[int, ...] = (96, 41, 2)) -> list[Tensor]:
    """Windows as `token_windows` cuts them: full ones, a shorter last one, and one of two
    tokens (one row for the MTP layer)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def whole_model_side_files(
    model_dir: Path, wins: list[Tensor], tmp: Path, mtp: bool = True
) -> dict[Method, bytes]:
    """The reference: `tpla convert` as it was, the whole model loaded in float32 (and its MTP
    layers), calibrated window by window."""
    model = load_model(model_dir)
    layers = load_mtp_layers(model_dir, main=model) if mtp else []
    stats = collect_latent_statistics(model, wins, source=SOURCE, progress=False, mtp_layers=layers)
    out = {}
    for method in Method:
        save_side_file(tmp / "whole.json", build_reparameterization(model, method, stats, seed=3))
        out[method] = (tmp / "whole.json").read_bytes()
    return out


def streamed_side_files(model_dir: Path, wins: list[Tensor], tmp: Path) -> dict[Method, bytes]:
    cal = calibrate_checkpoint(model_dir, wins, source=SOURCE, progress=False)
    out = {}
    for method in Method:
        side = reparameterization_from(cal.config, cal.fingerprint, method, cal.stats, seed=3)
        save_side_file(tmp / "streamed.json", side)
        out[method] = (tmp / "streamed.json").read_bytes()
    return out


def test_the_demo(tmp_path: Path) -> None:
    wins = windows(6144)
    streamed = streamed_side_files(DEMO, wins, tmp_path)
    assert streamed == whole_model_side_files(DEMO, wins, tmp_path)
    cal = calibrate_checkpoint(DEMO, wins, progress=False)
    assert cal.stats.mtp_tokens == (95 + 40 + 1,) and cal.stats.tokens == 139


def test_a_random_v2(tmp_path: Path) -> None:
    save_hf("v2-group-yarn", tmp_path / "v2")
    wins = windows(160)
    assert streamed_side_files(tmp_path / "v2", wins, tmp_path) == whole_model_side_files(
        tmp_path / "v2", wins, tmp_path
    )


def test_a_random_v3_in_fp8_with_an_mtp_layer(tmp_path: Path) -> None:
    main = random_state()
    fp8, _ = quantize({**main, **mtp_state(main, "equal")})
    model_dir = save_checkpoint(fp8, tmp_path / "fp8", **MTP_CONFIG, quantization_config=FP8_CONFIG)
    wins = windows(300)
    streamed = streamed_side_files(model_dir, wins, tmp_path)
    assert streamed == whole_model_side_files(model_dir, wins, tmp_path)
    assert b'"mtp_layers": 1' in streamed[Method.PCA]


def test_an_mtp_layer_the_checkpoint_lacks_is_left_out(tmp_path: Path) -> None:
    model_dir = save_checkpoint(random_state(), tmp_path / "no-mtp", **MTP_CONFIG)
    with pytest.raises(CheckpointError, match="missing"):
        load_mtp_layers(model_dir)  # what the whole-model convert did: refused
    wins = windows(300)
    streamed = streamed_side_files(model_dir, wins, tmp_path)
    assert streamed == whole_model_side_files(model_dir, wins, tmp_path, mtp=False)
    assert b'"mtp_layers": 0' in streamed[Method.PCA]


@pytest.mark.parametrize("family", [*sorted(FAMILY_VARIANTS), "kimi-k2.6-int4"])
def test_every_family(tmp_path: Path, family: str) -> None:
    """`tpla convert`'s bases for each family's tiny checkpoint, in its released layout (a
    wrapper's text names, Mistral's query scaling, A.X-K1's MoE output norm, Kimi's INT4
    experts dequantized as read) equal the whole model's."""
    model_dir = tmp_path / family
    if family == "kimi-k2.6-int4":
        save_kimi_int4(model_dir)
    else:
        save_family(family, model_dir)
    wins = windows(160, (29, 7, 2))
    streamed = streamed_side_files(model_dir, wins, tmp_path)
    assert streamed == whole_model_side_files(model_dir, wins, tmp_path, mtp=False)

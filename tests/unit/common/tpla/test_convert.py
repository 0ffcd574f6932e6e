"""Reparameterization is exact: fp64 logits, HF reload of a converted checkpoint, side files."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

from common.loading.loader import load_model
from common.loading.side_file import (
    Method,
    SideFileError,
    load_side_file,
    save_side_file,
    side_file_name,
)
from common.tpla.convert import (
    apply_reparameterization,
    build_reparameterization,
    load_reparameterization,
)
from common.tpla.rotated_checkpoint import convert_checkpoint
from tests.tiny import calibrate, random_windows, save_hf


@pytest.mark.parametrize("method", [Method.PCA, Method.HADAMARD])
def test_fold_and_rotate_leave_mla_unchanged_in_fp64(tmp_path: Path, method: Method) -> None:
    save_hf("v2-group-yarn", tmp_path, std=0.05)  # q_lora, YaRN, MoE, non-trivial gammas
    model = load_model(tmp_path, dtype=torch.float64)
    side = build_reparameterization(model, method, calibrate(model), seed=1)
    rotated = copy.deepcopy(model)
    apply_reparameterization(rotated, side)
    assert all(
        torch.all(layer.self_attn.kv_a_layernorm.weight == 1) for layer in rotated.model.layers
    )
    assert not torch.allclose(
        rotated.model.layers[0].self_attn.kv_b_proj.weight,
        model.model.layers[0].self_attn.kv_b_proj.weight,
    )
    (ids,) = random_windows(1, 48, model.config.vocab_size, seed=9)
    for absorbed in (False, True):
        before = model.prefill(ids, [48], all_logits=True, absorbed=absorbed)
        after = rotated.prefill(ids, [48], all_logits=True, absorbed=absorbed)
        torch.testing.assert_close(after.logits, before.logits, atol=1e-10, rtol=0)
    # The cached latent is the rotated, gamma-free x / rms(x).
    r = side.layers[1].rotation
    assert r is not None
    gamma = model.model.layers[1].self_attn.kv_a_layernorm.weight.detach()
    torch.testing.assert_close(after.n[1], (before.n[1] / gamma) @ r, atol=1e-10, rtol=0)


def test_converted_checkpoint_loads_in_hf_with_original_logits(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    hf_model = save_hf("v3-noaux-yarn", src, std=0.05)
    model = load_model(src)
    side = build_reparameterization(model, Method.PCA, calibrate(model))
    converted_side = convert_checkpoint(src, out, side)
    assert converted_side.rotation_applied and (out / "tpla_pca.json").is_file()
    assert (out / "config.json").read_text() == (src / "config.json").read_text()

    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    (ids,) = random_windows(1, 40, model.config.vocab_size, seed=2)
    with torch.no_grad():
        want = hf_model(ids[None]).logits[0]
        got = reloaded(ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    norm = reloaded.model.layers[0].self_attn.kv_a_layernorm.weight
    assert torch.all(norm == 1)

    # Our loader + the converted side file: nothing left to apply, same spectra.
    ours = load_model(out)
    spectra = load_reparameterization(ours, out, Method.PCA)
    for got_s, want_s in zip(spectra, side.spectra(), strict=True):
        assert got_s is not None
        torch.testing.assert_close(got_s, want_s, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        ours.prefill(ids, [40], all_logits=True).logits, want, atol=1e-4, rtol=0
    )


def test_side_file_round_trip_and_guards(
    tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = load_model(tiny_dir)
    side = build_reparameterization(model, Method.HADAMARD, calibrate(model), seed=4)
    path = tmp_path / side_file_name(Method.HADAMARD)
    save_side_file(path, side)
    loaded = load_side_file(path)
    assert (loaded.method, loaded.seed, loaded.fingerprint) == (
        Method.HADAMARD,
        4,
        side.fingerprint,
    )
    for a, b in zip(loaded.layers, side.layers, strict=True):
        assert a.rotation is not None and b.rotation is not None
        torch.testing.assert_close(a.rotation, b.rotation, atol=1e-7, rtol=0)
        torch.testing.assert_close(a.spectrum, b.spectrum, atol=0, rtol=0)

    (ids,) = random_windows(1, 32, model.config.vocab_size)
    want = model.prefill(ids, [32], all_logits=True).logits
    apply_reparameterization(model, loaded)
    torch.testing.assert_close(
        model.prefill(ids, [32], all_logits=True).logits, want, atol=1e-5, rtol=0
    )
    with pytest.raises(SideFileError, match="different weights"):
        apply_reparameterization(model, loaded)  # applying R twice is caught by the fingerprint

    path.write_text(path.read_text().replace('"num_layers": 3', '"num_layers": 2'))
    with pytest.raises(SideFileError, match="num_layers"):
        load_side_file(path)
    with caplog.at_level(logging.WARNING):
        spectra = load_reparameterization(load_model(tiny_dir), tmp_path / "nowhere", Method.PCA)
    assert spectra == [None, None, None]
    assert "falling back to the identity basis with e_i = 1/r" in caplog.text


def _mtp_checkpoint(path: Path) -> Path:
    from tests.shard_checkpoints import MTP_CONFIG, mtp_state, random_state, save_checkpoint

    main = random_state()
    return save_checkpoint({**main, **mtp_state(main, "equal")}, path, files=1, **MTP_CONFIG)


def test_side_files_and_conversion_cover_the_mtp_layer(tmp_path: Path) -> None:
    from common.loading.mtp_weights import build_mtp_layer, load_mtp_layers
    from common.loading.side_file import basis_rotations
    from common.loading.weights import CheckpointWeights
    from common.model.mtp import mtp_prefill
    from common.tpla.calibration import collect_latent_statistics
    from common.tpla.convert import model_fingerprint

    src_dir = _mtp_checkpoint(tmp_path / "src")
    model = load_model(src_dir, dtype=torch.float64)
    (layer,) = load_mtp_layers(src_dir, main=model, dtype=torch.float64)
    windows = random_windows(8, 64, model.config.vocab_size, seed=4)  # more tokens than d_c
    stats = collect_latent_statistics(model, windows, progress=False, mtp_layers=[layer])
    assert stats.mtp_tokens == (8 * 63,)
    side = build_reparameterization(model, Method.PCA, stats)
    assert (side.mtp_layers, len(side.spectra()), len(side.mtp_spectra())) == (1, 2, 1)
    assert side.fingerprint == model_fingerprint(model)  # the model's own layers only
    save_side_file(tmp_path / "side.json", side)
    side = load_side_file(tmp_path / "side.json")
    assert side.mtp_layers == 1

    # The MTP layer read in the rotated basis gives the same drafts from the rotated model.
    (ids,) = random_windows(1, 30, model.config.vocab_size, seed=5)
    hidden = model.prefill(ids[:-1], [29], all_logits=True).hidden
    want = mtp_prefill(layer, model.rope, ids[1:], hidden, [29], all_logits=True)
    src = CheckpointWeights(src_dir, torch.float64, mtp=True)
    c = src.config
    attn = "model.layers.{}.self_attn."
    rotations = basis_rotations(
        side,
        c,
        (src.tensor(attn.format(i) + "kv_a_proj_with_mqa.weight") for i in range(2)),
        lambda i: src.tensor(attn.format(i) + "kv_a_layernorm.weight"),
    )
    assert rotations is not None and len(rotations) == 3
    src.use_basis(rotations)
    rotated = build_mtp_layer(src, 0, model)
    got = mtp_prefill(rotated, model.rope, ids[1:], hidden, [29], all_logits=True)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-10, rtol=0)
    r = rotations[2].to(torch.float64)
    gamma = layer.self_attn.kv_a_layernorm.weight.detach()
    torch.testing.assert_close(got.n, (want.n / gamma) @ r, atol=1e-10, rtol=0)

    # A converted checkpoint rotates the MTP layer too and keeps the main fingerprint rule.
    converted = convert_checkpoint(src_dir, tmp_path / "out", side, dtype=torch.float64)
    out_model = load_model(tmp_path / "out", dtype=torch.float64)
    assert converted.fingerprint == model_fingerprint(out_model)
    (out_layer,) = load_mtp_layers(tmp_path / "out", main=out_model, dtype=torch.float64)
    assert torch.all(out_layer.self_attn.kv_a_layernorm.weight == 1)
    hidden = out_model.prefill(ids[:-1], [29], all_logits=True).hidden
    again = mtp_prefill(out_layer, out_model.rope, ids[1:], hidden, [29], all_logits=True)
    torch.testing.assert_close(again.logits, want.logits, atol=1e-9, rtol=0)

"""Shard-wise loading: every decode rank reads only its slices of a multi-shard checkpoint
(plain, rotated by a TPLA side file, or FP8 with block scales) and ends with exactly the
tensors it would have sliced out of the whole loaded model; a decode step gives the same
logits; the prefill model too. FP8 weights kept FP8 give the same steps as dequantized at
load. Bad FP8 files and other quantization methods are refused by name."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.group.comm import Comm
from common.kv.paged_cache import PagedLatentCache
from common.loading.checkpoint import CheckpointError, UnsupportedQuantization
from common.loading.loader import load_model
from common.loading.serving_model import load_prefill_model, open_serving_weights
from common.loading.side_file import save_side_file
from common.model.causal_lm import DeepseekForCausalLM
from common.model.fp8 import Fp8Weight
from common.parallel import ParallelConfig, ParallelMode, RmsNormMode
from common.runtime.kernel_choice import KernelConfig
from common.tpla.convert import apply_reparameterization, model_fingerprint
from services.decode.rank.rank_model import RankModel
from tests.shard_checkpoints import (
    CONFIG,
    FP8_CONFIG,
    ThreadCollectives,
    ThreadGroup,
    quantize,
    random_rotation,
    random_state,
    save_checkpoint,
)

LAYOUTS = {
    "tp1": ParallelConfig(),
    "tpla-tp2-r2": ParallelConfig(tp=2, latent_groups=2),
    "tpla-tp2-r2-sliced": ParallelConfig(tp=2, latent_groups=2, rmsnorm=RmsNormMode.SLICED),
    "mla-tp-tp2": ParallelConfig(tp=2, latent_groups=1),
    "tp4-r2": ParallelConfig(tp=4, latent_groups=2),
    "sp-tp2": ParallelConfig(tp=2, mode=ParallelMode.SP, chunk_size=4),
}
SIDE = "tpla_pca"
SDPA = KernelConfig(prefill_attention="sdpa")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shards")
    state = random_state()
    fp8, dequantized = quantize(state)
    out = {
        "plain": save_checkpoint(state, root / "plain"),
        "fp8": save_checkpoint(fp8, root / "fp8", quantization_config=FP8_CONFIG),
        "dequantized": save_checkpoint(dequantized, root / "dequantized", files=1),
    }
    # A side file with a random rotation per layer (gamma is folded and R applied on load).
    side = random_rotation(model_fingerprint(load_model(out["plain"])))
    save_side_file(out["plain"] / f"{SIDE}.json", side)
    # The FP8 checkpoint and its dequantized copy load to the same weights: one side file.
    fingerprint = model_fingerprint(load_model(out["dequantized"]))
    for name in ("fp8", "dequantized"):
        save_side_file(out[name] / f"{SIDE}.json", replace(side, fingerprint=fingerprint))
    return out


def _whole_then_sliced(model_dir: Path, parallel: ParallelConfig, reparam: str | None = None):
    """Today's path: the whole model loaded (and rotated in place), then each rank's share."""
    full = load_model(model_dir)
    spectra = [None] * full.config.num_hidden_layers
    if reparam:
        from common.loading.side_file import load_side_file

        spectra = apply_reparameterization(full, load_side_file(model_dir / f"{reparam}.json"))
    return _ranks(full, parallel, spectra)


def _shard_wise(model_dir: Path, parallel: ParallelConfig, reparam: str | None = None):
    weights, spectra = open_serving_weights(model_dir, reparam)
    return _ranks(weights, parallel, spectra)


def _ranks(source, parallel: ParallelConfig, spectra) -> list[RankModel]:
    return [RankModel(source, parallel, rank, spectra) for rank in range(parallel.tp)]


def _assert_same_parameters(got: list[RankModel], want: list[RankModel]) -> None:
    for a, b in zip(got, want, strict=True):
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert sorted(pa) == sorted(pb)
        for name, p in pa.items():
            assert p.dtype == pb[name].dtype and p.shape == pb[name].shape, name
            assert torch.equal(p, pb[name]), name
        assert a.parameter_bytes() == b.parameter_bytes()


def _decode_step(models: list[RankModel]) -> torch.Tensor:
    """One decode step of a batch of two over a random cached history, every rank in its own
    thread; the ranks' padded vocab slices concatenated [B, V_padded * tp]."""
    par = models[0].parallel
    group = ThreadGroup(par.tp)
    tables = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    positions, tokens, bs = torch.tensor([9, 14]), torch.tensor([7, 42]), 4
    out: list[torch.Tensor | None] = [None] * par.tp

    def run(rank: int) -> None:
        model = models[rank]
        cache = PagedLatentCache(model.cache_layout(bs, torch.float32), 16)
        gen = torch.Generator().manual_seed(100 + rank)
        cache.kv.copy_(0.3 * torch.randn(cache.kv.shape, generator=gen))
        write, reads = model.split.address(positions, tables, bs, cache.trash_slot)
        coll = ThreadCollectives(group, rank) if par.tp > 1 else None
        comm = Comm(par.tp, coll, coll)
        out[rank] = model.decode_step(tokens, positions, write, reads, cache, comm)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(par.tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(o is not None for o in out), "a rank's decode step failed"
    return torch.cat([o for o in out if o is not None], dim=1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shard_wise_ranks_equal_the_whole_model_sliced(dirs, layout: str) -> None:
    parallel = LAYOUTS[layout]
    got, want = _shard_wise(dirs["plain"], parallel), _whole_then_sliced(dirs["plain"], parallel)
    _assert_same_parameters(got, want)
    assert torch.equal(_decode_step(got), _decode_step(want))


@pytest.mark.parametrize("layout", ["tp1", "tpla-tp2-r2", "tpla-tp2-r2-sliced", "tp4-r2"])
def test_rotated_shard_wise_ranks_equal_rotating_the_whole_model(dirs, layout: str) -> None:
    parallel = LAYOUTS[layout]
    got = _shard_wise(dirs["plain"], parallel, SIDE)
    want = _whole_then_sliced(dirs["plain"], parallel, SIDE)
    _assert_same_parameters(got, want)
    assert got[0].layers[0].attn.shard == want[0].layers[0].attn.shard  # same spectra
    assert torch.equal(_decode_step(got), _decode_step(want))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_ranks_equal_a_checkpoint_dequantized_beforehand(dirs, layout: str) -> None:
    parallel = LAYOUTS[layout]
    got = _shard_wise(dirs["fp8"], parallel)
    _assert_same_parameters(got, _shard_wise(dirs["dequantized"], parallel))
    _assert_same_parameters(got, _whole_then_sliced(dirs["dequantized"], parallel))
    assert got[0].layers[0].attn.q_b.dtype == torch.float32


@pytest.mark.parametrize("layout", ["tpla-tp2-r2", "tp4-r2", "mla-tp-tp2"])
def test_rotated_fp8_ranks_equal_rotating_the_dequantized_copy(dirs, layout: str) -> None:
    parallel = LAYOUTS[layout]
    got = _shard_wise(dirs["fp8"], parallel, SIDE)
    _assert_same_parameters(got, _whole_then_sliced(dirs["dequantized"], parallel, SIDE))


def _reference_model(model_dir: Path) -> DeepseekForCausalLM:
    """The whole checkpoint read file by file with `load_file`, experts stacked by hand."""
    state: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    n = CONFIG["n_routed_experts"]
    for layer in range(1, CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        e = [
            {k: state.pop(f"{p}.{i}.{k}_proj.weight") for k in ("gate", "up", "down")}
            for i in range(n)
        ]
        state[f"{p}.gate_up_proj"] = torch.stack([torch.cat((x["gate"], x["up"])) for x in e])
        state[f"{p}.down_proj"] = torch.stack([x["down"] for x in e])
    from common.model.args import ModelConfig

    model = DeepseekForCausalLM(ModelConfig.from_dir(model_dir))
    model.load_state_dict(state)
    return model.eval()


def test_full_and_prefill_models_equal_a_whole_file_read(dirs) -> None:
    ids = torch.arange(2, 40)
    want = _reference_model(dirs["plain"])
    got = load_model(dirs["plain"])
    for (name, p), q in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    expected = want.prefill(ids, [len(ids)]).logits
    assert torch.equal(got.prefill(ids, [len(ids)]).logits, expected)
    prefill = load_prefill_model(dirs["plain"], None, kernels=SDPA)
    assert torch.equal(prefill.prefill(ids, [len(ids)]).logits, expected)
    # FP8: the prefill model equals the one loaded from the pre-dequantized copy, in bf16 too.
    for dtype in ("float32", "bfloat16"):
        fp8 = load_prefill_model(dirs["fp8"], None, dtype, kernels=SDPA)
        deq = load_prefill_model(dirs["dequantized"], None, dtype, kernels=SDPA)
        assert fp8.lm_head.weight.dtype == getattr(torch, dtype)
        for (name, p), q in zip(fp8.state_dict().items(), deq.state_dict().values(), strict=True):
            assert torch.equal(p, q), name
        assert torch.equal(fp8.prefill(ids, [len(ids)]).logits, deq.prefill(ids, [len(ids)]).logits)


def test_bf16_fp8_ranks_equal_the_dequantized_copy_in_bf16(dirs) -> None:
    parallel = LAYOUTS["tpla-tp2-r2"]
    got, _ = open_serving_weights(dirs["fp8"], None, "bfloat16")
    want, _ = open_serving_weights(dirs["dequantized"], None, "bfloat16")
    a = [RankModel(got, parallel, r) for r in range(2)]
    _assert_same_parameters(a, [RankModel(want, parallel, r) for r in range(2)])
    assert a[1].layers[1].ffn.experts.gate_up_proj.dtype == torch.bfloat16


def _rewrite(src: Path, dst: Path, change, **config) -> Path:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(file)))
    change(state)
    dst.mkdir()
    save_file(state, str(dst / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **config}))
    return dst


def test_bad_fp8_checkpoints_name_the_tensor(dirs, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    missing = _rewrite(dirs["fp8"], tmp_path / "missing", lambda s: s.pop(name + "_scale_inv"))
    with pytest.raises(CheckpointError, match=rf"{name}: FP8 weight without its scale"):
        open_serving_weights(missing, None)

    def wrong_shape(s: dict[str, torch.Tensor]) -> None:
        s[name + "_scale_inv"] = s[name + "_scale_inv"][:, :1].contiguous()

    bad = _rewrite(dirs["fp8"], tmp_path / "shape", wrong_shape)
    with pytest.raises(
        CheckpointError, match=rf"{name}_scale_inv: shape \(2, 1\).*expected \(2, 2\)"
    ):
        load_model(bad)

    no_config = _rewrite(dirs["fp8"], tmp_path / "noconfig", lambda s: None)
    (no_config / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_model(no_config)


def test_other_quantization_methods_are_refused_by_name(dirs, tmp_path: Path) -> None:
    awq = _rewrite(
        dirs["plain"],
        tmp_path / "awq",
        lambda s: None,
        quantization_config={"quant_method": "awq", "bits": 4},
    )
    with pytest.raises(UnsupportedQuantization, match="'awq' is not supported"):
        load_model(awq)
    with pytest.raises(UnsupportedQuantization, match="'awq'"):
        open_serving_weights(awq, None)


def test_large_reads_go_in_row_chunks_with_the_same_bits(dirs, monkeypatch) -> None:
    """Chunks of 21 FP8 rows (and 5 float32 rows): boundaries fall inside scale blocks."""
    from common.loading import checkpoint

    parallel = LAYOUTS["tpla-tp2-r2"]
    monkeypatch.setattr(checkpoint, "READ_CHUNK_BYTES", 4096)
    fp8, plain = _shard_wise(dirs["fp8"], parallel), _shard_wise(dirs["plain"], parallel)
    monkeypatch.undo()
    _assert_same_parameters(fp8, _shard_wise(dirs["dequantized"], parallel))
    _assert_same_parameters(plain, _whole_then_sliced(dirs["plain"], parallel))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_resident_ranks_equal_dequantized_at_load(dirs, layout: str) -> None:
    """Weights kept FP8 and dequantized on use give bit-equal steps (blocks of 128 over these
    widths: slices start inside blocks and the last blocks are partial), in fewer bytes."""
    parallel = LAYOUTS[layout]
    models = {}
    for kept in ("float8", "dequantize"):
        weights = open_serving_weights(dirs["fp8"], None, "float32", "cpu", kept)[0]
        models[kept] = [RankModel(weights, parallel, r) for r in range(parallel.tp)]
    resident = models["float8"][0]
    assert isinstance(resident.layers[1].ffn.experts.gate_up_proj, Fp8Weight)
    assert isinstance(resident.layers[0].attn.uk, Fp8Weight)
    assert resident.parameter_bytes() < models["dequantize"][0].parameter_bytes()
    assert torch.equal(_decode_step(models["float8"]), _decode_step(models["dequantize"]))


def test_fp8_resident_prefill_model_equals_dequantized_at_load(dirs) -> None:
    ids = torch.arange(2, 40)
    for dtype in ("float32", "bfloat16"):
        got = load_prefill_model(dirs["fp8"], None, dtype, SDPA, weight_dtype="float8")
        want = load_prefill_model(dirs["fp8"], None, dtype, SDPA, weight_dtype="dequantize")
        assert isinstance(got.model.layers[0].self_attn.kv_b_proj, Fp8Weight)
        assert isinstance(got.model.layers[1].mlp.experts.down_proj, Fp8Weight)
        a, b = got.prefill(ids, [len(ids)]), want.prefill(ids, [len(ids)])
        assert torch.equal(a.logits, b.logits)
        assert all(torch.equal(x, y) for x, y in zip(a.n, b.n, strict=True))
    # auto: dequantized at load on the CPU.
    auto = load_prefill_model(dirs["fp8"], None, kernels=SDPA)
    assert not any(isinstance(m, Fp8Weight) for m in auto.modules())

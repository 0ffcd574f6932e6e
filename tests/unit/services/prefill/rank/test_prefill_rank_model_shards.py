"""A prefill rank reads only its share of a multi-shard checkpoint: every element it reads
it holds, and it ends with exactly the tensors it would have sliced out of the whole loaded
model (in a TPLA side file's rotated basis too), so its prefill is the same; FP8 weights kept
FP8 give the same prefill as dequantized at load, in fewer bytes; and `parameter_bytes`
counts what it holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from common.group.comm import Comm
from common.loading.checkpoint import CheckpointReader
from common.loading.loader import load_model
from common.loading.serving_model import open_serving_weights
from common.loading.side_file import load_side_file, save_side_file
from common.loading.weights import WeightSource
from common.model.causal_lm import DeepseekForCausalLM, PrefillOutput
from common.model.fp8 import Fp8Weight
from common.parallel import MoeParallel, ParallelConfig
from common.runtime.kernel_choice import KernelConfig
from common.tpla.convert import apply_reparameterization, model_fingerprint
from services.prefill.rank.prefill_rank_model import PrefillRankModel, load_prefill_rank
from tests.shard_checkpoints import (
    FP8_CONFIG,
    ThreadCollectives,
    ThreadGroup,
    quantize,
    random_rotation,
    random_state,
    run_group,
    save_checkpoint,
)

SIDE = "tpla_pca"
SDPA = KernelConfig(prefill_attention="sdpa")
LAYOUTS = {
    "tp1": ParallelConfig(),
    "tp2": ParallelConfig(tp=2),
    "tp2-ep": ParallelConfig(tp=2, moe=MoeParallel.EP),
    "tp4": ParallelConfig(tp=4),
}
# Tensors every rank holds whole; the rest are split, each element held by one rank.
REPLICATED = re.compile(r"(kv_a_proj_with_mqa|q_a_proj|layernorm|mlp\.gate\.|^model\.norm\.)")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefill-shards")
    state = random_state()
    fp8, _ = quantize(state)
    out = {
        "plain": save_checkpoint(state, root / "plain"),
        "fp8": save_checkpoint(fp8, root / "fp8", quantization_config=FP8_CONFIG),
    }
    side = random_rotation(model_fingerprint(load_model(out["plain"])))
    save_side_file(out["plain"] / f"{SIDE}.json", side)
    return out


IDS, LENS = torch.arange(2, 40), [20, 18]


def _prefill(
    source: WeightSource | DeepseekForCausalLM, parallel: ParallelConfig
) -> tuple[list[PrefillRankModel], list[PrefillOutput]]:
    def rank(r: int, comm: Comm) -> tuple[PrefillRankModel, PrefillOutput]:
        model = PrefillRankModel(source, parallel, r, comm)
        return model, model.prefill(IDS, LENS, all_logits=True)

    models, outs = zip(*run_group(parallel.tp, rank), strict=True)
    return list(models), list(outs)


def _assert_same(a: list[PrefillOutput], b: list[PrefillOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.logits, y.logits)
        assert all(torch.equal(p, q) for p, q in zip(x.n, y.n, strict=True))


def _assert_same_parameters(got: list[PrefillRankModel], want: list[PrefillRankModel]) -> None:
    for a, b in zip(got, want, strict=True):
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert sorted(pa) == sorted(pb)
        for name, p in pa.items():
            assert p.dtype == pb[name].dtype and torch.equal(p, pb[name]), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rank_reads_only_its_share(dirs, layout: str, monkeypatch) -> None:
    parallel = LAYOUTS[layout]
    read: list[int] = []
    original = CheckpointReader.read

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(self, *args, **kwargs)
        read.append(out.numel())
        return out

    monkeypatch.setattr(CheckpointReader, "read", counted)
    weights, _ = open_serving_weights(dirs["plain"], None)
    ranks = []
    for rank in range(parallel.tp):
        read.clear()
        # Built one after the other: building runs no collective.
        coll = ThreadCollectives(ThreadGroup(parallel.tp), rank)
        ranks.append(PrefillRankModel(weights, parallel, rank, Comm(parallel.tp, coll, coll)))
        assert sum(read) == sum(p.numel() for p in ranks[-1].parameters())
    monkeypatch.undo()
    got_out = _prefill(weights, parallel)[1]
    want, want_out = _prefill(load_model(dirs["plain"]), parallel)
    _assert_same_parameters(ranks, want)
    _assert_same(got_out, want_out)


def test_a_rotated_rank_equals_rotating_the_whole_model(dirs) -> None:
    parallel = LAYOUTS["tp2"]
    weights, _ = open_serving_weights(dirs["plain"], SIDE)
    whole = load_model(dirs["plain"])
    apply_reparameterization(whole, load_side_file(dirs["plain"] / f"{SIDE}.json"))
    got, got_out = _prefill(weights, parallel)
    want, want_out = _prefill(whole, parallel)
    _assert_same_parameters(got, want)
    _assert_same(got_out, want_out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_resident_ranks_equal_dequantized_at_load(dirs, dtype: str) -> None:
    parallel = LAYOUTS["tp2"]
    outs, sizes = {}, {}
    for kept in ("float8", "dequantize"):
        weights = open_serving_weights(dirs["fp8"], None, dtype, "cpu", kept)[0]
        models, outs[kept] = _prefill(weights, parallel)
        sizes[kept] = models[0].parameter_bytes()
        if kept == "float8":
            layer = models[0].layers[1]
            assert isinstance(layer.self_attn.kv_b_proj, Fp8Weight)
            assert isinstance(layer.mlp.experts.down_proj, Fp8Weight)
            assert models[0].lm_head.dtype == getattr(torch, dtype)
    _assert_same(outs["float8"], outs["dequantize"])
    assert sizes["float8"] < sizes["dequantize"]


def test_parameter_bytes_count_what_the_ranks_hold(dirs) -> None:
    whole = load_model(dirs["plain"])
    named = [(n, p.numel() * p.element_size()) for n, p in whole.named_parameters()]
    total = sum(b for _, b in named)
    replicated = sum(b for n, b in named if REPLICATED.search(n))
    for layout in ("tp1", "tp2", "tp4"):
        parallel = LAYOUTS[layout]
        models, _ = _prefill(whole, parallel)
        held = [m.parameter_bytes() for m in models]
        assert sum(held) == total + (parallel.tp - 1) * replicated
        assert len(set(held)) == 1  # heads, columns and this vocabulary split evenly


def test_the_loader_reads_onto_the_device_with_its_backend(dirs) -> None:
    model = load_prefill_rank(
        dirs["plain"], None, ParallelConfig(), 0, Comm(1), dtype="float32", kernels=SDPA
    )
    assert model.prefill_attention.name == "sdpa" and model.device.type == "cpu"
    want = load_model(dirs["plain"]).prefill(IDS, LENS)
    assert torch.equal(model.prefill(IDS, LENS).logits, want.logits)

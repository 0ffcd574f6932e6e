"""The native decode-layer pieces (common/native/decode_layer) against the PyTorch path they
replace: `RMSNorm.forward`, and a rank's `queries` + `new_latent` + `PagedLatentCache.write`
for every tiny checkpoint variant (query low-rank or not, interleaved or half rope, YaRN) in
exact and sliced TPLA and MLA-TP; then a whole decode step with and without them."""

from __future__ import annotations

import pytest
import torch

from common.group.comm import Comm
from common.kv.paged_cache import CacheReads, PagedLatentCache
from common.loading.loader import load_model
from common.model.mla import RMSNorm
from common.native import decode_layer
from common.parallel import ParallelConfig, ParallelMode, RmsNormMode
from services.decode.rank.backends import TorchBackend
from services.decode.rank.backends.native_backend import NativeBackend
from services.decode.rank.rank_model import RankModel
from tests.tiny import VARIANTS, save_hf

pytestmark = pytest.mark.skipif(not decode_layer.available(), reason="native library not built")


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("m,d", [(1, 256), (3, 7), (5, 16), (16, 40)])
def test_rms_norm_matches_the_module(m: int, d: int) -> None:
    norm = RMSNorm(d, 1e-6)
    norm.weight.data = _randn(d, seed=d)
    x = _randn(m, d, seed=m, scale=3.0)
    with torch.inference_mode():
        got = decode_layer.rms_norm(x, norm.weight, norm.eps)
        torch.testing.assert_close(got, norm(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="fp32"):
        decode_layer.rms_norm(x.double(), norm.weight.double(), norm.eps)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    out = {}
    for variant in VARIANTS:
        path = tmp_path_factory.mktemp(variant)
        save_hf(variant, path, std=0.05)
        out[variant] = path
    return out


def _rank_model(path, parallel: ParallelConfig, rank: int):
    full = load_model(path)
    return RankModel(full, parallel, rank, backend=NativeBackend())


LAYOUTS = [
    (ParallelConfig(tp=2, latent_groups=2), 1),
    (ParallelConfig(tp=2, latent_groups=2, rmsnorm=RmsNormMode.SLICED), 0),
    (ParallelConfig(tp=2, latent_groups=1), 1),
]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=["tpla", "tpla-sliced", "mla-tp"])
def test_attention_inputs_match_the_torch_path(checkpoints, variant: str, layout) -> None:
    parallel, rank = layout
    model = _rank_model(checkpoints[variant], parallel, rank)
    native, torch_ = model.backend, TorchBackend()
    c = model.config
    layout_ = model.cache_layout(4, torch.float32)
    fused, reference = PagedLatentCache(layout_, 8), PagedLatentCache(layout_, 8)
    for b in (1, 3):
        h = _randn(b, c.hidden_size, seed=b, scale=2.0)
        positions = torch.tensor([5, 0, 17][:b])
        cos, sin = model.rope.cos_sin(positions)
        # Another rank's token (SP) goes to the trash slot, like a padding row's.
        slots = torch.tensor([9, fused.trash_slot, 30][:b])
        with torch.inference_mode():
            for index, layer in enumerate(model.layers):
                args = (index, layer, model.rope, h, cos, sin)
                q_nope, q_pe = native.attention_inputs(*args, fused, slots)
                want_nope, want_pe = torch_.attention_inputs(*args, reference, slots)
                torch.testing.assert_close(q_nope, want_nope, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(q_pe, want_pe, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused.kv, reference.kv, rtol=1e-5, atol=1e-5)
    assert fused.kv.abs().sum() > 0 and not fused.kv[:, 1:9].any()  # only the slots written


def test_attention_inputs_refuse_a_slot_outside_the_cache_and_write_nothing(checkpoints) -> None:
    model = _rank_model(checkpoints["v2-greedy"], *LAYOUTS[0])
    cache = PagedLatentCache(model.cache_layout(4, torch.float32), 2)
    h = _randn(2, model.config.hidden_size, seed=0)
    cos, sin = model.rope.cos_sin(torch.tensor([0, 1]))
    args = (0, model.layers[0], model.rope, h, cos, sin, cache)
    with torch.inference_mode():
        for bad in (8, -2):
            with pytest.raises(ValueError, match="outside the cache"):
                model.backend.attention_inputs(*args, torch.tensor([3, bad]))
        with pytest.raises(ValueError, match="inconsistent"):
            model.backend.attention_inputs(*args, torch.tensor([3]))
    assert not cache.kv.any()


@pytest.mark.parametrize("variant", ["v2-greedy", "v3-noaux-yarn"])
def test_a_decode_step_with_native_layers_equals_the_torch_glue(checkpoints, variant) -> None:
    """tp = 1: the same step (history in the cache, a batch of two) with the native layer
    pieces and with the PyTorch ones gives the same logits and the same cache."""
    model = _rank_model(checkpoints[variant], ParallelConfig(), 0)
    layout = model.cache_layout(4, torch.float32)
    caches = [PagedLatentCache(layout, 16) for _ in range(2)]
    history = _randn(*caches[0].kv.shape, seed=3, scale=0.3)
    tables = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    positions = torch.tensor([9, 14])
    lengths = positions + 1
    write_slots = tables[torch.arange(2), positions // 4] * 4 + positions % 4
    reads = CacheReads.blocks(tables, lengths, 4)
    tokens = torch.tensor([7, 42])
    logits = []
    for cache, backend in zip(caches, (NativeBackend(), TorchBackend()), strict=True):
        cache.kv.copy_(history)
        model.use_backend(backend)
        logits.append(model.decode_step(tokens, positions, write_slots, reads, cache, Comm(1)))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(caches[0].kv, caches[1].kv, rtol=1e-5, atol=1e-5)


def test_an_sp_step_refuses_reads_without_token_slots(checkpoints) -> None:
    model = _rank_model(checkpoints["v2-greedy"], ParallelConfig(mode=ParallelMode.SP), 0)
    cache = PagedLatentCache(model.cache_layout(4, torch.float32), 4)
    tables, positions = torch.tensor([[0, 1]]), torch.tensor([5])
    reads = CacheReads.blocks(tables, positions + 1, 4)
    with pytest.raises(ValueError, match=r"CacheReads\.tokens"):
        model.decode_step(torch.tensor([7]), positions, torch.tensor([5]), reads, cache, Comm(1))

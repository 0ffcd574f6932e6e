"""The native path of a chunk's attention over its past against the reference (torch's tiled
online softmax, common/model/past_attention.py), expanded and absorbed: tiles that split the
past or not, no past at all, one query; and a model on the native backend prefilled in chunks
that split a KV block (16 tokens) or not equals it prefilled whole."""

from __future__ import annotations

import pytest
import torch

from common.loading.loader import load_model
from common.model.past_attention import absorbed_over_past, expanded_over_past
from common.model.past_native import (
    native_absorbed_over_past,
    native_expanded_over_past,
    usable,
)
from common.model.prefill_attention import NativePrefillAttention, SdpaPrefillAttention
from common.native import causal_attention
from tests.tiny import save_hf
from tests.unit.common.model.test_chunked import chunked_and_whole

pytestmark = pytest.mark.skipif(
    not causal_attention.available(), reason="no C++ compiler for the kernel"
)

HEADS, D_N, D_R, D_V, D_C = 4, 16, 8, 12, 32
SCALE = 0.17
PAIRS = [
    (expanded_over_past, native_expanded_over_past),
    (absorbed_over_past, native_absorbed_over_past),
]


@pytest.mark.parametrize(
    ("past", "queries", "tile"),
    [(0, 9, None), (37, 5, 16), (48, 16, 16), (40, 24, 7), (64, 1, 1000), (300, 70, None)],
)
@pytest.mark.parametrize(("reference", "native"), PAIRS)
def test_native_equals_the_reference(past: int, queries: int, tile, reference, native) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(past * 100 + queries)
    total = past + queries
    q_nope = torch.randn(queries, HEADS, D_N, generator=g)
    q_pe = torch.randn(queries, HEADS, D_R, generator=g)
    n = torch.randn(total, D_C, generator=g)
    k_pe = torch.randn(total, D_R, generator=g)
    kv_b = torch.randn(HEADS * (D_N + D_V), D_C, generator=g) * 0.3
    want = reference(q_nope, q_pe, n, k_pe, kv_b, SCALE)
    got = native(q_nope, q_pe, (n[:past], k_pe[:past]), (n[past:], k_pe[past:]), kv_b, SCALE, tile)
    assert got.shape == want.shape == (queries, HEADS, D_V)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_only_the_native_backend_on_fp32_cpu_takes_it() -> None:
    x = torch.zeros(2, 3)
    native = NativePrefillAttention()
    assert usable(native, x, x)
    assert not usable(SdpaPrefillAttention(), x, x)
    assert not usable(native, x, x.double())


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("v3-native")
    save_hf("v3-noaux-yarn", out, std=0.08)
    loaded = load_model(out)
    loaded.prefill_attention = NativePrefillAttention()
    return loaded


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("chunk", [16, 23, 64])
def test_native_chunks_equal_the_whole_prompt(model, chunk: int, absorbed: bool) -> None:  # type: ignore[no-untyped-def]
    chunked_and_whole(model, chunk, absorbed)

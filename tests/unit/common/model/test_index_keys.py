"""Indexer key formats (common/model/index_keys.py): the model dtype's is the keys as they are;
fp8's scores equal DeepSeek's FP8 indexer ported to torch (common/model/fp8_index.py: rotate,
quantize, fp8_index) and its rows take 132 bytes at d_I = 128, each with a power-of-two
scale."""

from __future__ import annotations

import pytest
import torch

from common.model.fp8_index import act_quant, fp8_index_scores, hadamard
from common.model.index_keys import key_format
from common.model.indexer import index_scores

SCALE = 128**-0.5


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(5, 8, 128, generator=g)
    w = torch.randn(5, 8, generator=g)
    k = torch.randn(300, 128, generator=g) * torch.rand(300, 1, generator=g) * 4
    return q, w, k


def test_fp8_scores_are_deepseeks() -> None:
    q, w, k = _inputs()
    fmt = key_format("fp8", 128, torch.float32)
    rows = fmt.encode(k)
    assert rows.dtype == torch.uint8 and rows.shape == (300, 132)
    got = index_scores(fmt.queries(q), w, rows, SCALE, fmt.decode, tile=64)
    want = fp8_index_scores(q, w, k, SCALE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp8_keys_are_scaled_rotated_e4m3() -> None:
    _, _, k = _inputs(1)
    values, scale = act_quant(hadamard(k))
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())  # powers of two
    fmt = key_format("fp8", 128, torch.float32)
    decoded = fmt.decode(fmt.encode(k))
    assert torch.equal(decoded, values.float() * scale)
    # e4m3 keeps 3 mantissa bits: within a step of the rotated key's largest value.
    rotated = hadamard(k)
    assert ((decoded - rotated).abs() <= rotated.abs().amax(-1, keepdim=True) / 8).all()


def test_hadamard_keeps_dot_products() -> None:
    q, _, k = _inputs(2)
    torch.testing.assert_close(hadamard(q[0]) @ hadamard(k).T, q[0] @ k.T, rtol=1e-4, atol=1e-3)


def test_model_dtype_keys_are_the_keys() -> None:
    q, w, k = _inputs(3)
    fmt = key_format("model", 128, torch.bfloat16)
    rows = fmt.encode(k)
    assert rows.dtype == torch.bfloat16 and fmt.row_bytes == 256
    torch.testing.assert_close(
        index_scores(fmt.queries(q), w, rows, SCALE, fmt.decode),
        index_scores(q, w, k.bfloat16().float(), SCALE),
    )


def test_an_unknown_or_unfit_format_is_refused() -> None:
    with pytest.raises(ValueError, match="is not one of"):
        key_format("int4", 128, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        key_format("fp8", 96, torch.float32)

"""The native causal prefill kernel against its reference (torch SDPA,
`SdpaPrefillAttention`) and an
explicit masked softmax, over the shapes prefill meets: packed ragged sequences, the MLA
widths (d_v < d_qk), lengths around the kernel's 48-row query and 72-key blocks, more than
one thread, MLA's parts read in place (q_nope | q_pe, strided k_nope | shared k_pe)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from common.model.prefill_attention import NativePrefillAttention, SdpaPrefillAttention
from common.native import causal_attention

pytestmark = pytest.mark.skipif(
    not causal_attention.available(), reason="no C++ compiler for the kernel"
)


def masked_softmax_reference(q, k, v, cu, scale):
    """Plain fp64 causal attention, one sequence at a time."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for s, e in itertools.pairwise(cu):
        qs, ks, vs = (t[s:e].double().transpose(0, 1) for t in (q, k, v))  # [H, n, d]
        scores = scale * qs @ ks.transpose(1, 2)
        mask = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        p = scores.masked_fill(~mask, -math.inf).softmax(-1)
        out[s:e] = (p @ vs).transpose(0, 1)
    return out


def _inputs(lengths, heads, d_qk, d_v, seed=0, magnitude=1.0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (magnitude * torch.randn(total, heads, d_qk, generator=g) for _ in range(2))
    v = torch.randn(total, heads, d_v, generator=g)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return q, k, v, cu


@pytest.mark.parametrize(
    ("lengths", "heads", "d_qk", "d_v"),
    [
        ([1], 1, 48, 32),
        ([37, 1, 100], 8, 48, 32),  # the demo model's widths
        ([49, 48, 47], 8, 48, 32),  # around one 48-row query block
        ([145], 3, 24, 8),  # odd head count, keys past two 72-key blocks
        ([73, 72, 71], 2, 80, 48),  # around one 72-key block
        ([50], 2, 192, 128),  # DeepSeek-V2/V3 widths
        ([0, 5, 0], 4, 48, 32),  # empty sequences in the pack
        ([9], 2, 5, 3),  # widths below one vector
    ],
)
def test_native_matches_sdpa_and_the_masked_softmax(lengths, heads, d_qk, d_v) -> None:
    q, k, v, cu = _inputs(lengths, heads, d_qk, d_v)
    scale = d_qk**-0.5
    native = causal_attention.causal_attention(q, k, v, cu, scale)
    sdpa = SdpaPrefillAttention().causal(q, k, v, cu, scale)
    exact = masked_softmax_reference(q, k, v, cu, scale)
    assert native.shape == (sum(lengths), heads, d_v) and native.dtype == torch.float32
    torch.testing.assert_close(native.double(), exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native, sdpa, rtol=1e-5, atol=1e-5)


def test_large_scores_and_threads() -> None:
    # Scores in the hundreds: the online softmax must rescale, not overflow; the first key
    # of every block can dominate. Two and three threads split the heads.
    q, k, v, cu = _inputs([300, 77], 6, 48, 32, seed=3, magnitude=4.0)
    scale = 48**-0.5
    exact = masked_softmax_reference(q, k, v, cu, scale)
    for threads in (1, 2, 3):
        out = causal_attention.causal_attention(q, k, v, cu, scale, threads=threads)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), exact, rtol=1e-4, atol=1e-4)


def test_strided_inputs_are_accepted() -> None:
    # Any layout with a contiguous last dimension is read in place (here a split() view of v).
    q, k, v, cu = _inputs([40], 4, 48, 64)
    v_view = v[..., :32]
    out = causal_attention.causal_attention(q, k, v_view, cu, 0.2)
    torch.testing.assert_close(
        out, SdpaPrefillAttention().causal(q, k, v_view.contiguous(), cu, 0.2)
    )


@pytest.mark.parametrize("threads", [1, 3])
def test_mla_parts_are_read_in_place(threads: int) -> None:
    # As MLAttention.expanded has them: q_nope / q_pe views of one projection, k_nope and v
    # strided views of the up-projected latent, k_pe one row per token for all heads.
    g = torch.Generator().manual_seed(5)
    heads, d_n, d_r, d_v, cu = 8, 32, 16, 24, [0, 37, 37, 187]
    total = cu[-1]
    q = torch.randn(total, heads, d_n + d_r, generator=g)
    kv = torch.randn(total, heads, d_n + d_v, generator=g)
    k_pe = torch.randn(total, d_r, generator=g)
    q_nope, q_pe = q.split([d_n, d_r], dim=-1)
    k_nope, v = kv.split([d_n, d_v], dim=-1)
    parts = causal_attention.causal_attention_mla(
        q_nope, q_pe, k_nope, k_pe, v, cu, 0.3, threads=threads
    )
    k = torch.cat((k_nope, k_pe[:, None].expand(-1, heads, -1)), dim=-1)
    joined = causal_attention.causal_attention(q, k, v.contiguous(), cu, 0.3, threads=threads)
    assert torch.equal(parts, joined)  # the same packed operands, the same arithmetic
    backend = NativePrefillAttention()
    assert torch.equal(backend.causal_mla(q_nope, q_pe, k_nope, k_pe, v, cu, 0.3), joined)
    # The default causal_mla (join, then `causal`) on the reference backend agrees too.
    sdpa = SdpaPrefillAttention().causal_mla(q_nope, q_pe, k_nope, k_pe, v, cu, 0.3)
    torch.testing.assert_close(parts, sdpa, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="k_pe \\[T, d_r\\]"):
        causal_attention.causal_attention_mla(q_nope, q_pe, k_nope, k_pe[:-1], v, cu, 0.3)
    with pytest.raises(ValueError, match="expected"):
        causal_attention.causal_attention_mla(q_nope, q_pe, k_nope, k_pe[:, None], v, cu, 0.3)


@pytest.mark.parametrize(
    "cu",
    [[0, 5], [1, 10], [0, 6, 4, 10], [], [0, 11]],
    ids=["short", "start", "falls", "empty", "long"],
)
def test_bad_sequence_bounds_are_refused(cu) -> None:
    q, k, v, _ = _inputs([10], 2, 8, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_attention.causal_attention(q, k, v, cu, 1.0)


def test_bad_shapes_and_dtypes_are_refused() -> None:
    q, k, v, cu = _inputs([10], 2, 8, 8)
    with pytest.raises(ValueError, match="expected"):
        causal_attention.causal_attention(q, k[:, :1], v, cu, 1.0)
    with pytest.raises(ValueError, match="fp32"):
        causal_attention.causal_attention(q.double(), k.double(), v.double(), cu, 1.0)


@pytest.mark.parametrize(
    ("queries", "keys", "offset"),
    [
        (9, 9, 0),  # causal and square: the whole-prompt case
        (5, 42, 37),  # a chunk over its past, one call
        (50, 130, 80),  # past one query block, keys past one key block
        (49, 20, 20),  # every key seen (a tile of the past)
        (3, 7, 1000),  # an offset far past the keys: no mask
        (60, 100, 40),  # fewer keys than the last query could see
    ],
)
def test_attention_over_keys_with_an_offset_and_its_log_sum_exp(queries, keys, offset) -> None:
    g = torch.Generator().manual_seed(queries * keys)
    heads, d_a, d_b, d_v = 3, 24, 8, 16
    q_a, q_b = torch.randn(queries, heads, d_a, generator=g), torch.randn(queries, heads, d_b)
    k_a, v = torch.randn(keys, heads, d_a, generator=g), torch.randn(keys, heads, d_v)
    k_b = torch.randn(keys, d_b, generator=g)  # shared by the heads, as MLA's k_pe
    scale = 0.2
    out, lse = causal_attention.attention_over_keys(q_a, q_b, k_a, k_b, v, offset, scale)
    q = torch.cat((q_a, q_b), -1).double().transpose(0, 1)
    k = torch.cat((k_a, k_b[:, None].expand(-1, heads, -1)), -1).double().transpose(0, 1)
    scores = scale * q @ k.transpose(1, 2)  # [H, Q, K]
    seen = torch.ones(queries, keys, dtype=torch.bool).tril(offset)
    scores = scores.masked_fill(~seen, -math.inf)
    want = (scores.softmax(-1) @ v.double().transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1).T, rtol=1e-5, atol=1e-5)


def test_attention_over_keys_refuses_rows_that_see_nothing() -> None:
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="offset"):
        causal_attention.attention_over_keys(q, q[..., :0], q, q[..., :0], q, -1, 1.0)
    with pytest.raises(ValueError, match="K > 0"):
        causal_attention.attention_over_keys(q, q[..., :0], q[:0], q[:0, :, :0], q[:0], 0, 1.0)

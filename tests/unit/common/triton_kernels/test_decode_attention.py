"""The Triton paged decode-attention kernel against its reference.

On a machine without CUDA the kernels run under Triton's interpreter. Triton builds its own
library for the interpreter only if TRITON_INTERPRET=1 is set when triton is first imported
(a process runs Triton interpreted or compiled, never both), which tests/conftest.py sees
to; the launcher reads the variable per call, which the `triton_interpret` fixture sets
during each test. With CUDA, the same cases run compiled on the GPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# tests/conftest.py imported triton in this machine's mode (the interpreter without CUDA).
pytest.importorskip("triton.language")

from common.model.tpla import absorbed_queries, latent_shards, latent_slice_attention  # noqa: E402
from common.parallel import ParallelConfig  # noqa: E402
from common.triton_kernels import decode_attention, triton_mode  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
# Kernel vs fp32 reference on the same (rounded) inputs: fp32 multiplies exactly in both; the
# 16-bit kernels round p to the cache dtype for the p.n product and u on the way out.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


pytestmark = pytest.mark.usefixtures("triton_interpret")


@dataclass
class Case:
    q: Tensor
    kv: Tensor
    block_ids: Tensor
    lengths: Tensor
    block_size: int
    rope_width: int

    def to(self, device: torch.device) -> Case:
        q, kv, ids, lens = (t.to(device) for t in (self.q, self.kv, self.block_ids, self.lengths))
        return Case(q, kv, ids, lens, self.block_size, self.rope_width)


def make_case(
    lengths: list[int],
    heads: int,
    width: int,
    rope: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int64,
    seed: int = 0,
) -> Case:
    """A pool with spare blocks, each sequence's blocks in shuffled pool order, and table
    entries past a sequence's blocks set to -1 (the kernel must never dereference them)."""
    g = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in lengths]
    width_blocks = max(max(needed), 1) + 1
    pool = sum(needed) + 3
    order = torch.randperm(pool, generator=g).tolist()
    block_ids = torch.full((len(lengths), width_blocks), -1, dtype=index_dtype)
    for b, count in enumerate(needed):
        block_ids[b, :count] = torch.tensor(order[:count], dtype=index_dtype)
        order = order[count:]
    kv = torch.randn(pool * block_size, width + rope, generator=g).to(dtype)
    # Scores of order a few units: a softmax neither flat nor one-hot.
    q = torch.randn(len(lengths), heads, width + rope, generator=g) * 2 / math.sqrt(width + rope)
    lens = torch.tensor(lengths)
    return Case(q.to(dtype), kv, block_ids, lens, block_size, rope).to(DEVICE)


def run_both(case: Case, num_splits: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    args = (case.q, case.kv, case.block_ids, case.lengths, case.block_size)
    u, lse = decode_attention.paged_decode_attention(*args, num_splits, rope_width=case.rope_width)
    ref_u, ref_lse = decode_attention.paged_decode_attention_reference(
        *args, rope_width=case.rope_width
    )
    return u, lse, ref_u, ref_lse


def assert_matches(case: Case, num_splits: int | None) -> None:
    u, lse, ref_u, ref_lse = run_both(case, num_splits)
    b, h, c = case.q.shape
    assert u.shape == (b, h, c - case.rope_width) and u.dtype == case.q.dtype
    assert lse.shape == (b, h) and lse.dtype == torch.float32
    assert torch.isfinite(u).all()
    empty = case.lengths == 0
    assert torch.equal(lse[empty], torch.full_like(lse[empty], float("-inf")))
    assert not u[empty].any()
    tol = TOLERANCE[case.q.dtype]
    torch.testing.assert_close(u.float(), ref_u.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=1e-4, rtol=1e-5)


# Lengths: empty, one token, mid-block ends, whole blocks, several blocks.
@pytest.mark.parametrize(
    ("heads", "width", "rope", "block_size", "dtype", "index_dtype", "splits", "lengths"),
    [
        (1, 512, 64, 16, torch.float32, torch.int64, 1, [0, 1, 23, 48]),  # V3 latent, MLA
        (16, 512, 64, 64, torch.bfloat16, torch.int32, 3, [1, 70, 130]),  # V3 at tp = 8
        (3, 256, 64, 64, torch.bfloat16, torch.int64, 4, [0, 1, 64, 100]),  # TPLA r = 2
        (128, 128, 64, 16, torch.bfloat16, torch.int64, 2, [5, 40]),  # TPLA r = 4, 128 heads
        (16, 128, 16, 16, torch.float16, torch.int32, 5, [1, 17, 31, 96]),  # demo MLA-TP
        (8, 64, 16, 64, torch.float32, torch.int32, None, [0, 63, 65, 190]),  # demo TPLA r=2
        (3, 32, 16, 16, torch.float16, torch.int64, 2, [2, 15, 16, 33]),  # demo TPLA r=4
        (128, 64, 16, 64, torch.float32, torch.int64, 1, [7, 64]),  # 128 heads, no split
    ],
)
def test_kernel_matches_reference(
    heads, width, rope, block_size, dtype, index_dtype, splits, lengths
) -> None:
    case = make_case(lengths, heads, width, rope, block_size, dtype, index_dtype)
    assert_matches(case, splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_counts_agree(dtype: torch.dtype) -> None:
    """1 split, several, and more splits than a short sequence has token tiles (its last
    splits hold no token and must weigh nothing)."""
    case = make_case([1, 9, 40, 150], 4, 64, 16, 16, dtype, seed=3)
    outputs = [run_both(case, s)[:2] for s in (1, 2, 6)]
    assert_matches(case, 6)
    tol = TOLERANCE[dtype]
    for u, lse in outputs[1:]:
        torch.testing.assert_close(u.float(), outputs[0][0].float(), atol=tol, rtol=tol)
        torch.testing.assert_close(lse, outputs[0][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("groups", [1, 2])
def test_equals_tpla_latent_slice_attention(groups: int) -> None:
    """Absorbed queries (scale and 1/beta folded in) + W_UV after the kernel give exactly what
    `latent_slice_attention` gives on the gathered slice: MLA at r = 1, a TPLA slice at r = 2."""
    g = torch.Generator().manual_seed(5)
    heads, d_c, d_r, d_n, d_v, block_size = 4, 128, 16, 32, 32, 16
    spectrum = torch.linspace(2.0, 0.5, d_c)
    shard = latent_shards(ParallelConfig(groups, groups).latent_slices(d_c), spectrum)[-1]
    case = make_case([1, 20, 53], heads, shard.width, d_r, block_size, seed=7)
    q_nope = torch.randn(3, heads, d_n, generator=g).to(DEVICE)
    q_pe = torch.randn(3, heads, d_r, generator=g).to(DEVICE)
    w_uk = torch.randn(heads, d_n, d_c, generator=g)[..., shard.start : shard.end].to(DEVICE)
    w_uv = torch.randn(heads, d_v, d_c, generator=g)[..., shard.start : shard.end].to(DEVICE)
    w_uk, w_uv = w_uk * 0.2, w_uv * 0.2
    scale = (d_n + d_r) ** -0.5
    q = absorbed_queries(q_nope, q_pe, w_uk, scale, shard.beta)
    u, _ = decode_attention.paged_decode_attention(
        q, case.kv, case.block_ids, case.lengths, block_size, 2, rope_width=d_r
    )
    out = torch.einsum("bhc,hvc->bhv", u, w_uv)

    pos = torch.arange(case.block_ids.shape[1] * block_size, device=DEVICE)
    valid = pos[None] < case.lengths[:, None]
    blocks = case.block_ids[:, pos // block_size].masked_fill(~valid, 0)
    rows = case.kv[blocks * block_size + pos % block_size]
    expected = latent_slice_attention(
        q_nope[:, None],
        q_pe[:, None],
        rows[..., : shard.width],
        rows[..., shard.width :],
        valid[:, None],
        w_uk,
        w_uv,
        scale,
        shard.beta,
    )[:, 0]
    assert groups == 1 or shard.beta != 1.0
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_lengths_past_the_table_are_clamped() -> None:
    case = make_case([10, 32], 2, 32, 16, 16, seed=2)
    full = case.block_ids.shape[1] * 16
    clamped = run_both(case, 2)[:2]
    case.lengths = torch.tensor([10, full + 50], device=DEVICE)
    case.block_ids[1] = case.block_ids[1].abs()  # every entry now a real block
    u, lse, ref_u, ref_lse = run_both(case, 2)
    torch.testing.assert_close(u, ref_u, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(u[0], clamped[0][0])


def _bad(case: Case, **change) -> dict:
    args = {
        "q": case.q,
        "kv": case.kv,
        "block_ids": case.block_ids,
        "lengths": case.lengths,
        "block_size": case.block_size,
        "rope_width": case.rope_width,
    }
    return {**args, **change}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c: {"block_ids": c.block_ids.float()}, "block_ids"),
        (lambda c: {"kv": c.kv[:, :-1]}, "columns"),
        (lambda c: {"kv": c.kv.half()}, "share"),
        (lambda c: {"q": c.q.to(torch.int32), "kv": c.kv.to(torch.int32)}, "share"),
        (lambda c: {"lengths": c.lengths[:1]}, "batch sizes"),
        (lambda c: {"lengths": c.lengths.float()}, "lengths"),
        (lambda c: {"q": c.q[0]}, r"\[B, H, W \+ R\]"),
        (lambda c: {"rope_width": c.q.shape[-1]}, "rope_width"),
        (lambda c: {"kv": c.kv[:-1]}, "whole blocks"),
        (lambda c: {"kv": c.kv.t().contiguous().t()}, "contiguous"),
    ],
)
def test_bad_inputs_raise_value_error(change, match: str) -> None:
    case = make_case([3, 20], 2, 32, 16, 16)
    bad = _bad(case, **change(case))
    with pytest.raises(ValueError, match=match):
        decode_attention.paged_decode_attention(**bad)
    with pytest.raises(ValueError, match=match):
        decode_attention.paged_decode_attention_reference(**bad)


def test_bad_split_count_and_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case([3, 20], 2, 32, 16, 16)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention.paged_decode_attention(**_bad(case), num_splits=0)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention.paged_decode_attention(
            **_bad(case), num_splits=decode_attention.MAX_GRID_Z + 1
        )
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert triton_mode.available() == torch.cuda.is_available()
    with pytest.raises(ValueError, match="CUDA"):
        decode_attention.paged_decode_attention(**_bad(case.to(torch.device("cpu"))))


def test_available_here() -> None:
    assert triton_mode.triton_installed() and triton_mode.available()
    assert triton_mode.interpreted_import() == (DEVICE.type == "cpu")


def test_choose_num_splits() -> None:
    # Short caches never split; a lone long sequence fills the SMs; a full batch does not split.
    assert decode_attention.choose_num_splits(1, 1, 255, 132) == 1
    assert decode_attention.choose_num_splits(1, 1, 32768, 132) == decode_attention.MAX_SPLITS
    assert decode_attention.choose_num_splits(4, 8, 4096, 132) == 9  # ceil(264 / 32)
    assert decode_attention.choose_num_splits(1, 1, 1024, 132) == 4  # at least 256 tokens a split
    assert decode_attention.choose_num_splits(256, 8, 65536, 132) == 1


def test_tiles_pad_to_dot_minimums() -> None:
    for heads, width, rope in [(1, 32, 16), (3, 64, 16), (128, 512, 64), (128, 128, 64)]:
        tiles = decode_attention.choose_tiles(heads, width, rope, torch.bfloat16)
        assert min(tiles.block_h, tiles.block_n, tiles.block_w, tiles.block_r) >= 16
        assert tiles.block_w >= width and tiles.block_r >= rope
        assert tiles.block_h * tiles.block_w <= decode_attention.ACC_ELEMENTS


def test_imports_and_reference_without_triton() -> None:
    """A machine without triton imports the module, reports it unavailable, still runs the
    reference, and gets a clear error (not an ImportError) from the kernel."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from common.triton_kernels import decode_attention, triton_mode\n"
        "assert not triton_mode.triton_installed() and not triton_mode.available()\n"
        "q, kv = torch.randn(1, 2, 48), torch.randn(32, 48)\n"
        "ids, lengths = torch.tensor([[1, 0]]), torch.tensor([20])\n"
        "u, lse = decode_attention.paged_decode_attention_reference(\n"
        "    q, kv, ids, lengths, 16, rope_width=16\n"
        ")\n"
        "assert u.shape == (1, 2, 32) and torch.isfinite(lse).all()\n"
        "try:\n"
        "    decode_attention.paged_decode_attention(q, kv, ids, lengths, 16, rope_width=16)\n"
        "except RuntimeError as e:\n"
        "    assert 'pip install triton' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]

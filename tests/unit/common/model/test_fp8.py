"""FP8-resident weights: dequantize-on-use equals the reader's dequantize-at-load for slices
that start and end inside blocks, rows taken per head, gate and up rows joined and experts
stacked; the workspace reuses one buffer per role and shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.loading.checkpoint import CheckpointReader
from common.loading.weights import ALL, CheckpointWeights
from common.model import fp8
from common.model.fp8 import Fp8Weight, RowRun, dense, share_workspace
from tests.shard_checkpoints import CONFIG, FP8_CONFIG, quantize, random_state, save_checkpoint

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    fp8, _ = quantize(random_state())
    return save_checkpoint(fp8, tmp_path_factory.mktemp("fp8"), quantization_config=FP8_CONFIG)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "cols"),
    [(ALL, ALL), (slice(40, 150), ALL), (ALL, slice(100, 192)), (slice(3, 131), slice(127, 129))],
)
def test_a_slice_dequantized_on_use_equals_dequantized_at_load(
    fp8_dir: Path, dtype: torch.dtype, rows: slice, cols: slice
) -> None:
    name = "model.layers.0.mlp.gate_proj.weight"  # [320, 192]: partial last blocks both ways
    src = CheckpointWeights(fp8_dir, dtype, keep_fp8=True)
    w = src.linear(name, rows, cols)
    assert isinstance(w, Fp8Weight) and w.values.dtype == torch.float8_e4m3fn
    want = CheckpointReader(fp8_dir).read(name, (rows, cols), dtype=dtype)
    assert torch.equal(w.dequantize(out=torch.empty_like(want)), want)
    assert torch.equal(dense(w), want)
    # The scales of exactly the blocks the slice overlaps.
    r0, r1, _ = rows.indices(320)
    c0, c1, _ = cols.indices(192)
    assert w.scale.shape == ((r1 - 1) // 128 - r0 // 128 + 1, (c1 - 1) // 128 - c0 // 128 + 1)


def test_heads_rows_experts_and_the_workspace(fp8_dir: Path) -> None:
    src = CheckpointWeights(fp8_dir, torch.float32, keep_fp8=True)
    plain = CheckpointWeights(fp8_dir, torch.float32)
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"  # [4 x (32 + 24), 256]
    w = src.linear(kv_b, slice(56, 224), slice(100, 256))  # heads 1..3, mid-block columns
    assert isinstance(w, Fp8Weight)
    uk = w.take_rows([(h * 56, h * 56 + 32) for h in range(3)], (3, 32, 156), "w_uk")
    want = plain.tensor(kv_b, slice(56, 224), slice(100, 256)).view(3, 56, 156)
    assert torch.equal(dense(uk), want[:, :32])
    assert uk.rows == (RowRun(32, 56, 0), RowRun(32, 112 % 128, 1), RowRun(32, 168 % 128, 3))
    prefix = "model.layers.1.mlp.experts"
    cols, experts = slice(50, 150), slice(1, 3)
    gate_up, down = src.gate_up(prefix, cols, experts), src.down(prefix, cols, experts)
    assert isinstance(gate_up, Fp8Weight) and isinstance(down, Fp8Weight)
    assert torch.equal(dense(gate_up), plain.gate_up(prefix, cols, experts))
    assert torch.equal(dense(down), plain.down(prefix, cols, experts))
    # One workspace: a role's buffer is reused by every weight of its role and shape.
    module = torch.nn.ModuleDict({"a": gate_up, "b": src.gate_up(prefix, cols, experts)})
    share_workspace(module)
    assert dense(module["a"]).data_ptr() == dense(module["b"]).data_ptr()
    assert dense(gate_up).data_ptr() != dense(down).data_ptr()


def test_only_e4m3_linear_weights_stay_fp8(fp8_dir: Path) -> None:
    src = CheckpointWeights(fp8_dir, torch.bfloat16, keep_fp8=True)
    assert isinstance(src.linear("model.layers.0.self_attn.o_proj.weight"), Fp8Weight)
    assert src.tensor("model.layers.0.self_attn.o_proj.weight").dtype == torch.bfloat16
    embed = src.linear("model.embed_tokens.weight")  # stored unquantized
    assert isinstance(embed, torch.Tensor) and embed.dtype == torch.bfloat16
    assert CONFIG["hidden_size"] == 192


@pytest.mark.parametrize("chunk_rows", [1, 7, 128, 1000])
def test_a_linear_dequantizes_a_bounded_run_of_rows_at_a_time(
    fp8_dir: Path, monkeypatch: pytest.MonkeyPatch, chunk_rows: int
) -> None:
    """`forward` without an FP8 GEMM: the rows through one buffer of LINEAR_CHUNK_BYTES shared
    by every linear (rows from inside a block, gate then up rows), equal to the linear of the
    weight dequantized whole."""
    src = CheckpointWeights(fp8_dir, torch.float32, keep_fp8=True)
    plain = CheckpointWeights(fp8_dir, torch.float32)
    gate = "model.layers.0.mlp.gate_proj.weight"  # [320, 192]
    down = "model.layers.0.mlp.down_proj.weight"  # [192, 320]
    model = torch.nn.ModuleDict(
        {"gate": src.linear(gate, slice(40, 300)), "down": src.linear(down, cols=slice(100, 320))}
    )
    workspace = share_workspace(model)
    monkeypatch.setattr(fp8, "LINEAR_CHUNK_BYTES", chunk_rows * 220 * 4)  # rows of `down`
    x = torch.randn(3, 192)
    got_gate = model["gate"](x)
    want_gate = torch.nn.functional.linear(x, plain.tensor(gate, slice(40, 300)))
    torch.testing.assert_close(got_gate, want_gate, atol=1e-6, rtol=1e-6)
    y = torch.randn(2, 5, 220)
    want_down = torch.nn.functional.linear(y, plain.tensor(down, cols=slice(100, 320)))
    torch.testing.assert_close(model["down"](y), want_down, atol=1e-6, rtol=1e-6)
    # One buffer for both linears' rows, bounded; no role's whole weight.
    keys = [k for k in workspace._buffers if k[0] not in ("rows", "cols")]
    assert keys == [(fp8.LINEAR_ROLE, (max(chunk_rows * 220, 192),), torch.float32, x.device)]

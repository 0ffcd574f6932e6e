"""The scaled_mm path's CPU half: the activation quantizer against a per-group loop, each
weight's scales as scaled_mm reads them (emulated: they give back exactly the dequantized
weight), and the per-weight choice with its reasons. The GEMM itself runs in tests/gpu."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common.loading.serving_model import load_serving_model
from common.loading.weights import ALL, CheckpointWeights
from common.model import fp8_gemm
from common.model.fp8 import Fp8Weight, dense, linear
from common.model.fp8_gemm import (
    ScaledGemm,
    assign_gemms,
    quantize_groups,
    select_fp8_gemm,
    unsupported,
    weight_scales,
)
from common.runtime.kernel_choice import KernelUnavailable
from tests.shard_checkpoints import FP8_CONFIG, quantize, random_state, save_checkpoint


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    fp8, _ = quantize(random_state())
    return save_checkpoint(fp8, tmp_path_factory.mktemp("fp8"), quantization_config=FP8_CONFIG)


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's act_quant, one row and one 128-column group at a time."""
    m, k = x.shape
    values = torch.empty(m, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(m, math.ceil(k / 128))
    for i in range(m):
        for g in range(scales.shape[1]):
            part = x[i, g * 128 : (g + 1) * 128].float()
            s = max(part.abs().max().item(), 1e-12) / 448.0
            scales[i, g] = s
            values[i, g * 128 : (g + 1) * 128] = (
                (part / scales[i, g]).clamp(-448, 448).to(torch.float8_e4m3fn)
            )
    return values, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "rows"), [(3, 192, 16), (16, 256, 16), (1, 48, 32)])
def test_the_activation_quantizer_equals_the_loop(
    dtype: torch.dtype, m: int, k: int, rows: int
) -> None:
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3).to(dtype)
    x[0, :16] = 0  # a partly zero group; a whole zero group is the padded rows'
    values, scales = quantize_groups(x, rows)
    want_values, want_scales = reference_quantize(x)
    groups = math.ceil(k / 128)
    assert values.shape == (rows, k) and values.is_contiguous()
    # Column-major; torch (like scaled_mm's check) gives a single column a stride of 1.
    assert scales.shape == (rows, groups) and scales.stride() == (1, rows if groups > 1 else 1)
    assert torch.equal(values[:m].view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales[:m], want_scales)
    assert not values[m:].float().any() and torch.isfinite(scales).all()
    # values * scale is x within e4m3's half-ulp (2^-4 relative) of each group's amax.
    back = values[:m].float() * scales[:m].repeat_interleave(128, dim=1)[:, :k]
    bound = scales[:m].repeat_interleave(128, dim=1)[:, :k] * 448 * 2**-4
    assert ((back - x.float()).abs() <= bound).all()


def emulated_weight(gemm: ScaledGemm, w: Fp8Weight) -> torch.Tensor:
    """W [N, K] as scaled_mm reads it: the values times the scale its recipe assigns to each."""
    n, k = w.values.shape
    s = gemm.weight_scale
    if gemm.recipe == "128x128":
        assert s.stride() == (1, s.shape[0]) and s.shape[0] % 4 == 0
        full = s.t().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    else:
        assert s.shape == (n, math.ceil(k / 128)) and s.stride(0) == 1
        assert s.shape[1] == 1 or s.stride(1) == n
        full = s.repeat_interleave(128, 1)[:, :k]
    return (w.values.double() * full.double()).float()


@pytest.mark.parametrize(
    ("name", "rows", "cols", "recipe"),
    [
        ("mlp.gate_proj", ALL, ALL, "128x128"),  # [320, 192]: partial last blocks both ways
        ("mlp.down_proj", ALL, ALL, "128x128"),  # K = 320: 3 groups, round_up(3, 4) = 4
        ("mlp.gate_proj", slice(160, 320), ALL, "1x128"),  # rows from mid-block (tp = 2)
        ("mlp.gate_proj", slice(48, 112), ALL, "128x128"),  # inside one block: it lines up
        ("self_attn.q_b_proj", slice(96, 192), slice(0, 160), "1x128"),
        ("self_attn.o_proj", ALL, slice(32, 96), "1x128"),  # columns inside one block
        ("self_attn.kv_b_proj", ALL, slice(128, 256), "128x128"),  # a TPLA latent slice
    ],
)
def test_the_weight_scales_give_back_the_dequantized_weight(
    fp8_dir: Path, name: str, rows: slice, cols: slice, recipe: str
) -> None:
    src = CheckpointWeights(fp8_dir, torch.float32, keep_fp8=True)
    w = src.linear(f"model.layers.0.{name}.weight", rows, cols)
    assert isinstance(w, Fp8Weight)
    layout = weight_scales(w)
    assert not isinstance(layout, str), layout
    assert layout[1] == recipe
    assert torch.equal(emulated_weight(ScaledGemm(*layout, w.dtype), w), dense(w))


def test_gate_and_up_rows_joined_use_per_row_scales(fp8_dir: Path) -> None:
    src = CheckpointWeights(fp8_dir, torch.float32, keep_fp8=True)
    prefix = "model.layers.1.mlp.experts"
    gate_up = src.gate_up(prefix, slice(0, 96), slice(1, 2))
    assert isinstance(gate_up, Fp8Weight)
    assert "stacked experts" in str(weight_scales(gate_up))  # the grouped GEMM dequantizes
    kv_b = src.linear("model.layers.1.self_attn.kv_b_proj.weight", slice(56, 224))
    assert isinstance(kv_b, Fp8Weight)
    uk = kv_b.take_rows([(h * 56, h * 56 + 32) for h in range(3)], (3, 32, 256), "w_uk")
    assert "W_UK" in str(weight_scales(uk))
    # Two row runs, each from mid-block: one scale per row still gives W back exactly.
    two = kv_b.take_rows([(0, 32), (56, 88)], (64, 256), "rows")
    layout = weight_scales(two)
    assert not isinstance(layout, str) and layout[1] == "1x128"
    assert torch.equal(emulated_weight(ScaledGemm(*layout, two.dtype), two), dense(two))


@pytest.mark.parametrize(
    ("name", "rows", "cols", "why"),
    [
        ("mlp.down_proj", ALL, slice(160, 320), "straddle"),  # from 32 into a block, 160 wide
        ("self_attn.q_b_proj", ALL, slice(96, 160), "straddle"),  # 64 wide, across an edge
        ("mlp.gate_proj", slice(0, 40), ALL, "multiples of 16"),
        ("mlp.gate_proj", ALL, slice(0, 100), "multiples of 16"),
    ],
)
def test_a_slice_the_recipe_cannot_express_says_why(
    fp8_dir: Path, name: str, rows: slice, cols: slice, why: str
) -> None:
    src = CheckpointWeights(fp8_dir, torch.float32, keep_fp8=True)
    w = src.linear(f"model.layers.0.{name}.weight", rows, cols)
    assert isinstance(w, Fp8Weight)
    layout = weight_scales(w)
    assert isinstance(layout, str) and why in layout


def test_the_choice_per_weight_and_per_device(
    fp8_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = CheckpointWeights(fp8_dir, torch.float32, keep_fp8=True)
    model = torch.nn.ModuleDict(
        {
            "whole": src.linear("model.layers.0.mlp.gate_proj.weight"),
            "mid_rows": src.linear("model.layers.0.mlp.up_proj.weight", slice(160, 320)),
            "straddles": src.linear("model.layers.0.mlp.down_proj.weight", cols=slice(160, 320)),
        }
    )
    cpu = torch.device("cpu")
    assert unsupported(cpu) is not None
    auto = select_fp8_gemm("auto", cpu)  # the CPU: dequantize, with the reason
    assert auto.kernel == "dequantize"
    assert [(name, why.split(":")[0]) for name, why in auto.passed_over] == [
        ("scaled_mm", "cpu device")
    ]
    chosen = assign_gemms(model, auto.kernel)
    assert set(chosen.values()) == {"dequantize: dequantize was chosen"}
    assert all(w.gemm is None for w in model.values())
    # Named where the device cannot run it: the start-up stops, naming the setting.
    with pytest.raises(KernelUnavailable, match="TPLA_FP8_GEMM=scaled_mm: cpu device"):
        select_fp8_gemm("scaled_mm", cpu)
    with pytest.raises(ValueError, match="TPLA_FP8_GEMM=fp8: not one of"):
        select_fp8_gemm("fp8", cpu)
    # A device that runs the recipe: each weight by its own slice.
    monkeypatch.setattr(fp8_gemm, "unsupported", lambda device: None)
    assert select_fp8_gemm("auto", cpu).kernel == "scaled_mm"
    chosen = assign_gemms(model, "scaled_mm")
    assert chosen["whole"] == "scaled_mm (128x128)"
    assert chosen["mid_rows"] == "scaled_mm (1x128)"
    assert chosen["straddles"].startswith("dequantize: columns from 32")
    assert isinstance(model["whole"].gemm, ScaledGemm) and model["straddles"].gemm is None
    # The derived scales stay out of the state dict (the checkpoint's names only).
    assert all("weight_scale" not in k for k in model.state_dict())
    chosen = assign_gemms(model, "dequantize")
    assert set(chosen.values()) == {"dequantize: dequantize was chosen"}
    assert all(w.gemm is None for w in model.values())


def test_linear_applies_either_kind_of_weight(fp8_dir: Path) -> None:
    src = CheckpointWeights(fp8_dir, torch.float32, keep_fp8=True)
    w = src.linear("model.layers.0.mlp.gate_proj.weight")
    x = torch.randn(5, 192)
    assert isinstance(w, Fp8Weight) and w.gemm is None
    want = torch.nn.functional.linear(x, dense(w).clone())
    assert torch.equal(linear(x, w), want)
    assert torch.equal(linear(x, dense(w).clone()), want)


class _Recorded(torch.nn.Module):
    """A stand-in GEMM that records what it was called with."""

    def forward(self, x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self.called = (x, values)
        return torch.zeros(*x.shape[:-1], values.shape[0])


def test_a_weight_with_a_gemm_is_applied_by_it(fp8_dir: Path) -> None:
    src = CheckpointWeights(fp8_dir, torch.float32, keep_fp8=True)
    w = src.linear("model.layers.0.mlp.gate_proj.weight")
    assert isinstance(w, Fp8Weight)
    w.gemm = _Recorded()
    x = torch.randn(2, 3, 192)
    assert linear(x, w).shape == (2, 3, 320) and w(x).shape == (2, 3, 320)
    got_x, got_values = w.gemm.called
    assert got_x is x and got_values is w.values  # the stored e4m3 values, never dequantized


def test_the_full_model_applies_each_chosen_weight_by_its_gemm(
    fp8_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every weight given a GEMM is applied through it (the query projections included), here
    emulated on the CPU: the same quantized activation times the weight scaled_mm reads."""
    used: set[int] = set()

    def emulated(self: ScaledGemm, x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        used.add(id(self))
        k = values.shape[1]
        q, s = quantize_groups(x.reshape(-1, k))
        xq = q.float() * s.repeat_interleave(128, dim=1)[:, :k]
        weight = next(w for w in model.modules() if isinstance(w, Fp8Weight) and w.gemm is self)
        out = xq @ emulated_weight(self, weight).T
        return out.to(self.dtype).view(*x.shape[:-1], -1)

    monkeypatch.setattr(fp8_gemm, "unsupported", lambda device: None)
    monkeypatch.setattr(ScaledGemm, "forward", emulated)
    model = load_serving_model(fp8_dir, None, "float32", "cpu", "float8")[0]
    ids = torch.tensor([5, 17, 42, 7, 99, 3])
    with torch.inference_mode():
        want = model(ids, [len(ids)]).logits
        chosen = assign_gemms(model, select_fp8_gemm("auto", torch.device("cpu")).kernel)
        got = model(ids, [len(ids)]).logits
    gemms = {id(w.gemm) for w in model.modules() if isinstance(w, Fp8Weight) and w.gemm}
    names = [n for n, how in chosen.items() if how.startswith("scaled_mm")]
    assert any("q_a_proj" in n for n in names) and any("o_proj" in n for n in names)
    kv_b = chosen["model.layers.0.self_attn.kv_b_proj"]
    assert kv_b == "dequantize: MLAttention reads it as a tensor"
    assert used == gemms
    assert (got - want).norm() <= 0.1 * want.norm()


@pytest.mark.usefixtures("triton_interpret")
def test_the_triton_gemm_applies_each_weight_it_can_read(fp8_dir: Path) -> None:
    """TPLA_FP8_GEMM=triton (Triton's interpreter here): rows from anywhere, columns from a
    block edge; within 5% of dequantize-on-use (one activation quantized to e4m3) and equal
    to the same quantized activation times the dequantized weight in fp32."""
    pytest.importorskip("triton.language")
    src = CheckpointWeights(fp8_dir, torch.float32, keep_fp8=True)
    model = torch.nn.ModuleDict(
        {
            "whole": src.linear("model.layers.0.mlp.gate_proj.weight"),
            "mid_rows": src.linear("model.layers.0.mlp.up_proj.weight", slice(100, 320)),
            "narrow": src.linear("model.layers.0.mlp.gate_proj.weight", slice(0, 40), ALL),
            "straddles": src.linear("model.layers.0.mlp.down_proj.weight", cols=slice(160, 320)),
        }
    )
    cpu = torch.device("cpu")
    assert select_fp8_gemm("triton", cpu).kernel == "triton"
    assert select_fp8_gemm("auto", cpu).kernel == "dequantize"  # never the interpreter
    chosen = assign_gemms(model, "triton")
    assert chosen["whole"] == chosen["mid_rows"] == chosen["narrow"] == "triton"
    assert chosen["straddles"].startswith("dequantize: columns from 32 into a 128-wide block")
    g = torch.Generator().manual_seed(4)
    for name in ("whole", "mid_rows", "narrow"):
        w = model[name]
        x = torch.randn(2, 3, w.shape[1], generator=g)
        got = w(x)
        want = torch.nn.functional.linear(x, dense(w).clone())
        assert got.shape == want.shape
        assert (got - want).norm() <= 0.05 * want.norm()
        q, s = quantize_groups(x.reshape(6, -1))
        k = x.shape[-1]
        xq = q.float() * s.repeat_interleave(128, dim=1)[:, :k]
        exact = (xq @ dense(w).T).view_as(want)
        assert (got - exact).abs().max() <= 1e-5 * exact.abs().max()

"""FP8 weights by scaled_mm on sm_90 against dequantize-on-use (run by `pytest -m gpu`; skips
without CUDA or where torch cannot run the 1x128 / 128x128 recipe).

The two paths are not bit-equal, by design: scaled_mm quantizes the activation to e4m3 (3
mantissa bits) per 1x128 group, a relative error of up to 2^-4 per element (about 2.6% of a
Gaussian activation's norm), which dequantize-on-use does not have. So each GEMM is held to
two bounds: against the same quantized activation multiplied in fp32 (exact but for the
accumulation order and the output rounding: 1% of the output's largest magnitude), and
against dequantize-on-use within 5% (relative Frobenius norm). A model's greedy tokens are
equal wherever the reference's top-1 margin exceeds twice the largest logit difference at that
step; where a free-running decode first differs, the margin there is within that bound.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from common.loading.serving_model import load_serving_model
from common.loading.weights import ALL, CheckpointWeights
from common.model.fp8 import Fp8Weight, dense
from common.model.fp8_gemm import assign_gemms, quantize_groups, select_fp8_gemm, unsupported
from common.model.generate import generate
from common.sampling.params import SamplingParams
from tests.shard_checkpoints import FP8_CONFIG, per_expert, quantize, random_state, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    return unsupported(torch.device("cuda"))


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_why_not() is not None, reason=str(_why_not())),
]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    fp8, _ = quantize(random_state())
    return save_checkpoint(fp8, tmp_path_factory.mktemp("fp8"), quantization_config=FP8_CONFIG)


# (weight of layer 0, rows, cols, the recipe its slice gets): partial last blocks both ways,
# rows from mid-block (a tp = 2 slice), two row blocks' worth of a TPLA latent column slice.
CASES = [
    ("mlp.gate_proj", ALL, ALL, "128x128"),
    ("mlp.down_proj", ALL, ALL, "128x128"),
    ("mlp.up_proj", slice(160, 320), ALL, "1x128"),
    ("self_attn.q_b_proj", slice(96, 192), ALL, "1x128"),
    ("self_attn.kv_b_proj", ALL, slice(128, 256), "128x128"),
    ("self_attn.o_proj", ALL, slice(32, 96), "1x128"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("name", "rows", "cols", "recipe"), CASES)
def test_scaled_mm_against_dequantize_on_use(
    fp8_dir: Path, dtype: torch.dtype, name: str, rows: slice, cols: slice, recipe: str
) -> None:
    src = CheckpointWeights(fp8_dir, dtype, "cuda", keep_fp8=True)
    w = src.linear(f"model.layers.0.{name}.weight", rows, cols)
    assert isinstance(w, Fp8Weight)
    chosen = assign_gemms(torch.nn.ModuleDict({"w": w}), "scaled_mm")
    assert chosen == {"w": f"scaled_mm ({recipe})"}
    n, k = w.values.shape
    gen = torch.Generator("cuda").manual_seed(n + k)
    for shape in [(1, k), (7, k), (40, k), (2, 3, k)]:  # decode steps, a prefill, batched
        x = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
        got = w(x)
        assert got.shape == (*shape[:-1], n) and got.dtype == dtype
        want = F.linear(x, dense(w)).float()
        values, scales = quantize_groups(x.reshape(-1, k))
        xq = values.float() * scales.repeat_interleave(128, dim=1)[:, :k]
        same_input = (xq @ dense(w).float().T).view(*shape[:-1], n)
        limit = 1e-2 * same_input.abs().max()
        assert (got.float() - same_input).abs().max() <= limit, (shape, name)
        assert (got.float() - want).norm() <= 0.05 * want.norm(), (shape, name)


def test_no_host_sync_and_a_cuda_graph_replays_it(fp8_dir: Path) -> None:
    src = CheckpointWeights(fp8_dir, torch.bfloat16, "cuda", keep_fp8=True)
    w = src.linear("model.layers.0.mlp.up_proj.weight", slice(160, 320))
    assert isinstance(w, Fp8Weight)
    assign_gemms(torch.nn.ModuleDict({"w": w}), "scaled_mm")
    x = torch.randn(8, 192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up torch asks for before a capture
        w(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w(x)
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(out, w(fresh))


@pytest.fixture(scope="module")
def demo_fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained demo model as a DeepSeek FP8 block checkpoint: a random model's logits are
    too flat for its greedy tokens to say anything."""
    src = ROOT / "models" / "demo"
    state = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    per_expert(state)
    fp8, _ = quantize(state)
    path = tmp_path_factory.mktemp("demo-fp8")
    save_file({k: v.contiguous() for k, v in fp8.items()}, str(path / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}))
    return path


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@torch.inference_mode()
def test_greedy_decode_on_both_paths(demo_fp8: Path, dtype: str) -> None:
    model = load_serving_model(demo_fp8, None, dtype, "cuda", "float8")[0]
    prompt = [int(t) for t in torch.randint(2, 6144, (16,), generator=torch.Generator())]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert select_fp8_gemm("auto", torch.device("cuda")).kernel == "scaled_mm"
    chosen = assign_gemms(model, "scaled_mm")
    assert sum(v.startswith("scaled_mm") for v in chosen.values()) > 0, chosen
    got = generate(model, prompt, params).token_ids
    seq = torch.tensor(prompt + got[:-1], device="cuda")
    # Absorbed, as the decode steps are, to hold the free-running tokens to these logits.
    mm = model(seq, [len(seq)], all_logits=True, absorbed=True).logits.float()
    assign_gemms(model, "dequantize")
    want = generate(model, prompt, params).token_ids
    ref = model(seq, [len(seq)], all_logits=True, absorbed=True).logits.float()
    assert (mm - ref).norm() <= 0.05 * ref.norm()
    err = (mm - ref).abs().amax(dim=-1)
    top = ref.topk(2, dim=-1).values
    margin = top[:, 0] - top[:, 1]
    decisive = margin > 2 * err
    assert decisive.any()
    assert torch.equal(mm.argmax(-1)[decisive], ref.argmax(-1)[decisive])
    # Free-running: the same tokens up to the first step whose margin is within the bound.
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    if first is not None:
        step = len(prompt) - 1 + first
        assert not decisive[step], (first, margin[step].item(), err[step].item())
    assert math.isfinite(mm.sum().item())

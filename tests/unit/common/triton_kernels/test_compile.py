"""Both Triton decode-attention kernels compile ahead of time for sm_80 and sm_90 at every
shape the engine launches, on a machine without a GPU (the triton wheel ships ptxas).

The compiles run in a subprocess without TRITON_INTERPRET: a process runs Triton either
interpreted or compiled, and this test session may have imported triton for the interpreter
(tests/unit/common/triton_kernels/test_decode_attention.py). Triton caches the binaries in
~/.triton; nothing is written to the repository. `pytest -s` prints the resource table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.model.args import ModelConfig

ROOT = Path(__file__).resolve().parents[4]
ARCHS = (80, 90)
BLOCK_SIZES = (16, 64)

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="triton is not installed"
    ),
    pytest.mark.slow,  # every compile of both kernels: about a minute and a half on two cores
]


def launch_shapes() -> list[tuple[str, int, int, int, str]]:
    """(label, heads per rank, latent width W, rope width R, dtype) the engine launches."""
    shapes: list[tuple[str, int, int, int, str]] = []
    # DeepSeek-V3: 128 heads, d_c 512, d_r 64. MLA-TP splits the heads over tp ranks; TPLA
    # at r latent groups gives each rank d_c / r columns and the tp / r-th of the heads.
    for tp in (1, 2, 4, 8):
        shapes.append((f"v3 mla-tp tp={tp}", 128 // tp, 512, 64, "bf16"))
    for r, tp in ((2, 2), (2, 4), (2, 8), (4, 4), (4, 8)):
        shapes.append((f"v3 tpla r={r} tp={tp}", 128 * r // tp, 512 // r, 64, "bf16"))
    shapes.append(("v2-lite tp=1", 16, 512, 64, "bf16"))
    shapes.append(("v2-lite tpla r=2 tp=2", 16, 256, 64, "bf16"))
    demo = ModelConfig.from_dir(ROOT / "models" / "demo")
    heads, d_c, d_r = demo.num_attention_heads, demo.kv_lora_rank, demo.qk_rope_head_dim
    for dtype in ("bf16", "fp32"):
        shapes.append(("demo mla-tp tp=2", heads // 2, d_c, d_r, dtype))
        shapes.append(("demo tpla r=2 tp=2", heads, d_c // 2, d_r, dtype))
    return shapes


# Runs in the subprocess: argv[1] is the JSON list of (arch, heads, W, R, block, dtype).
_COMPILE = """
import json, sys
from dataclasses import asdict
import torch
try:
    from triton.backends.nvidia.compiler import get_ptxas
    for arch in (80, 90):
        get_ptxas(arch).path
except Exception as e:
    print(json.dumps({"skip": f"triton's ptxas is not available: {e}"}))
    sys.exit(0)
from common.triton_kernels.compile import compile_for
dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
rows = []
for arch, heads, width, rope, block, dtype in json.loads(sys.argv[1]):
    infos = compile_for(arch, heads, width, rope, block, dtypes[dtype])
    rows.append([asdict(info) for info in infos])
print(json.dumps({"rows": rows}))
"""


def test_kernels_compile_for_sm80_and_sm90() -> None:
    shapes = launch_shapes()
    cells = [
        (label, arch, heads, width, rope, block, dtype)
        for label, heads, width, rope, dtype in shapes
        for arch in ARCHS
        for block in BLOCK_SIZES
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps([c[1:] for c in cells])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    assert len(result["rows"]) == len(cells)
    lines = [
        f"{'shape':22} {'dtype':5} {'arch':>4} {'blk':>3} {'kernel':21} {'warps':>5} "
        f"{'regs':>4} {'spill st/ld':>11} {'stack':>5} {'shared':>7} {'tensor cores':>12}"
    ]
    for (label, arch, _, _, _, block, dtype), infos in zip(cells, result["rows"], strict=True):
        assert [info["name"] for info in infos] == ["_split_kv_kernel", "_merge_splits_kernel"]
        for info in infos:
            assert info["arch"] == arch
            # An sm_80 / sm_90 thread has at most 255 registers; Triton's shared memory must
            # fit the smaller of the two (A100: 163 KB per block).
            assert 0 < info["registers"] <= 255
            assert 0 <= info["shared"] <= 163 * 1024
            if info["name"] == "_split_kv_kernel" and dtype == "bf16":
                assert info["tensor_cores"] != "none"  # 16-bit tiles must reach the MMA units
            lines.append(
                f"{label:22} {dtype:5} {arch:>4} {block:>3} {info['name']:21} "
                f"{info['num_warps']:>5} {info['registers']:>4} "
                f"{info['spill_stores']:>5}/{info['spill_loads']:<5} {info['stack_frame']:>5} "
                f"{info['shared']:>7} {info['tensor_cores']:>12}"
            )
    print("\n" + "\n".join(lines))

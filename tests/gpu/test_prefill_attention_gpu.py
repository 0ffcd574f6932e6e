"""A forced flash-attn prefill in bf16 on the demo model (MLA: v narrower than q and k)
against SDPA's (skips where flash_attn is not installed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from common.loading.serving_model import load_prefill_model
from common.runtime.kernel_choice import KernelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("flash_attn") is None, reason="flash_attn is not installed"
    ),
]

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


def test_a_flash_attn_prefill_in_bf16_matches_sdpa() -> None:
    flash = load_prefill_model(
        DEMO, None, "bfloat16", KernelConfig(prefill_attention="flash-attn"), "cuda"
    )
    sdpa = load_prefill_model(
        DEMO, None, "bfloat16", KernelConfig(prefill_attention="sdpa"), "cuda"
    )
    assert flash.prefill_attention.name == "flash-attn"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, flash.config.vocab_size, (90,), generator=g).cuda()
    with torch.no_grad():
        a = flash.prefill(ids, [50, 1, 39], all_logits=True)
        b = sdpa.prefill(ids, [50, 1, 39], all_logits=True)
    scale = b.logits.float().abs().amax()
    torch.testing.assert_close(a.logits.float(), b.logits.float(), atol=3e-2 * scale, rtol=0)
    agree = (a.logits.argmax(-1) == b.logits.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"top-1 agrees at {agree:.0%} of the positions"

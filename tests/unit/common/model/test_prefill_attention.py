"""The prefill attention backends (common/model/prefill_attention): selection, the native backend's
fallback to SDPA, the same prefill model on both, and flash-attn's selection and MLA shapes
(through a stand-in package with flash-attn's interface and its equal-head-dim rule)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator

import pytest
import torch

from common.model.prefill_attention import (
    FlashPrefillAttention,
    NativePrefillAttention,
    SdpaPrefillAttention,
    make_prefill_attention,
    select_prefill_attention,
)
from common.native import causal_attention
from common.runtime.kernel_choice import KernelConfig, KernelUnavailable
from tests.unit.common.native.test_causal_attention import _inputs, masked_softmax_reference

needs_native = pytest.mark.skipif(
    not causal_attention.available(), reason="no C++ compiler for the kernel"
)

# flash-attn 2's varlen interface and its rules that matter here: one head dim for q, k and v,
# fp16 / bf16 only. The arithmetic is SDPA's, so only the backend's own logic is under test.
FLASH_STAND_IN = """
import torch
import torch.nn.functional as F


def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "flash-attn: one head dim for q, k, v"
    assert q.dtype in (torch.float16, torch.bfloat16), "flash-attn: fp16 and bf16 only"
    assert cu_q.dtype == torch.int32 and causal
    out = torch.empty_like(q)
    bounds = cu_q.tolist()
    for s, e in zip(bounds, bounds[1:]):
        qs, ks, vs = (t[None, s:e].transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=softmax_scale)
        out[s:e] = o[0].transpose(0, 1)
    return out
"""


@pytest.fixture
def flash_stand_in(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A flash_attn package on the path and CUDA reported present (selection only asks)."""
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text(FLASH_STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield
    sys.modules.pop("flash_attn", None)  # imported by the backend: gone with its folder


def test_auto_never_picks_flash_attn_for_fp32(flash_stand_in: None) -> None:
    assert select_prefill_attention("auto", "cuda", torch.bfloat16).kernel == "flash-attn"
    assert select_prefill_attention("auto", "cuda", torch.float16).kernel == "flash-attn"
    fp32 = select_prefill_attention("auto", "cuda", torch.float32)
    assert fp32.kernel == "sdpa"
    assert [name for name, _ in fp32.passed_over] == ["flash-attn", "native"]
    assert "flash-attn cannot run here: flash-attn runs fp16 and bf16" in fp32.describe()
    with pytest.raises(
        KernelUnavailable, match=r"TPLA_ATTENTION_BACKEND=flash-attn: .*fp16 and bf16"
    ):
        select_prefill_attention("flash-attn", "cuda", torch.float32)
    # Installed, but asked for on the CPU: it runs on CUDA only.
    with pytest.raises(KernelUnavailable, match=r"TPLA_ATTENTION_BACKEND=flash-attn: .*CUDA"):
        select_prefill_attention("flash-attn", "cpu", torch.bfloat16)


def test_flash_attn_takes_mla_head_dims(flash_stand_in: None) -> None:
    """MLA's v (128) is narrower than q and k (192): padded for flash-attn, sliced back."""
    q, k, v, cu = _inputs([9, 1, 14], 2, 192, 128)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    choice = select_prefill_attention("flash-attn", "cuda", torch.bfloat16)
    flash = make_prefill_attention(choice.kernel)
    assert isinstance(flash, FlashPrefillAttention)
    got = flash.causal(q, k, v, cu, 0.1)
    assert got.shape == v.shape
    torch.testing.assert_close(got, SdpaPrefillAttention().causal(q, k, v, cu, 0.1))
    with pytest.raises(ValueError, match="fp16 and bf16"):
        flash.causal(q.float(), k.float(), v.float(), cu, 0.1)


def test_a_forced_flash_attn_without_the_package_says_so() -> None:
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    with pytest.raises(
        KernelUnavailable,
        match="TPLA_ATTENTION_BACKEND=flash-attn: the flash_attn package is not installed",
    ):
        select_prefill_attention("flash-attn", "cuda", torch.bfloat16)


@needs_native
def test_backend_selection_and_fallback() -> None:
    fp32, bf16 = torch.float32, torch.bfloat16
    auto = select_prefill_attention("auto", "cpu", fp32)
    assert auto.kernel == "native" and [n for n, _ in auto.passed_over] == ["flash-attn"]
    for name in ("native", "sdpa"):
        choice = select_prefill_attention(name, "cpu", fp32)
        assert choice.kernel == name and make_prefill_attention(name).name == name
    # The kernel runs fp32 only: auto takes SDPA for a bf16 model, asking for it is an error.
    assert select_prefill_attention("auto", "cpu", bf16).kernel == "sdpa"
    with pytest.raises(KernelUnavailable, match=r"TPLA_ATTENTION_BACKEND=native: .*fp32"):
        select_prefill_attention("native", "cpu", bf16)
    with pytest.raises(ValueError, match="TPLA_ATTENTION_BACKEND=fast: not one of auto, sdpa"):
        select_prefill_attention("fast", "cpu", fp32)
    backend = NativePrefillAttention()
    q, k, v, cu = _inputs([12, 7], 2, 16, 8)
    # fp64 is outside the kernel's domain: the backend hands it to SDPA.
    out64 = backend.causal(q.double(), k.double(), v.double(), cu, 0.25)
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64, masked_softmax_reference(q, k, v, cu, 0.25))
    # Under autograd too (the kernel has no backward).
    qg = q.clone().requires_grad_()
    backend.causal(qg, k, v, cu, 0.25).sum().backward()
    assert qg.grad is not None


@needs_native
def test_the_prefill_model_is_the_same_on_both_backends(tmp_path) -> None:
    from common.loading.serving_model import load_prefill_model
    from tests.tiny import save_tiny_chat_model

    model_dir = save_tiny_chat_model(tmp_path / "model", std=0.08)
    native = load_prefill_model(model_dir, None, kernels=KernelConfig())
    sdpa = load_prefill_model(model_dir, None, kernels=KernelConfig(prefill_attention="sdpa"))
    assert native.prefill_attention.name == "native" and sdpa.prefill_attention.name == "sdpa"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, native.config.vocab_size, (90,), generator=g)
    with torch.no_grad():
        a = native.prefill(ids, [50, 40])
        b = sdpa.prefill(ids, [50, 40])
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    # Later layers' latents depend on earlier layers' attention: equal up to rounding.
    torch.testing.assert_close(a.n, b.n, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.k_pe, b.k_pe, rtol=1e-4, atol=1e-5)


@needs_native
def test_the_in_process_prefill_of_a_decode_engine_takes_the_chosen_backend(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `tpla generate --tp` and the colocated baseline prefill in the engine's process;
    # TPLA_ATTENTION_BACKEND must reach them as it reaches the prefill service.
    from tests.tiny import save_tiny_chat_model
    from tools.bench.colocated import ColocatedServer

    model_dir = save_tiny_chat_model(tmp_path / "model", std=0.08)
    for setting, chosen in (("sdpa", "sdpa"), ("auto", "native")):
        monkeypatch.setenv("TPLA_ATTENTION_BACKEND", setting)
        with ColocatedServer(str(model_dir), None, tp=1, latent_groups=1) as server:
            assert server.prefill_model.prefill_attention.name == chosen

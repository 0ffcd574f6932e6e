"""The prefill attention backends (common/model/prefill_attention): selection, the native backend's
fallback to SDPA, and the same prefill model on both."""

from __future__ import annotations

import pytest
import torch

from common.model.prefill_attention import NativePrefillAttention, select_prefill_attention
from common.native import causal_attention
from tests.unit.common.native.test_causal_attention import _inputs, masked_softmax_reference

pytestmark = pytest.mark.skipif(
    not causal_attention.available(), reason="no C++ compiler for the kernel"
)


def test_backend_selection_and_fallback() -> None:
    assert select_prefill_attention("auto", "cpu").name == "native"
    assert (
        select_prefill_attention("native").name == "native"
        and select_prefill_attention("sdpa").name == "sdpa"
    )
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_prefill_attention("fast")
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


def test_the_prefill_model_is_the_same_on_both_backends(tmp_path) -> None:
    from common.loading.serving_model import load_prefill_model
    from tests.tiny import save_tiny_chat_model

    model_dir = save_tiny_chat_model(tmp_path / "model", std=0.08)
    native = load_prefill_model(model_dir, None, attention_backend="auto")
    sdpa = load_prefill_model(model_dir, None, attention_backend="sdpa")
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

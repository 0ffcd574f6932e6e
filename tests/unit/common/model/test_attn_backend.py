"""The prefill attention backends (common/model/attn_backend): selection, the native backend's
fallback to SDPA, and the same prefill model on both."""

from __future__ import annotations

import pytest
import torch

from common.model.attn_backend import NativeBackend, select_backend
from common.native import causal_attention as ca
from tests.unit.common.native.test_causal_attention import _inputs, masked_softmax_reference

pytestmark = pytest.mark.skipif(not ca.available(), reason="no C++ compiler for the kernel")


def test_backend_selection_and_fallback() -> None:
    assert select_backend("auto", "cpu").name == "native"
    assert select_backend("native").name == "native" and select_backend("sdpa").name == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("fast")
    backend = NativeBackend()
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
    assert native.prefill_backend.name == "native" and sdpa.prefill_backend.name == "sdpa"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, native.config.vocab_size, (90,), generator=g)
    with torch.no_grad():
        a = native.prefill(ids, [50, 40])
        b = sdpa.prefill(ids, [50, 40])
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    # Later layers' latents depend on earlier layers' attention: equal up to rounding.
    torch.testing.assert_close(a.n, b.n, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.k_pe, b.k_pe, rtol=1e-4, atol=1e-5)


def test_the_in_process_prefill_of_a_decode_engine_takes_the_chosen_backend(tmp_path) -> None:
    # `tpla generate --tp` and the colocated baseline prefill through tools.cli.local;
    # TPLA_ATTENTION_BACKEND must reach them as it reaches the prefill service.
    from services.decode.config import EngineConfig
    from tests.tiny import save_tiny_chat_model
    from tools.cli.local import load_prefill_model

    model_dir = save_tiny_chat_model(tmp_path / "model", std=0.08)
    cfg = EngineConfig(model=str(model_dir))
    assert load_prefill_model(cfg, "sdpa").prefill_backend.name == "sdpa"
    assert load_prefill_model(cfg).prefill_backend.name == "native"

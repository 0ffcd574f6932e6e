"""Chunked prefill on CUDA: the demo model's prompt prefilled in chunks (each over the
earlier chunks' latents, the past attention in key tiles) against the same prompt prefilled
whole, in fp32 and bf16, and the default chunk on a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.loading.serving_model import load_prefill_model
from common.model.chunked import prefill_in_chunks
from common.runtime.kernel_choice import KernelConfig
from services.prefill.batch.progress import default_chunk_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


def test_the_cuda_default_chunk_is_8192() -> None:
    assert default_chunk_tokens(torch.device("cuda")) == 8192


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_chunked_prefill_on_cuda_equals_whole(dtype: str, tol: float) -> None:
    model = load_prefill_model(DEMO, None, dtype, KernelConfig(prefill_attention="sdpa"), "cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, model.config.vocab_size, (3000,), generator=g).cuda()
    with torch.no_grad():
        whole = model.prefill(ids, [len(ids)])
        chunked = prefill_in_chunks(model.prefill, ids, 700)
    for a, b in zip(chunked.n, whole.n, strict=True):
        scale = b.float().abs().amax()
        torch.testing.assert_close(a.float(), b.float(), atol=tol * scale, rtol=0)
    scale = whole.logits.float().abs().amax()
    torch.testing.assert_close(
        chunked.logits.float(), whole.logits.float(), atol=tol * scale, rtol=0
    )
    if dtype == "float32":
        assert chunked.logits[-1].argmax() == whole.logits[-1].argmax()

"""A prompt prefilled chunk by chunk equals it prefilled whole: latents within fp32
tolerance and the same greedy answer decoded after it, on the demo and random V2 / V3
models, with chunks that split a KV block (16 tokens) and ones that do not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.loading.loader import load_model
from common.model.causal_lm import PrefillOutput
from common.model.chunked import prefill_in_chunks
from common.model.contiguous_cache import ContiguousLatentCache
from common.model.generate import generate
from common.sampling.params import SamplingParams
from tests.tiny import save_hf

DEMO = Path(__file__).resolve().parents[4] / "models" / "demo"
STEPS = 8


@pytest.fixture(
    scope="module", params=["demo", "v2-group-yarn", "v3-noaux-yarn", "v3-qnull-halfrope"]
)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    if request.param == "demo":
        return load_model(DEMO)
    out = tmp_path_factory.mktemp(request.param)
    save_hf(request.param, out, std=0.08)
    return load_model(out)


def chunked_and_whole(model, chunk: int, absorbed: bool):  # type: ignore[no-untyped-def]
    """A 150-token prompt prefilled whole and in chunks of `chunk`, checked equal (latents
    within fp32 tolerance, logits): (prompt, whole, chunked)."""
    prompt = torch.randint(2, 150, (150,), generator=torch.Generator().manual_seed(chunk))
    whole = model.prefill(prompt, [len(prompt)])
    chunked = prefill_in_chunks(model.prefill, prompt, chunk, absorbed=absorbed)
    for layer in range(len(whole.n)):
        torch.testing.assert_close(chunked.n[layer], whole.n[layer], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(chunked.k_pe[layer], whole.k_pe[layer], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(chunked.logits, whole.logits, atol=1e-4, rtol=1e-4)
    return prompt, whole, chunked


def _greedy_after(model, prompt: torch.Tensor, out: PrefillOutput) -> list[int]:  # type: ignore[no-untyped-def]
    length = int(prompt.shape[0])
    cache = ContiguousLatentCache(model.config, 1, length + STEPS)
    cache.load_prefill(0, out, 0, length)
    token = int(out.logits[-1].argmax())
    tokens = [token]
    for pos in range(length, length + STEPS - 1):
        logits = model.decode(torch.tensor([token]), torch.tensor([pos]), cache)[0]
        token = int(logits.argmax())
        tokens.append(token)
    return tokens


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("chunk", [16, 23, 64])
def test_chunks_equal_the_whole_prompt(model, chunk: int, absorbed: bool) -> None:  # type: ignore[no-untyped-def]
    prompt, whole, chunked = chunked_and_whole(model, chunk, absorbed)
    greedy = SamplingParams(max_tokens=STEPS, temperature=0.0)
    want = generate(model, prompt.tolist(), greedy).token_ids
    assert _greedy_after(model, prompt, whole) == want
    assert _greedy_after(model, prompt, chunked) == want

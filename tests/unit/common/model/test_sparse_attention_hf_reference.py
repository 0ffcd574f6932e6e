"""DeepSeek Sparse Attention against HF transformers' DeepseekV32 / GlmMoeDsa on tiny random
checkpoints whose index_topk (8) is far below the prompts, so every query's selection
matters; and a DSA model whose index_topk covers the context is bit-equal to dense V3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.loading.loader import load_model
from common.model import sparse_prefill
from common.model.contiguous_cache import ContiguousLatentCache
from common.model.generate import generate
from common.sampling.params import SamplingParams
from tests.tiny import DSA_VARIANTS, hf_greedy, save_hf

PROMPT_LEN = 40
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=sorted(DSA_VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf(request.param, path)
    return hf, load_model(path)


def _prompt(seed: int = 1, length: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(2, 160, (length,), generator=torch.Generator().manual_seed(seed))


def _hf_selections(hf: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each full layer's top-k indices [T, k] as HF's indexers pick them."""
    picked: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda m, a, o: picked.append(o[0]))
        for layer in hf.model.layers
        if layer.self_attn.indexer is not None
    ]
    with torch.no_grad():
        hf(ids[None])
    for hook in hooks:
        hook.remove()
    return picked


def test_the_configs_separate_the_kth_score_so_hf_selects_the_same_tokens(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test configs have no tie at any query's threshold: HF's `torch.topk` and our rule
    (score, then position) pick the same set, so the comparisons below compare like with
    like."""
    hf, ours = pair
    ids = _prompt()
    ours_picked: list[tuple[torch.Tensor, torch.Tensor]] = []
    select = sparse_prefill._select

    def recording(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        out = select(*args)  # type: ignore[arg-type]
        ours_picked.append(out)
        return out

    monkeypatch.setattr(sparse_prefill, "_select", recording)
    ours.prefill(ids, [PROMPT_LEN])
    theirs = _hf_selections(hf, ids)
    assert len(theirs) == len(ours_picked) > 0
    for (positions, count), hf_topk in zip(ours_picked, theirs, strict=True):
        for t in range(PROMPT_LEN):
            mine = set(positions[t, : int(count[t])].tolist())
            hf_valid = {p for p in hf_topk[t].tolist() if p <= t}
            assert mine == hf_valid, f"query {t}: a tie at the threshold"


def test_prefill_logits_match_hf(pair) -> None:
    hf, ours = pair
    ids = _prompt()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for absorbed in (False, True):
        out = ours.prefill(ids, [PROMPT_LEN], all_logits=True, absorbed=absorbed)
        torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("path", ["expanded", "absorbed"])
def test_greedy_tokens_match_hf(pair, path: str) -> None:
    """`absorbed` decodes over the latent cache, each step's query selecting over the index
    keys cached so far; `expanded` prefills the whole sequence again every step."""
    hf, ours = pair
    ids = _prompt(3)
    expected = hf_greedy(hf, ids, NEW_TOKENS)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert generate(ours, ids.tolist(), params, path=path).token_ids == expected


def test_chunked_prefill_over_a_past_equals_whole(pair) -> None:
    """A prompt past index_topk prefilled in chunks (each over its past's latents and index
    keys) equals the whole prompt at once."""
    from common.model.chunked import prefill_in_chunks

    _, ours = pair
    ids = _prompt(5)
    whole = ours.prefill(ids, [PROMPT_LEN])
    chunked = prefill_in_chunks(ours.prefill, ids, 16)
    torch.testing.assert_close(chunked.logits, whole.logits, atol=1e-5, rtol=0)
    for a, b in zip(chunked.index_keys, whole.index_keys, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def _as_v3(src: Path, out: Path) -> None:
    """The same weights as a dense DeepSeek-V3 checkpoint (no indexer)."""
    out.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "deepseek_v3"
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    dense = {k: v for k, v in tensors.items() if ".indexer." not in k}
    save_file(dense, str(out / "model.safetensors"))


def test_index_topk_covering_the_context_is_bit_equal_to_dense_v3(tmp_path: Path) -> None:
    """Prefill and every decode step's logits, bit for bit."""
    save_hf("v32-sparse", tmp_path / "dsa", index_topk=PROMPT_LEN + NEW_TOKENS)
    _as_v3(tmp_path / "dsa", tmp_path / "v3")
    models = [load_model(tmp_path / "dsa"), load_model(tmp_path / "v3")]
    ids = _prompt(7)
    outs = [m.prefill(ids, [PROMPT_LEN]) for m in models]
    assert torch.equal(outs[0].logits, outs[1].logits)
    caches = []
    for model, out in zip(models, outs, strict=True):
        cache = ContiguousLatentCache(model.config, 1, PROMPT_LEN + NEW_TOKENS)
        cache.load_prefill(0, out, 0, PROMPT_LEN)
        caches.append(cache)
    token = outs[0].logits[0].argmax()[None]
    for step in range(NEW_TOKENS):
        pos = torch.tensor([PROMPT_LEN + step])
        dsa, v3 = (m.decode(token, pos, c) for m, c in zip(models, caches, strict=True))
        assert torch.equal(dsa, v3)
        token = dsa[0].argmax()[None]

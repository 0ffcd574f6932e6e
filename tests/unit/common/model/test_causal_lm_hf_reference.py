"""Our model against HF transformers on tiny random checkpoints: DeepseekV2/V3ForCausalLM, and
every other family of the registry (tests/tiny_families.py, each in its released layout)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.loading.loader import load_model
from common.model.generate import generate
from common.sampling.params import SamplingParams
from tests.tiny import VARIANTS, hf_greedy, save_hf
from tests.tiny_families import FAMILY_VARIANTS, save_family

PROMPT_LEN = 37
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=sorted(VARIANTS) + sorted(FAMILY_VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    save = save_family if request.param in FAMILY_VARIANTS else save_hf
    hf = save(request.param, path)
    return hf, load_model(path)


def _prompt(seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 160, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_match_hf(pair) -> None:
    hf, ours = pair
    ids = _prompt()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    out = ours.prefill(ids, [PROMPT_LEN], all_logits=True)
    assert out.logits.shape == ref.shape
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)


def test_batched_prefill_equals_single(pair) -> None:
    _, ours = pair
    a, b = _prompt(1), _prompt(2)[:20]
    both = ours.prefill(torch.cat([a, b]), [len(a), len(b)])
    torch.testing.assert_close(
        both.logits[0], ours.prefill(a, [len(a)]).logits[0], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        both.logits[1], ours.prefill(b, [len(b)]).logits[0], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("path", ["expanded", "absorbed"])
def test_greedy_tokens_match_hf(pair, path: str) -> None:
    hf, ours = pair
    ids = _prompt(3)
    expected = hf_greedy(hf, ids, NEW_TOKENS)
    got = generate(
        ours,
        ids.tolist(),
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
        path=path,
    )
    assert got.token_ids == expected
    assert got.finish_reason == "length"


def test_loader_rejects_mismatched_checkpoint(tmp_path: Path) -> None:
    import json

    from common.loading.checkpoint import CheckpointError

    save_hf("v2-greedy", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["kv_lora_rank"] = 48
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"kv_a_proj_with_mqa\.weight: checkpoint"):
        load_model(tmp_path)

"""Every family of the registry (common/model/families.py) against its HF transformers 5
model on a tiny random checkpoint in the family's released layout: logits within fp32
tolerance and greedy tokens equal, through the expanded and the absorbed paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.loading.loader import load_model
from common.model.generate import generate
from common.sampling.params import SamplingParams
from tests.tiny_families import FAMILY_VARIANTS, save_family

PROMPT_LEN = 37
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=sorted(FAMILY_VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_family(request.param, path)
    return hf, load_model(path)


def _prompt(seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 160, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_match_hf(pair) -> None:
    hf, ours = pair
    ids = _prompt()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    out = ours.prefill(ids, [PROMPT_LEN], all_logits=True)
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)


def _hf_greedy(hf: torch.nn.Module, ids: torch.Tensor, steps: int) -> list[int]:
    seq = ids.tolist()
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


@pytest.mark.parametrize("path", ["expanded", "absorbed"])
def test_greedy_tokens_match_hf(pair, path: str) -> None:
    hf, ours = pair
    ids = _prompt(3)
    got = generate(
        ours,
        ids.tolist(),
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
        path=path,
    )
    assert got.token_ids == _hf_greedy(hf, ids, NEW_TOKENS)


def test_a_wrapper_serves_its_text_model_only(tmp_path: Path) -> None:
    """Kimi K2.5's checkpoint: the text model under language_model., a vision tower beside;
    the loaded model holds the text model's tensors and nothing of the tower."""
    save_family("kimi-k25", tmp_path)
    model = load_model(tmp_path)
    assert model.config.model_type == "kimi_k25"
    assert not any("vision" in name or "projector" in name for name in model.state_dict())

"""The n-gram proposer against a plain search, the mtp proposer's pending rows, and the mtp
refusals."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from services.decode.config import SpecConfig
from services.decode.leader.drafts import (
    MAX_NGRAM,
    SEED,
    MtpDrafts,
    NgramDrafts,
    check_proposer,
)


def _search(tokens: list[int], k: int) -> list[int]:
    """The longest suffix (4 down to 1) that occurred before; what followed its latest
    earlier occurrence."""
    for n in range(min(MAX_NGRAM, len(tokens)), 0, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # occurrences ending before the last
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


def test_ngram_drafts_are_the_plain_search() -> None:
    rng = random.Random(0)
    for trial in range(200):
        tokens = [rng.randrange(4 if trial % 2 else 12) for _ in range(rng.randrange(1, 40))]
        drafts = NgramDrafts(tokens[:5])
        drafts.extend(tokens[5:])
        for k in (1, 3, 5):
            assert drafts.propose(k) == _search(tokens, k), (tokens, k)


def test_ngram_index_caught_up_between_appends_is_the_plain_search() -> None:
    """Drafts asked for after some appends and not others (steps that speculate, steps that
    do not): the index catches up from where it stopped."""
    rng = random.Random(1)
    for _ in range(100):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(2, 60))]
        drafts, end = NgramDrafts(tokens[:1]), 1
        while end < len(tokens):
            step = rng.randrange(1, 6)
            drafts.extend(tokens[end : end + step])
            end = min(end + step, len(tokens))
            if rng.random() < 0.5:
                assert drafts.propose(4) == _search(tokens[:end], 4), (tokens, end)


def test_ngram_prefers_the_longest_then_latest_match() -> None:
    drafts = NgramDrafts([1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3])
    assert drafts.propose(3) == [9, 2, 3]  # "1 2 3" beats the later "2 3"
    drafts.extend([5])
    assert drafts.propose(2) == []
    assert NgramDrafts([]).propose(4) == []
    assert NgramDrafts([4, 4]).propose(3) == [4]


def test_mtp_is_refused_naming_the_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v2"}))
    check_proposer(SpecConfig("ngram"), str(tmp_path))
    with pytest.raises(ValueError, match="has no MTP layer"):
        check_proposer(SpecConfig("mtp"), str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 1}))
    check_proposer(SpecConfig("mtp"), str(tmp_path))
    with pytest.raises(ValueError, match="start the group with TPLA_SPECULATIVE=mtp"):
        check_proposer(SpecConfig("mtp"), str(tmp_path), mtp_loaded=False)
    with pytest.raises(ValueError, match="not one of"):
        SpecConfig("eagle")


def test_mtp_rows_follow_the_kept_tokens() -> None:
    """Seeded by a prefill: one pending row at the prompt's last position; after a step,
    the step's kept rows with the tokens after them."""
    assert MtpDrafts().propose(3) == []  # no hidden state yet
    seeded = MtpDrafts(torch.zeros(4), first_token=9, position=6)
    assert seeded.rows == [(SEED, 9, 6)] and seeded.propose(2) == [0, 0]
    seeded.kept(start=3, position=7, tokens=[11, 12])
    assert seeded.seed is None and seeded.rows == [(3, 11, 7), (4, 12, 8)]

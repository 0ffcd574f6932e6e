"""Draft proposers of the leader's speculative steps: what a sequence's next tokens may be.

A proposer is per sequence, fed every token the sequence holds (prompt, then output), and
asked before a step for up to k drafts; the step verifies them (leader/verify.py), so a
draft only ever costs a row, never a wrong token. `ngram` (prompt lookup) needs no model:
the longest recent n-gram (n = 4 down to 1) that ends the sequence and occurred before
proposes the tokens that followed its latest earlier occurrence. Its state is the sequence's
tokens, which a migrated request carries, so it moves with the request. `mtp` drafts are
made on the ranks, in the step (services/decode/rank/draft_pass.py): its state here is only
where the main model's newest hidden states are, and the tokens after them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from torch import Tensor

from services.decode.config import SpecConfig

MAX_NGRAM = 4


class NgramDrafts:
    """One sequence's n-gram index: for n = 1..4, each n-gram -> the index of the token that
    followed its latest occurrence. Appending a token is O(1); the index catches up with
    what was appended when drafts are asked for (O(4) a token), so a sequence whose steps do
    not speculate (a batch above the limit) never pays for it; proposing is O(4 + k)."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = list(tokens)
        self._follows: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
        self._indexed = 0  # tokens[:_indexed] are in the index

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)

    def _index(self) -> None:
        tokens = self.tokens
        for i in range(self._indexed, len(tokens)):
            # The n-grams ending just before token i are followed by it; the latest wins.
            for n in range(1, min(MAX_NGRAM, i) + 1):
                self._follows[n][tuple(tokens[i - n : i])] = i
        self._indexed = len(tokens)

    def propose(self, k: int) -> list[int]:
        """Up to k drafts: what followed the latest earlier occurrence of the longest suffix
        (4 tokens down to 1) seen before; none without a match."""
        self._index()
        size = len(self.tokens)
        for n in range(min(MAX_NGRAM, size), 0, -1):
            start = self._follows[n].get(tuple(self.tokens[size - n :]))
            if start is not None:
                return self.tokens[start : start + k]
        return []


# A pass row's hidden state from the request's prefill (MtpDrafts.seed), not a step's row.
SEED = -1


class MtpDrafts:
    """One sequence's MTP draft state: its positions the MTP module has still to run at
    (rows: (the step row holding the main model's hidden state there, or SEED; the token
    after it; the position)), the last step's kept rows or its prefill's last position. The
    step's draft pass runs them, then drafts from the last one (DecodeStep, MtpPlan)."""

    def __init__(self, seed: Tensor | None = None, first_token: int = 0, position: int = 0) -> None:
        self.seed = seed
        self.rows: list[tuple[int, int, int]] = []
        if seed is not None:
            self.rows = [(SEED, first_token, position)]

    def propose(self, k: int) -> list[int]:
        """k placeholders (the ranks fill them in) where the module can run; none before
        the sequence's first step without a prefill's hidden state."""
        return [0] * k if self.rows else []

    def extend(self, tokens: Iterable[int]) -> None:
        """Nothing: a step's kept rows come through `kept`."""

    def kept(self, start: int, position: int, tokens: Sequence[int]) -> None:
        """The step's rows from `start` (row i at position + i) kept `tokens`: row i's
        hidden state and token i are the next pass's row i."""
        self.seed = None
        self.rows = [(start + i, token, position + i) for i, token in enumerate(tokens)]


Proposer = NgramDrafts | MtpDrafts


def mtp_layers(model_dir: str) -> int:
    """The checkpoint's multi-token-prediction layers (DeepSeek-V3's
    `num_nextn_predict_layers`; 0 without)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("num_nextn_predict_layers") or 0)


def check_proposer(spec: SpecConfig, model_dir: str, mtp_loaded: bool = True) -> None:
    """ValueError when the configured proposer cannot run on this model (`mtp_loaded`:
    whether the group's ranks hold the MTP module, which they load at start-up only when
    started with TPLA_SPECULATIVE=mtp)."""
    if spec.method != "mtp":
        return
    if not mtp_layers(model_dir):
        raise ValueError(
            f"TPLA_SPECULATIVE=mtp: the model at {model_dir} has no MTP layer "
            "(num_nextn_predict_layers is 0 or absent); use ngram or none"
        )
    if not mtp_loaded:
        raise ValueError(
            "mtp drafts need the MTP module on the ranks: start the group with TPLA_SPECULATIVE=mtp"
        )


def proposer(
    spec: SpecConfig,
    prompt_ids: Sequence[int],
    output: Sequence[int],
    seed: Tensor | None = None,
    position: int = 0,
) -> Proposer:
    """A new sequence's proposer, holding what it has so far (`seed`, mtp: its prefill's
    last hidden state, at `position`, before the first output token)."""
    if spec.method == "mtp":
        return MtpDrafts(seed, output[-1], position)
    assert spec.method == "ngram", spec.method  # check_proposer refused the others
    return NgramDrafts([*prompt_ids, *output])

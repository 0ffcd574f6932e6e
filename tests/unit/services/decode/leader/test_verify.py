"""What a sequence keeps of a speculative step's rows, and where its rows sit."""

from __future__ import annotations

from common.sampling.sampler import SampledToken
from services.decode.leader.verify import StepRows, draft_room, kept_tokens


def _toks(*ids: int) -> list[SampledToken]:
    return [SampledToken(t, -float(t)) for t in ids]


def test_kept_tokens_run_through_the_first_mismatch() -> None:
    assert kept_tokens([], _toks(5)) == _toks(5)
    assert kept_tokens([5, 6, 7], _toks(5, 6, 7, 8)) == _toks(5, 6, 7, 8)  # all kept + one
    assert kept_tokens([5, 6, 7], _toks(5, 9, 7, 8)) == _toks(5, 9)  # the sampler's pick
    assert kept_tokens([5, 6], _toks(4, 6, 1)) == _toks(4)


def test_step_rows_and_draft_room() -> None:
    rows = StepRows([[1, 2], [], [3]])
    assert (rows.sizes, rows.starts, rows.total, rows.speculative) == (
        [3, 1, 2],
        [0, 3, 4],
        6,
        True,
    )
    assert rows.split(list("abcdef")) == [["a", "b", "c"], ["d"], ["e", "f"]]
    assert rows.per_row("xyz") == list("xxxyzz")
    assert not StepRows([[], []]).speculative
    # A step keeps at most 1 + drafts tokens, never past max_tokens.
    assert [draft_room(5, g) for g in (1, 3, 4, 5)] == [3, 1, 0, 0]

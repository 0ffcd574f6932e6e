"""The step's speculation without a group: which sequences draft how many tokens, and what a
verified step tells the proposers and the acceptance counts."""

from __future__ import annotations

from common.sampling.sampler import SampledToken
from services.decode.config import SpecConfig
from services.decode.leader.drafts import MtpDrafts, NgramDrafts
from services.decode.leader.probe import Acceptance
from services.decode.leader.scheduler import DecodeSequence
from services.decode.leader.speculation import Speculation

NGRAM = SpecConfig("ngram", tokens=3, max_batch=2)
REPEATING = [1, 2, 3, 1, 2, 3, 1, 2]  # its n-gram drafts: 3, 1, 2, ...


def _seq(name: str, max_tokens: int = 20, generated: int = 1) -> DecodeSequence:
    return DecodeSequence(name, 8, max_tokens, generated=[2] * generated)


def _toks(*ids: int) -> list[SampledToken]:
    return [SampledToken(t, 0.0) for t in ids]


def test_drafts_keep_to_k_max_tokens_the_batch_limit_and_max_batch() -> None:
    spec = Speculation(NGRAM, 16, Acceptance())
    drafts = spec.drafts([_seq("a")], [NgramDrafts(REPEATING)], [False], max_batch=8)
    assert drafts == [[3, 1, 2]]  # k = 3
    # max_tokens 4 with 2 generated: one draft, so a step keeps at most the 2 tokens left.
    short = spec.drafts([_seq("a", 4, 2)], [NgramDrafts(REPEATING)], [False], max_batch=8)
    assert short == [[3]]
    # A replaying sequence drafts nothing; the step's rows stay within max_batch.
    pair = [_seq("a"), _seq("b")]
    props = [NgramDrafts(REPEATING), NgramDrafts(REPEATING)]
    assert spec.drafts(pair, props, [True, False], max_batch=8) == [[], [3, 1, 2]]
    assert spec.drafts(pair, props, [False, False], max_batch=4) == [[3, 1], []]
    # Above the speculation batch limit no step drafts.
    three = [*pair, _seq("c")]
    assert spec.drafts(three, [*props, NgramDrafts(REPEATING)], [False] * 3, 64) == [[]] * 3


def test_a_proposer_of_another_method_idles_after_a_switch() -> None:
    spec = Speculation(NGRAM, 16, Acceptance())
    assert spec.proposer([1, 2], [3], None, 2) is not None
    spec.use(SpecConfig("mtp", tokens=1))
    assert spec.drafts([_seq("a")], [NgramDrafts(REPEATING)], [False], 8) == [[]]
    spec.use(SpecConfig())
    assert spec.proposer([1, 2], [3], None, 2) is None


def test_a_verified_step_counts_and_feeds_the_proposers() -> None:
    counts: list[int] = []
    acceptance = Acceptance(on_verify=counts.append)
    spec = Speculation(NGRAM, 16, acceptance)
    ngram, mtp = NgramDrafts(REPEATING), MtpDrafts()
    batch = [_seq("a"), _seq("b", generated=3)]
    step = spec.step(batch, [ngram, mtp], [False, False], max_batch=8)
    assert step.mtp is None and step.rows.drafts == [[3, 1, 2], []]
    sampled = [_toks(3, 1, 9, 5), _toks(7)]
    runs = step.kept(sampled)
    assert runs == [_toks(3, 1, 9), _toks(7)]  # through the first mismatch
    # The first sequence's run ends at its second token (a stop): it takes two.
    assert step.record(runs, [2, 1]) == [(3, 2), (0, 0)]
    assert (acceptance.drafted, acceptance.accepted, counts) == (3, 2, [2])
    assert ngram.tokens == [*REPEATING, 3, 1]
    # An mtp proposer's next pass rows: the step's rows from its start, at its positions.
    assert mtp.rows == [(4, 7, batch[1].next_position)]

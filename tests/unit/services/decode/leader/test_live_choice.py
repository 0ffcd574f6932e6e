"""LiveChoice.event: a choice whose grammar failed inside a step's run of kept drafts sends
the tokens before the failing one as tokens and ends once, with the failure."""

from __future__ import annotations

from common.messages import FailureScope
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken
from services.decode.leader.controls import SequenceControls
from services.decode.leader.live_choice import LiveChoice
from services.decode.stream import TokenStream


def test_only_the_ending_event_is_the_grammar_failure() -> None:
    live = LiveChoice(SamplingParams(), TokenStream(), 0, SequenceControls())
    # The controls saw the step's whole run (three kept drafts) before its events go out; the
    # grammar stopped at the third.
    live.controls.failed = "parser stopped"
    run = [SampledToken(i, 0.0) for i in (5, 6, 7)]
    reasons = [None, None, f"error: {live.controls.failure}"]
    events = [live.event(tok, reason) for tok, reason in zip(run, reasons, strict=True)]
    assert [e.token.token_id if e.token else None for e in events] == [5, 6, None]
    assert [e.finish_reason is not None for e in events] == [False, False, True]
    assert events[2].failure is FailureScope.REQUEST
    live.stream.put(*events)
    assert [len(batch) for batch in live.stream.batches()] == [3]  # it ends: one end

"""TokenStream.batches: the events ready together come as one list (one gRPC message), in
order, and the stream ends after every choice's last event."""

from __future__ import annotations

import threading

from common.messages import TokenEvent
from common.sampling.sampler import SampledToken
from services.decode.stream import TokenStream


def _token(i: int, index: int = 0, reason: str | None = None) -> TokenEvent:
    return TokenEvent(SampledToken(i, 0.0), reason, index=index)


def test_a_run_put_together_comes_as_one_batch_then_the_next_waits() -> None:
    stream = TokenStream()
    for i in range(4):  # a speculative step's accepted run
        stream.put(_token(i))
    batches = stream.batches()
    assert [e.token.token_id for e in next(batches)] == [0, 1, 2, 3]
    threading.Timer(0.05, lambda: stream.put(_token(4, reason="length"))).start()
    last = next(batches)  # waits for the event put later
    assert [(e.token.token_id, e.finish_reason) for e in last] == [(4, "length")]
    assert next(batches, None) is None


def test_it_ends_after_every_choice_has_ended_leaving_what_follows() -> None:
    stream = TokenStream(choices=2)
    for event in (_token(1, 0, "stop"), _token(2, 1), _token(3, 1, "length"), _token(9, 1)):
        stream.put(event)
    assert [[e.token.token_id for e in b] for b in stream.batches()] == [[1, 2, 3]]
    assert stream.get(timeout=1).token.token_id == 9  # never read as this request's


def test_iterating_yields_the_same_events_one_by_one() -> None:
    stream = TokenStream()
    for i in range(3):
        stream.put(_token(i, reason="stop" if i == 2 else None))
    assert [e.token.token_id for e in stream] == [0, 1, 2]

"""TokenStream.batches: a step's events, and the events ready together, come as one list
(one gRPC message), in order, and the stream ends after every choice's last event."""

from __future__ import annotations

import threading
import time

from common.messages import TokenEvent
from common.sampling.sampler import SampledToken
from services.decode.stream import TokenStream


def _token(i: int, index: int = 0, reason: str | None = None) -> TokenEvent:
    return TokenEvent(SampledToken(i, 0.0), reason, index=index)


def test_a_steps_run_reaches_a_waiting_reader_whole() -> None:
    stream = TokenStream()
    got: list[list[int]] = []

    def read() -> None:
        got.extend([e.token.token_id for e in b] for b in stream.batches())

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.05)  # the reader waits in batches(): it wakes at the first event put
    stream.put(*(_token(i) for i in range(4)))  # a speculative step's accepted run
    stream.put(_token(4, reason="length"))
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert got[0][:4] == [0, 1, 2, 3]  # never split, whenever the reader woke
    assert [t for batch in got for t in batch] == [0, 1, 2, 3, 4]


def test_what_is_queued_together_comes_as_one_batch_then_the_next_waits() -> None:
    stream = TokenStream()
    for i in range(4):
        stream.put(_token(i))
    batches = stream.batches()
    assert [e.token.token_id for e in next(batches)] == [0, 1, 2, 3]
    threading.Timer(0.05, lambda: stream.put(_token(4, reason="length"))).start()
    last = next(batches)  # waits for the event put later
    assert [(e.token.token_id, e.finish_reason) for e in last] == [(4, "length")]
    assert next(batches, None) is None


def test_it_ends_after_every_choice_has_ended_leaving_what_follows() -> None:
    stream = TokenStream(choices=2)
    stream.put(_token(1, 0, "stop"))
    stream.put(_token(2, 1), _token(3, 1, "length"))
    stream.put(_token(9, 1))
    assert [[e.token.token_id for e in b] for b in stream.batches()] == [[1, 2, 3]]
    assert [e.token.token_id for e in next(stream.batches())] == [9]  # never this request's


def test_a_put_of_nothing_sends_nothing() -> None:
    stream = TokenStream()
    stream.put()
    stream.put(_token(0, reason="stop"))
    assert list(stream.batches()) == [[_token(0, reason="stop")]]


def test_iterating_yields_the_same_events_one_by_one() -> None:
    stream = TokenStream()
    stream.put(_token(0), _token(1))
    stream.put(_token(2, reason="stop"))
    assert [e.token.token_id for e in stream] == [0, 1, 2]


def test_a_choice_that_ends_twice_does_not_end_another() -> None:
    """Each choice's end counts once: a second end of one choice (which the leader must not
    send) neither ends the stream early nor leaves it waiting forever."""
    stream = TokenStream(choices=2)
    stream.put(_token(1, 0, "stop"))
    stream.put(_token(2, 0, "stop"))
    stream.put(_token(3, 1, "length"))
    assert [[e.token.token_id for e in b] for b in stream.batches()] == [[1, 2, 3]]

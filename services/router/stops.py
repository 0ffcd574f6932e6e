"""Stop strings on a detokenized stream (pure logic).

A stop string may be split across any number of tokens, so text that could still turn out to
be the start of a stop string is held back until the next delta decides it. The stop string
itself, and everything after it, is never emitted (OpenAI semantics).

Lifecycle: push(delta) for every text delta -> (emit, stopped); once `stopped` is true the
stream is over; otherwise flush() at the end releases the held-back tail.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the first occurrence of any stop string in a stream of text deltas."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._held = ""  # a suffix of the stream that is a proper prefix of some stop string
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, delta: str) -> tuple[str, bool]:
        """Add `delta`; return the text that is now safe to emit and whether a stop matched."""
        if self._stopped:
            return "", True
        if not self._stops:
            return delta, False
        # Only held + delta can contain a match: a match starting earlier would have left a
        # stop prefix at the end of the emitted text, and that prefix would have been held.
        buf = self._held + delta
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self._stopped = True
            return buf[:cut], True
        keep = partial_suffix(buf, self._stops)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """End of stream without a stop: release the held-back text."""
        if self._stopped:
            return ""
        held, self._held = self._held, ""
        return held


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`:
    what a stream holds back until the next delta decides whether the marker comes."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best

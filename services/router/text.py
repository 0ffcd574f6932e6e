"""Generated tokens -> the text and logprobs a client sees (pure logic over the tokenizer).

Per token: count it (and, for a thinking request, whether it was a thinking token: the
rule of common/sampling/thinking.py), detokenize incrementally (never half a UTF-8
character), run the text through the stop-string matcher (the whole output's text,
reasoning included, as vLLM matches stop strings), and release logprobs together with the
text they belong to. Stop token ids (EOS) count as generated tokens but never become text.
After a stop string matches, further tokens are ignored; `finish()` releases whatever was
held back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.sampling.sampler import SampledToken
from common.sampling.thinking import Thinking
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer
from services.router.stops import StopMatcher


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float | None  # None: an echoed prompt's first token (nothing predicts it)
    top: tuple[tuple[str, float], ...] = ()


class TextStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stops: Sequence[str],
        stop_token_ids: Sequence[int],
        token_text: Callable[[int], str] | None = None,
        *,
        skip_special_tokens: bool = True,
        thinking: Thinking | None = None,
    ) -> None:
        """`token_text` renders one token for logprobs; None means logprobs are off.
        `thinking`: a thinking request's state, to count its reasoning tokens."""
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
        )
        self._matcher = StopMatcher(stops)
        self._stop_ids = frozenset(stop_token_ids)
        self._token_text = token_text
        self._pending: list[TokenLogprob] = []
        self._chunks: list[str] = []
        self._thinking = thinking
        self.count = 0

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    @property
    def reasoning_tokens(self) -> int:
        return self._thinking.spent if self._thinking is not None else 0

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def push(self, token: SampledToken) -> tuple[str, tuple[TokenLogprob, ...]] | None:
        """Consume one token; return (text, logprobs) when something can be sent now."""
        if self.stopped:
            return None
        self.count += 1
        if self._token_text is not None:
            self._pending.append(
                TokenLogprob(
                    self._token_text(token.token_id),
                    token.logprob,
                    tuple((self._token_text(t), lp) for t, lp in token.top_logprobs),
                )
            )
        if token.token_id in self._stop_ids:
            return self._release("", final=False)
        if self._thinking is not None:
            self._thinking.take(token.token_id)
        emit, _ = self._matcher.push(self._detok.push(token.token_id))
        # A stop string ends the stream: its token's logprobs go out with the last text.
        return self._release(emit, final=self.stopped)

    def finish(self) -> tuple[str, tuple[TokenLogprob, ...]] | None:
        """End of generation: release held-back text (which may still complete a stop)."""
        if self.stopped:
            return self._release("", final=True)
        emit, stopped = self._matcher.push(self._detok.flush())
        if not stopped:
            emit += self._matcher.flush()
        return self._release(emit, final=True)

    def _release(self, text: str, *, final: bool) -> tuple[str, tuple[TokenLogprob, ...]] | None:
        # Logprobs wait for their text so a client can line the two up chunk by chunk.
        if not text and not (final and self._pending):
            return None
        if text:
            self._chunks.append(text)
        pending, self._pending = tuple(self._pending), []
        return text, pending

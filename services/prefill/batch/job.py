"""One prompt a prefill worker is asked to prefill: its ids, its sampling, the decode group's
reservation its KV goes to, and what the caller asked for besides the first token."""

from __future__ import annotations

from dataclasses import dataclass

from common.messages import Reservation
from common.model.args import ModelConfig
from common.sampling.grammar import GrammarMatcher
from common.sampling.params import SamplingParams
from services.prefill.batch.job_trace import JobTrace


@dataclass(frozen=True)
class PrefillJob:
    """One prompt to prefill into `reservation` (its KV targets), within `deadline_s`."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    reservation: Reservation
    deadline_s: float
    # The last N prompt ids are the request's own earlier output (a migrated request).
    num_output_tokens: int = 0
    matcher: GrammarMatcher | None = None  # set by the worker for a structured output
    n: int = 1  # choices: first tokens to sample
    prompt_logprobs: int | None = None  # set: the prompt's logprobs, this many alternatives
    trace: JobTrace | None = None  # set: the worker records the job's spans' times here

    @property
    def cached_tokens(self) -> int:
        """Leading prompt tokens the decode group holds already (its Reserve answer): their
        KV is not shipped; the targets name only the blocks after them."""
        return self.reservation.cached_tokens

    def check(self, config: ModelConfig) -> None:
        """ValueError naming what a model of `config` cannot prefill, or a reservation that
        does not fit the prompt."""
        vocab = config.vocab_size
        ids = self.prompt_ids
        if not ids or min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be non-empty and in [0, {vocab})")
        if len(ids) > config.max_position_embeddings:
            raise ValueError("prompt exceeds the model's context length")
        if not 0 <= self.cached_tokens <= len(ids):
            raise ValueError(f"cached_tokens {self.cached_tokens} is outside the prompt")
        targets = self.reservation.targets
        if any(t.token_ranges for t in targets):
            # SP targets name the prompt positions they cache; together they must be the
            # prompt after the decode group's cached prefix.
            covered = sum(
                hi - lo
                for t in targets
                for lo, hi in zip(t.token_ranges[::2], t.token_ranges[1::2], strict=True)
            )
            if covered != len(ids) - self.cached_tokens:
                raise ValueError(
                    f"the KV targets cover {covered} prompt tokens, the prompt has "
                    f"{len(ids) - self.cached_tokens} to ship: reserve for this prompt"
                )
        if not 0 <= self.num_output_tokens < len(ids):
            raise ValueError("num_output_tokens must be smaller than the prompt")

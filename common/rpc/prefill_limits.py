"""What a prefill call may ask for, wherever its prompt is prefilled (a prefill worker, or the
decode group itself): how many choices, and how many alternatives its prompt logprobs carry."""

from __future__ import annotations

from common.runtime.errors import InvalidRequest

MAX_CHOICES = 128  # OpenAI's limit on n
MAX_TOP_LOGPROBS = 20


def check_prefill(n: int, prompt_logprobs: int | None) -> None:
    """InvalidRequest naming what a prefill call asks for out of bounds."""
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}], got {n}")
    if prompt_logprobs is not None and prompt_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {prompt_logprobs}"
        )

"""What a user would run instead of the stack: HF transformers `generate` on the same weights.

Two ways, both with exactly `max_tokens` greedy outputs (min = max new tokens):
* naive  - a simple server around `generate`: one request at a time, behind a lock, so a
           request's TTFT includes the time it queued behind the others;
* static - HF's best case: the concurrent prompts as one padded batch per `generate` call
           (every mix here has equal prompt lengths, so there is no padding waste).
Per-token times come from a logits processor, which `generate` calls once per step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from tools.bench.stats import RequestTiming, gaps


class _StepClock:
    """A logits processor that only records when each decoding step produced its logits."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


class HfServer:
    def __init__(self, model: str, threads: int) -> None:
        from transformers import AutoModelForCausalLM, LogitsProcessorList

        self._processors = LogitsProcessorList
        self.threads = threads
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self._lock = threading.Lock()

    def _generate(
        self, batch: torch.Tensor, mask: torch.Tensor, max_tokens: int
    ) -> tuple[torch.Tensor, list[float]]:
        clock = _StepClock()
        # Per call: the intra-op thread count belongs to the calling thread (a pool worker
        # in the naive server), not to the thread that built the model.
        torch.set_num_threads(self.threads)
        with torch.no_grad():
            out = self.model.generate(
                batch,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.model.config.eos_token_id,
                logits_processor=self._processors([clock]),
            )
        return out[:, batch.shape[1] :], clock.times

    def request(self, prompt: Sequence[int], max_tokens: int) -> RequestTiming:
        """Naive serving: thread-safe, strictly one request at a time."""
        t0 = time.perf_counter()
        with self._lock:
            ids = torch.tensor([list(prompt)])
            new, times = self._generate(ids, torch.ones_like(ids), max_tokens)
        end = time.perf_counter()
        ttft = (times[0] if times else end) - t0
        return RequestTiming(ttft, end - t0, int(new.shape[1]), max_tokens, itl_s=gaps(times))

    def static_batches(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, batch_size: int
    ) -> tuple[list[RequestTiming], float]:
        """All prompts in padded batches of `batch_size`, one `generate` call each."""
        timings: list[RequestTiming] = []
        t_start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            group = prompts[i : i + batch_size]
            width = max(len(p) for p in group)
            pad = self.model.config.eos_token_id
            batch = torch.tensor([[pad] * (width - len(p)) + list(p) for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            new, times = self._generate(batch, mask, max_tokens)
            end = time.perf_counter()
            first = times[0] if times else end
            # Every request of a static batch arrived at the start of the run and waited
            # for the batches before its own.
            timings += [
                RequestTiming(
                    first - t_start, end - t_start, int(new.shape[1]), max_tokens, itl_s=gaps(times)
                )
                for _ in group
            ]
        return timings, time.perf_counter() - t_start

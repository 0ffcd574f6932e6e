"""Prompts the decode group prefills itself, a piece at a time between its decode steps.

A router sends a reserved request's prompt here instead of to a prefill worker when its
policy says so (services/router/disagg_policy.py). Lifecycle of a local prefill:
    queued     `submit` (on the loop thread) checks its reservation; the prompt's first
               `cached_tokens` are in the group's blocks already (its prefix-cache hit)
    pieces     each loop turn (`run`) takes at most `chunk_tokens` prompt tokens from the
               queued prompts in arrival order, packed as one `PrefillPlan` that every rank
               runs in its own layout (services/decode/rank/prefill_pass.py): between two
               plans the running streams step, so a long prompt costs them one chunk per step,
               not its whole prefill; each piece renews the reservation's lease
    sampled    after its last piece, each choice's first token is sampled from the gathered
               logits by the prefill worker's rule (common/sampling/first_token.py), and the
               caller's future resolves with a `PrefillResult`; its `Generate` follows as after
               a remote prefill
A prompt whose reservation ended (aborted, expired) or whose caller left is dropped between
its pieces. A prompt the group holds whole (every token in cached blocks) computes its last
token again for its logits; one that asks for its logprobs runs whole in one piece (every
position's logits, its cached prefix's included, as the prefill worker computes them); both
store only what the group does not hold, never into the cached blocks other prompts share.
Runs on the leader's loop thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from common.messages import PrefillResult
from common.runtime.errors import LocalPrefillOff
from common.sampling.first_token import sample_first
from common.sampling.grammar import GrammarMatcher
from common.sampling.params import SamplingParams
from common.sampling.prompt_logprobs import prompt_logprobs
from common.sampling.sampler import SampledToken
from services.decode.leader.ranks import Ranks
from services.decode.leader.scheduler import Scheduler, SchedulerError, SeqState
from services.decode.step_plan import PrefillPlan
from services.decode.stream import EngineError


@dataclass
class LocalPrefill:
    """One prompt the group prefills: what a prefill worker's job holds, and how far it got."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    n: int = 1
    num_output_tokens: int = 0  # the prompt's last ids are the request's earlier output
    prompt_logprobs: int | None = None  # set: the prompt's logprobs, this many alternatives
    matcher: GrammarMatcher | None = None
    future: Future[PrefillResult] = field(default_factory=Future)
    cached: int = 0  # leading tokens the group held at its reservation
    done: int = 0  # leading tokens computed (or in the group's blocks: its cached ones)
    seconds: float = 0.0  # its pieces' compute
    logprobs: list[SampledToken] = field(default_factory=list)

    @property
    def left(self) -> int:
        return len(self.prompt_ids) - self.done

    @property
    def whole(self) -> bool:
        """It runs in one piece from position 0 (its prompt's logprobs were asked for)."""
        return self.prompt_logprobs is not None


class LocalPrefills:
    """The leader's queue of local prefills over its group's ranks and scheduler."""

    def __init__(
        self,
        ranks: Ranks,
        scheduler: Scheduler,
        chunk_tokens: int,
        eos_token_ids: Collection[int],
        lease_seconds: float,
    ) -> None:
        self.ranks, self.scheduler = ranks, scheduler
        self.chunk_tokens = chunk_tokens
        self.eos_token_ids = eos_token_ids
        self.lease_seconds = lease_seconds
        self.token_ranks = scheduler.pool.parallel.token_ranks
        self.queue: deque[LocalPrefill] = deque()

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens still to prefill here: what a router weighs a group's queue by."""
        return sum(job.left for job in self.queue)

    def pending(self) -> bool:
        return bool(self.queue)

    def submit(self, job: LocalPrefill) -> None:
        """Queue a reserved request's prompt; SchedulerError where it has no open reservation
        for this prompt, LocalPrefillOff where the group does not prefill."""
        if self.chunk_tokens <= 0:
            raise LocalPrefillOff("this decode group does not prefill prompts itself")
        seq = self.scheduler.seqs.get(job.request_id)
        if seq is None or seq.state is not SeqState.RESERVED:
            raise SchedulerError(f"request {job.request_id!r} has no open reservation")
        if seq.prompt_len != len(job.prompt_ids):
            raise SchedulerError(
                f"request {job.request_id!r} reserved {seq.prompt_len} prompt tokens, "
                f"got {len(job.prompt_ids)} to prefill"
            )
        job.cached = seq.cached_tokens
        # At least its last token is computed: its logits give the first tokens.
        job.done = 0 if job.whole else min(job.cached, len(job.prompt_ids) - 1)
        self._renew(job)
        self.queue.append(job)

    def run(self) -> None:
        """One piece of the queued prompts (at most `chunk_tokens`), on every rank; the
        prompts it finishes get their first tokens."""
        batch = self._next()
        if not batch:
            return
        t0 = time.perf_counter()
        plan = self._plan(batch)
        logits, hidden = self.ranks.prefill(plan)
        seconds = time.perf_counter() - t0
        row = 0
        for s, (job, size) in enumerate(batch):
            before = job.done
            job.done += size
            job.seconds += seconds
            try:
                if job.whole:
                    assert logits is not None
                    self._score(job, logits[row : row + size], before)
                if not job.left:
                    self.queue.remove(job)
                    assert logits is not None
                    last = None if hidden is None else hidden[s]
                    self._finish(job, logits[row + size - 1 if job.whole else s], last)
                else:
                    self._renew(job)
            except Exception as exc:  # this prompt's own error (its grammar): the rest go on
                self._drop(job, exc)
            row += size

    def fail_all(self, message: str) -> None:
        """The group stopped: every queued prompt's caller learns it."""
        while self.queue:
            self._drop(self.queue.popleft(), EngineError(message))

    def _next(self) -> list[tuple[LocalPrefill, int]]:
        """The next piece: (prompt, its tokens) in queue order within the token budget; a
        prompt asking for its logprobs runs whole and alone."""
        batch: list[tuple[LocalPrefill, int]] = []
        budget = self.chunk_tokens
        for job in list(self.queue):
            if job.future.done() or not self._reserved(job):
                self.queue.remove(job)
                self._drop(job, EngineError("the reservation ended before its prefill"))
                continue
            if budget <= 0 or (batch and (job.whole or batch[0][0].whole)):
                break
            size = job.left if job.whole else min(job.left, budget)
            batch.append((job, size))
            budget -= size
        return batch

    def _plan(self, batch: list[tuple[LocalPrefill, int]]) -> PrefillPlan:
        """Every rank's plan of the piece: each prompt's tokens, first position, tables and
        the position it stores from (after its cached tokens)."""
        pool = self.scheduler.pool
        tables = [pool.tables(job.request_id)[: self.token_ranks] for job, _ in batch]
        width = max(len(t) for per_rank in tables for t in per_rank)
        padded = [
            [[*tables[s][k], *[-1] * (width - len(tables[s][k]))] for s in range(len(batch))]
            for k in range(self.token_ranks)
        ]
        tokens = [t for job, size in batch for t in job.prompt_ids[job.done : job.done + size]]
        after = [job.prompt_ids[job.done + size] if size < job.left else -1 for job, size in batch]
        return PrefillPlan(
            torch.tensor([size for _, size in batch]),
            torch.tensor([job.done for job, _ in batch]),
            torch.tensor([job.cached for job, _ in batch]),
            torch.tensor(after),
            torch.tensor(tokens),
            torch.tensor(padded, dtype=torch.int64),
            # Logits where a prompt ends (its first tokens), or every row for logprobs.
            logits=any(job.whole or size == job.left for job, size in batch),
            every_row=batch[0][0].whole,
        )

    def _score(self, job: LocalPrefill, logits: torch.Tensor, before: int) -> None:
        """A whole prompt's logprobs from its rows' logits."""
        assert job.prompt_logprobs is not None
        last = min(job.done, len(job.prompt_ids) - 1)
        ids = list(job.prompt_ids[before : last + 1])
        job.logprobs += prompt_logprobs(logits[: last - before], ids, job.prompt_logprobs)

    def _finish(self, job: LocalPrefill, logits: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Its first tokens from its last position's `logits`; `hidden`: that position's
        hidden state, where the group drafts with MTP (its first step drafts from it)."""
        tokens = sample_first(
            logits,
            job.params,
            job.prompt_ids,
            job.num_output_tokens,
            job.matcher,
            job.n,
            self.eos_token_ids,
        )
        result = PrefillResult(
            tokens[0],
            job.seconds,
            0.0,
            0,
            job.cached,
            tokens if len(tokens) > 1 else (),
            tuple(job.logprobs),
            hidden=() if hidden is None else tuple(hidden.float().tolist()),
        )
        if not job.future.done():
            job.future.set_result(result)

    def _reserved(self, job: LocalPrefill) -> bool:
        seq = self.scheduler.seqs.get(job.request_id)
        return seq is not None and seq.state is SeqState.RESERVED

    def _renew(self, job: LocalPrefill) -> None:
        self.scheduler.renew(job.request_id, time.monotonic() + self.lease_seconds)

    @staticmethod
    def _drop(job: LocalPrefill, error: BaseException) -> None:
        if not job.future.done():
            job.future.set_exception(error)

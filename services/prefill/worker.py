"""The prefill worker's core: batch prompts, run exact MLA, sample, ship per-rank shards.

Lifecycle of a job: queued -> batched with whatever else is waiting (up to a token budget) ->
its longest cached prefix looked up in the latent prefix cache (if any) -> one packed exact
prefill of the batch's new tokens, each over its cached prefix -> its new full blocks stored
in the cache -> first token sampled with the request's params (n of them for n choices, each
from its own generator; the prompt's logprobs too when asked) -> the latents the decode group
lacks (from its Reserve answer on: cached prefix and new tokens alike) cut into each decode
rank's shard (its latent columns, or its token ranges in SP mode) and pushed
over the chosen transport, all ranks and all of the batch's jobs in parallel, while the next
batch already runs -> the job's future resolves when its last shard is acknowledged. A failed
push fails only its job; the decode side frees the reservation by lease or by the router's
abort.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from common.kv.transfer import TransferError
from common.messages import PrefillResult, Reservation
from common.model.model import PastLatents, PrefillOutput
from common.runtime.device import use_device
from common.runtime.metrics import PrefillMetrics
from common.sampling.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    allowed_now,
)
from common.sampling.logits import LogitsContext, context_for
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken, first_tokens
from services.prefill.job_trace import JobTrace
from services.prefill.latent_cache import LatentPrefixCache
from services.prefill.plan import BatchPlan, JobPlan
from services.prefill.runner import PrefillRunner
from services.prefill.shipping import ShipOrder, unshipped
from services.prefill.threads import PrefillThreads

# Jobs in flight to the decode ranks at once (a few batches of short prompts).
MAX_SHIPPING = 64


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
    matcher: GrammarMatcher | None = None  # set by submit() for a structured output
    n: int = 1  # choices: first tokens to sample
    prompt_logprobs: int | None = None  # set: the prompt's logprobs, this many alternatives
    trace: JobTrace | None = None  # set: the worker records the job's spans' times here

    @property
    def cached_tokens(self) -> int:
        """Leading prompt tokens the decode group holds already (its Reserve answer): their
        KV is not shipped; the targets name only the blocks after them."""
        return self.reservation.cached_tokens


@dataclass(frozen=True)
class FirstTokens:
    """What a job samples from its prefill: each choice's first token, and the logprobs of
    prompt tokens 1..N-1 when asked for (the first has nothing to be predicted from)."""

    tokens: tuple[SampledToken, ...]
    prompt_logprobs: tuple[SampledToken, ...] = ()
    hidden: tuple[float, ...] = ()  # the last position's hidden state, for MTP drafts


def last_hidden(out: PrefillOutput, end: int) -> tuple[float, ...]:
    """Row end - 1's hidden state before the final norm: a prompt's last position."""
    assert out.hidden is not None
    return tuple(out.hidden[end - 1].float().tolist())


def prompt_logprobs(logits: Tensor, prompt_ids: list[int], top: int) -> tuple[SampledToken, ...]:
    """Logprobs of prompt tokens 1..N-1 from the prefill's logits at positions 0..N-2 [N-1, V],
    with the `top` most likely alternatives of each position."""
    if len(prompt_ids) < 2:
        return ()
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(prompt_ids[1:], device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    alt_lps, alt_ids = (
        logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], targets[:, None][:, :0])
    )
    alt_ids_l, alt_lps_l = alt_ids.tolist(), alt_lps.tolist()
    return tuple(
        SampledToken(tok, lp, tuple(zip(alt_ids_l[i], alt_lps_l[i], strict=True)))
        for i, (tok, lp) in enumerate(zip(prompt_ids[1:], chosen, strict=True))
    )


class PrefillWorker:
    def __init__(
        self,
        runner: PrefillRunner,
        max_batch_tokens: int = 2048,
        metrics: PrefillMetrics | None = None,
        transfer_timeout_s: float = 30.0,
        threads: PrefillThreads | None = None,
        grammars: GrammarCompiler | None = None,
        prefix_cache: LatentPrefixCache | None = None,
    ) -> None:
        # The model here (tp = 1) or the prefill group this process leads.
        self.runner = runner
        # Structured outputs' grammars over the model's tokenizer (None: none can be served).
        self.grammars = grammars
        # None: every prompt is prefilled whole.
        self.prefix_cache = prefix_cache
        # None: every batch on the process's current thread count.
        self.threads = threads
        # One push may take at most this long even when the request allows more: a hung
        # decode rank must fail the request, not hold this worker's pushers for minutes.
        self.transfer_timeout_s = transfer_timeout_s
        self.metrics = metrics
        # Prompts per batch fill this many tokens at most (a longer prompt runs alone). Past a
        # few hundred tokens a batch gains no matmul efficiency, while every prompt in it
        # waits for the whole batch and the decode ranks get nothing new meanwhile.
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        self.max_batch_tokens = max_batch_tokens
        self._held: tuple[PrefillJob, Future[PrefillResult]] | None = None  # next batch's first
        self._jobs: queue.Queue[tuple[PrefillJob, Future[PrefillResult]] | None] = queue.Queue()
        # The batcher runs CUDA work on the model's GPU: it makes it current (use_device).
        self._device = runner.device
        self._seqs = itertools.count()  # each job's number in the plans
        # Jobs whose shards are still travelling, at most this many: past it the batcher waits
        # for pushes instead of queueing more batches' latents in memory behind a slow rank.
        self._shipping = threading.BoundedSemaphore(MAX_SHIPPING)
        self.queued_tokens = 0
        self.transfer_bytes_total = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="prefill-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: PrefillJob) -> Future[PrefillResult]:
        vocab = self.runner.config.vocab_size
        if not job.prompt_ids or min(job.prompt_ids) < 0 or max(job.prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be non-empty and in [0, {vocab})")
        if len(job.prompt_ids) > self.runner.config.max_position_embeddings:
            raise ValueError("prompt exceeds the model's context length")
        if not 0 <= job.cached_tokens <= len(job.prompt_ids):
            raise ValueError(f"cached_tokens {job.cached_tokens} is outside the prompt")
        targets = job.reservation.targets
        if any(t.token_ranges for t in targets):
            # SP targets name the prompt positions they cache; together they must be the
            # prompt after the decode group's cached prefix.
            covered = sum(
                hi - lo
                for t in targets
                for lo, hi in zip(t.token_ranges[::2], t.token_ranges[1::2], strict=True)
            )
            if covered != len(job.prompt_ids) - job.cached_tokens:
                raise ValueError(
                    f"the KV targets cover {covered} prompt tokens, the prompt has "
                    f"{len(job.prompt_ids) - job.cached_tokens} to ship: reserve for this prompt"
                )
        if not 0 <= job.num_output_tokens < len(job.prompt_ids):
            raise ValueError("num_output_tokens must be smaller than the prompt")
        if job.params.grammar is not None:
            if self.grammars is None:
                raise GrammarError("structured outputs need the model's tokenizer.json")
            # Compiled here, on the caller's thread, not in the batcher's way.
            outputs = job.prompt_ids[len(job.prompt_ids) - job.num_output_tokens :]
            job = replace(job, matcher=self.grammars.matcher(job.params.grammar, outputs))
        fut: Future[PrefillResult] = Future()
        with self._lock:
            self.queued_tokens += len(job.prompt_ids)
        self._jobs.put((job, fut))
        return fut

    @property
    def queued_requests(self) -> int:
        return self._jobs.qsize() + (self._held is not None)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
        self.runner.close()

    def _next_batch(self) -> list[tuple[PrefillJob, Future[PrefillResult]]] | None:
        """Queued jobs in arrival order, as many as fit `max_batch_tokens` (at least one).

        Only the batcher thread calls this; the job that did not fit opens the next batch."""
        first, self._held = self._held or self._jobs.get(), None
        if first is None:
            return None
        batch, tokens = [first], len(first[0].prompt_ids)
        while tokens < self.max_batch_tokens:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._jobs.put(None)  # finish this batch, then stop
                break
            if tokens + len(item[0].prompt_ids) > self.max_batch_tokens:
                self._held = item
                break
            batch.append(item)
            tokens += len(item[0].prompt_ids)
        return batch

    def _run(self) -> None:
        use_device(self._device)
        while (batch := self._next_batch()) is not None:
            try:
                self._prefill(batch)
            except Exception as exc:  # one bad batch must not kill the worker
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
            finally:
                with self._lock:
                    self.queued_tokens -= sum(len(job.prompt_ids) for job, _ in batch)

    def _prefill(self, batch: list[tuple[PrefillJob, Future[PrefillResult]]]) -> None:
        t0, t0_ns = time.perf_counter(), time.time_ns()
        cache = self.prefix_cache
        hashes = [cache.hashes(job.prompt_ids) if cache is not None else [] for job, _ in batch]
        # A job asking for its prompt's logprobs needs every prompt position's logits: it
        # prefills whole (and still stores its blocks for later prompts).
        pasts: list[PastLatents | None] = [
            cache.lookup(h, len(job.prompt_ids))
            if cache is not None and job.prompt_logprobs is None
            else None
            for h, (job, _) in zip(hashes, batch, strict=True)
        ]
        hits = [p.length if p is not None else 0 for p in pasts]
        # Prompt logprobs need every position's logits: only batches that ask pay for them.
        every = any(job.prompt_logprobs is not None for job, _ in batch)
        plan = BatchPlan(
            tuple(self._plan(job, hit) for (job, _), hit in zip(batch, hits, strict=True)), every
        )
        lens, tokens, device = plan.lens, sum(plan.lens), self.runner.device
        with self.threads.applied(tokens) if self.threads else contextlib.nullcontext():
            out = self.runner.prefill(plan, pasts if any(hits) else None)
        prefill_s = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.prefill_seconds.observe(prefill_s)
            if cache is not None:
                self.metrics.prefix_queries.inc(sum(len(job.prompt_ids) for job, _ in batch))
                self.metrics.prefix_hits.inc(sum(hits))
        start = 0
        for row, (job, fut) in enumerate(batch):
            end = start + lens[row]
            if job.trace is not None:
                job.trace.batched(t0_ns, prefill_s, len(batch), tokens, lens[row], hits[row])
            try:
                if cache is not None:
                    cache.store(hashes[row], out.n, out.k_pe, hits[row], start)
                context = self._context(job, device)
                first = FirstTokens(
                    first_tokens(
                        out.logits[end - 1 if every else row],
                        job.params,
                        job.n,
                        context,
                        position=len(job.prompt_ids),
                    ),
                    ()
                    if job.prompt_logprobs is None
                    else prompt_logprobs(
                        out.logits[start : end - 1], job.prompt_ids, job.prompt_logprobs
                    ),
                    last_hidden(out, end) if self.runner.sends_hidden else (),
                )
                n, k_pe = unshipped(out, start, end, pasts[row], job.cached_tokens)
                self._ship(n, k_pe, job, plan.jobs[row], fut, first, prefill_s, hits[row])
            except Exception as exc:  # this job's error; the batch's other jobs go on
                if not fut.done():
                    fut.set_exception(exc)
            start = end

    def _plan(self, job: PrefillJob, hit: int) -> JobPlan:
        """What every rank needs of `job` (a prefill group's other ranks look up the same
        prefix in their cache replicas, and ship their decode ranks' shards)."""
        res = job.reservation
        order = ShipOrder(
            job.request_id,
            len(job.prompt_ids),
            job.cached_tokens,
            res.block_size,
            res.targets,
            min(job.deadline_s, self.transfer_timeout_s),
        )
        lookup = self.prefix_cache is not None and job.prompt_logprobs is None
        return JobPlan(next(self._seqs), tuple(job.prompt_ids), lookup, hit, order)

    def _context(self, job: PrefillJob, device: torch.device) -> LogitsContext | None:
        """The first tokens' logits processing, one row per choice: the same as every later
        token's at decode. The choices share the prompt and the history before their first
        token, so their rows agree (the grammar's allowed tokens too: one matcher's)."""
        split = len(job.prompt_ids) - job.num_output_tokens
        prompt, outputs = job.prompt_ids[:split], job.prompt_ids[split:]
        eos, vocab = self.runner.config.eos_token_ids, self.runner.config.vocab_size
        allowed = None
        if job.matcher is not None:
            allowed = allowed_now(job.matcher, vocab, device).expand(job.n, -1)
        n = job.n
        return context_for(
            [job.params] * n, [prompt] * n, [outputs] * n, eos, vocab, device, allowed
        )

    def _ship(
        self,
        n: list[Tensor],
        k_pe: list[Tensor],
        job: PrefillJob,
        planned: JobPlan,
        fut: Future[PrefillResult],
        first: FirstTokens,
        prefill_s: float,
        reused: int,
    ) -> None:
        """Push the job's shards to every target rank without waiting for them.

        The batcher goes on to the next batch while they travel (measured in the short-prompt
        mix at 16 streams: a batch of 15 prompts took 320 ms to prefill and then 262 ms to
        push one job after another). `fut` resolves when the last rank acknowledged, or fails
        with the first error; the shards' sends run on the pusher threads.
        """
        # n / k_pe cover what the decode group lacks: prompt positions [skip, N); the runner
        # cuts each target's shard (a prefill group: each rank its own targets').
        self._shipping.acquire()
        t0 = time.perf_counter()
        try:
            timed = job.trace.timed if job.trace is not None else None
            sends = self.runner.ship(planned, n, k_pe, timed)
        except BaseException:  # e.g. the pool is shut down: the job fails, its slot is free
            self._shipping.release()
            raise
        if not sends:
            self._shipping.release()
            self._shipped(fut, first, prefill_s, 0.0, sends, reused)
            return
        remaining = len(sends)
        lock = threading.Lock()

        def arrived(_: Future[int]) -> None:
            nonlocal remaining
            with lock:
                remaining -= 1
                if remaining:
                    return
            self._shipping.release()
            self._shipped(fut, first, prefill_s, time.perf_counter() - t0, sends, reused)

        for send in sends:
            send.add_done_callback(arrived)

    def _shipped(
        self,
        fut: Future[PrefillResult],
        first: FirstTokens,
        prefill_s: float,
        transfer_s: float,
        sends: list[Future[int]],
        reused: int,
    ) -> None:
        """Resolve a job once every one of its sends finished (on the pusher thread that
        finished the last one; on the batcher's when the job had nothing to send)."""
        for send in sends:
            error = (
                TransferError("the prefill worker closed before the KV was pushed")
                if send.cancelled()
                else send.exception()
            )
            if error is not None:
                if not fut.done():
                    fut.set_exception(error)
                return
        sent = sum(send.result() for send in sends)
        with self._lock:
            self.transfer_bytes_total += sent
        if not fut.done():
            fut.set_result(
                PrefillResult(
                    first.tokens[0],
                    prefill_s,
                    transfer_s,
                    sent,
                    reused,
                    first.tokens if len(first.tokens) > 1 else (),
                    first.prompt_logprobs,
                    first.hidden,
                )
            )
        if self.metrics is not None:
            self.metrics.transfer_bytes.labels(self.runner.transport).inc(sent)
            self.metrics.transfer_seconds.labels(self.runner.transport).observe(transfer_s)

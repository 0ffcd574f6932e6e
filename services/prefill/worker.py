"""The prefill worker's core: batch prompts, run exact MLA, sample, ship per-rank shards.

Lifecycle of a job: queued -> batched with whatever else is waiting (up to a token budget) ->
its longest cached prefix looked up in the latent prefix cache (if any) -> one packed exact
prefill of the batch's new tokens, each over its cached prefix (a prompt longer than the
chunk: one chunk per batch over the chunks before it, queued again behind whatever arrived
meanwhile, each chunk's KV pushed while the next computes; `batch/progress.py`) -> its new full
blocks stored in the cache -> first token sampled with the request's params (n of them for
n choices, each from its own generator; the prompt's logprobs too when asked) -> the
latents the decode group lacks (from its Reserve answer on: cached prefix and new tokens
alike) cut into each decode rank's shard (its latent columns, or its token ranges in SP
mode) and pushed over the chosen transport, all ranks and all of the batch's jobs in
parallel, while the next batch already runs -> the job's future resolves when its last
shard is acknowledged. A failed push fails only its job; the decode side frees the
reservation by lease or by the router's abort.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import replace

from torch import Tensor

from common.messages import PrefillResult
from common.model.causal_lm import PrefillOutput
from common.runtime.device import use_device
from common.runtime.errors import Unavailable
from common.runtime.metrics import PrefillMetrics
from common.sampling.first_token import sample_first
from common.sampling.grammar import GrammarCompiler, GrammarError
from common.sampling.prompt_logprobs import prompt_logprobs
from common.sampling.thinking import answer
from services.prefill.batch.batch_plan import BatchPlan, JobPlan
from services.prefill.batch.job import PrefillJob
from services.prefill.batch.latent_cache import LatentPrefixCache
from services.prefill.batch.outputs import FirstTokens, last_hidden
from services.prefill.batch.progress import PromptProgress, default_chunk_tokens
from services.prefill.batch.threads import PrefillThreads
from services.prefill.runner import PrefillRunner
from services.prefill.shipping import ShipOrder, when_all

# Rounds of sends (a job's, or one chunk's) in flight to the decode ranks at once.
MAX_SHIPPING = 64
# A queued prompt: its job, the future its caller waits on, how far its prefill got.
Pending = tuple[PrefillJob, Future[PrefillResult], PromptProgress]


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
        chunk_tokens: int | None = None,
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
        self._held: Pending | None = None  # the next batch's first
        self._jobs: queue.Queue[Pending | None] = queue.Queue()
        # The batcher runs CUDA work on the model's GPU: it makes it current (use_device).
        self._device = runner.device
        # A longer prompt runs one chunk per batch, so activations follow the chunk and
        # shorter prompts queued meanwhile go between its chunks (0: never chunked).
        self.chunk_tokens = (
            default_chunk_tokens(self._device) if chunk_tokens is None else chunk_tokens
        )
        if self.chunk_tokens < 0:
            raise ValueError("chunk_tokens must be >= 0")
        self._seqs = itertools.count()  # each piece's number in the plans
        # Prompts dropped between their pieces since the last plan: a prefill group's other
        # ranks drop what they keep of them (the next plan names them).
        self._dropped: list[str] = []
        # Jobs whose shards are still travelling, at most this many: past it the batcher waits
        # for pushes instead of queueing more batches' latents in memory behind a slow rank.
        self._shipping = threading.BoundedSemaphore(MAX_SHIPPING)
        self.queued_tokens = 0
        self.transfer_bytes_total = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="prefill-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: PrefillJob) -> Future[PrefillResult]:
        job.check(self.runner.config)
        if job.params.grammar is not None:
            if self.grammars is None:
                raise GrammarError("structured outputs need the model's tokenizer.json")
            # Compiled here, on the caller's thread, not in the batcher's way; it reads the
            # request's earlier answer, not its thinking.
            outputs = job.prompt_ids[len(job.prompt_ids) - job.num_output_tokens :]
            replay = answer(job.params, outputs)
            job = replace(job, matcher=self.grammars.matcher(job.params.grammar, replay))
        fut: Future[PrefillResult] = Future()
        with self._lock:
            self.queued_tokens += len(job.prompt_ids)
        progress = PromptProgress(len(job.prompt_ids), self.chunk_tokens)
        self._jobs.put((job, fut, progress))
        return fut

    @property
    def queued_requests(self) -> int:
        return self._jobs.qsize() + (self._held is not None)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
        with contextlib.suppress(queue.Empty):  # prompts between chunks when it stopped
            while True:
                if (item := self._jobs.get_nowait()) is not None:
                    self._counted(item[2], 0)
                    if not item[1].done():
                        item[1].set_exception(Unavailable("the prefill worker stopped"))
        self.runner.close()

    def _next_batch(self) -> list[Pending] | None:
        """Queued prompts in arrival order, as many pieces as fit `max_batch_tokens` (at
        least one); a prompt whose request was cancelled is dropped.

        Only the batcher thread calls this; the piece that did not fit opens the next batch."""
        batch: list[Pending] = []
        tokens = 0
        while tokens < self.max_batch_tokens:
            item, self._held = self._held, None
            if item is None:
                try:
                    item = self._jobs.get() if not batch else self._jobs.get_nowait()
                except queue.Empty:
                    break
            if item is None:
                if batch:
                    self._jobs.put(None)  # finish this batch, then stop
                    break
                return None
            job, fut, progress = item
            if (error := progress.sends.error()) is not None and not fut.done():
                fut.set_exception(error)  # a chunk's push failed: no more chunks
            if fut.done():  # or cancelled (the client left) between its pieces
                self._drop(job, progress)
                continue
            if batch and tokens + progress.piece() > self.max_batch_tokens:
                self._held = item
                break
            batch.append(item)
            tokens += progress.piece()
        return batch

    def _drop(self, job: PrefillJob, progress: PromptProgress) -> None:
        """`job` computes no more pieces (its caller left, or it failed)."""
        self._counted(progress, 0)
        if progress.started and progress.left:
            self._dropped.append(job.request_id)
        progress.release()

    def _counted(self, progress: PromptProgress, left: int) -> None:
        with self._lock:
            self.queued_tokens -= progress.counted - left
            progress.counted = left

    def _run(self) -> None:
        use_device(self._device)
        while (batch := self._next_batch()) is not None:
            going: list[Pending] = []
            try:
                going = self._prefill(batch)
            except Exception as exc:  # one bad batch must not kill the worker
                for _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(exc)
            finally:
                kept = {id(item) for item in going}
                for item in batch:
                    if id(item) in kept:
                        self._counted(item[2], item[2].left)
                    else:
                        self._drop(item[0], item[2])
            for item in going:  # behind whatever arrived meanwhile
                self._jobs.put(item)

    def _prefill(self, batch: list[Pending]) -> list[Pending]:
        """One batch: every prompt's next piece. Returns the prompts with pieces left."""
        t0, t0_ns = time.perf_counter(), time.time_ns()
        cache = self.prefix_cache
        for job, _, progress in batch:
            if not progress.started:
                # A job asking for its prompt's logprobs needs every prompt position's
                # logits: it prefills whole (and still stores its blocks for later prompts).
                hashes = cache.hashes(job.prompt_ids) if cache is not None else []
                use = cache is not None and job.prompt_logprobs is None
                progress.start(hashes, cache.lookup(hashes, progress.length) if use else None)
        pasts = [progress.past() for _, _, progress in batch]
        hits = [progress.done for _, _, progress in batch]
        # Prompt logprobs need every position's logits: only batches that ask pay for them.
        every = any(job.prompt_logprobs is not None for job, _, _ in batch)
        jobs = tuple(self._plan(job, p) for job, _, p in batch)
        plan, self._dropped = BatchPlan(jobs, every, tuple(self._dropped)), []
        lens, tokens = plan.lens, sum(plan.lens)
        with self.threads.applied(tokens) if self.threads else contextlib.nullcontext():
            out = self.runner.prefill(plan, pasts if any(hits) else None)
        computed = time.perf_counter()
        prefill_s = computed - t0
        if self.metrics is not None:
            self.metrics.prefill_seconds.observe(prefill_s)
            if cache is not None:  # once per prompt, at its first piece
                firsts = [(job, p) for job, _, p in batch if p.done == p.cached]
                self.metrics.prefix_queries.inc(sum(len(job.prompt_ids) for job, _ in firsts))
                self.metrics.prefix_hits.inc(sum(p.cached for _, p in firsts))
        going: list[Pending] = []
        start = 0
        for row, item in enumerate(batch):
            job, fut, progress = item
            end = start + lens[row]
            progress.seconds += prefill_s
            if job.trace is not None:
                job.trace.batched(t0_ns, prefill_s, len(batch), tokens, lens[row], progress.cached)
            try:
                self._piece(item, plan.jobs[row], out, (row, start), every, computed, going)
            except Exception as exc:  # this job's error; the batch's other jobs go on
                if not fut.done():
                    fut.set_exception(exc)
            start = end
        return going

    def _piece(
        self,
        item: Pending,
        planned: JobPlan,
        out: PrefillOutput,
        rows: tuple[int, int],
        every: bool,
        computed: float,
        going: list[Pending],
    ) -> None:
        """What one prompt's piece of a batch leads to: its latents kept and the prompt
        queued again when pieces are left, else its first token sampled and its KV shipped."""
        job, fut, progress = item
        row, start = rows  # its index in the batch, its first row in `out`
        whole, before, size = progress.whole, progress.done, progress.piece()
        end = start + size
        if job.prompt_logprobs is not None:
            last = min(before + size, len(job.prompt_ids) - 1)  # no row predicts past the end
            progress.logprobs += prompt_logprobs(
                out.logits[start : start + last - before],
                job.prompt_ids[before : last + 1],
                job.prompt_logprobs,
            )
        progress.advance(out, start, self.prefix_cache)
        # Each chunk's rows ship while the next chunk computes.
        if not whole and progress.done - job.cached_tokens > progress.sends.rows:
            rows = progress.unshipped(out, start, job.cached_tokens)
            self._send(job, planned, progress, *rows)
        if progress.left:
            going.append(item)
            return
        first = FirstTokens(
            sample_first(
                out.logits[end - 1 if every else row],
                job.params,
                job.prompt_ids,
                job.num_output_tokens,
                job.matcher,
                job.n,
                self.runner.config.eos_token_ids,
            ),
            progress.logprobs,
            last_hidden(out, end) if self.runner.sends_hidden else (),
        )
        if whole:
            rows = progress.unshipped(out, start, job.cached_tokens)
            self._send(job, planned, progress, *rows)
        when_all(progress.sends.futures, lambda: self._shipped(fut, first, progress, computed))

    def _plan(self, job: PrefillJob, progress: PromptProgress) -> JobPlan:
        """What every rank needs of `job`'s next piece, numbered apart from every other piece:
        the prompt up to the piece's end, after its first `done` tokens (a prefill group's
        other ranks look its first piece up in their cache replicas, find the same prefix,
        keep the pieces' latents as the worker does and ship their decode ranks' shards)."""
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
        end = progress.done + progress.piece()
        ids = tuple(job.prompt_ids[:end])
        after = job.prompt_ids[end] if end < len(job.prompt_ids) else None
        return JobPlan(next(self._seqs), ids, lookup, progress.done, order, after)

    def _send(
        self,
        job: PrefillJob,
        planned: JobPlan,
        progress: PromptProgress,
        n: list[Tensor],
        k_pe: list[Tensor],
        keys: list[Tensor],
    ) -> None:
        """Push the rows of what the decode group lacks (`n` / `k_pe`: prompt positions from
        `job.cached_tokens` on) that are computed and not yet sent to every target rank,
        without waiting for them.

        The batcher goes on to the next batch (or the prompt's next chunk) while they travel
        (measured in the short-prompt mix at 16 streams: a batch of 15 prompts took 320 ms to
        prefill and then 262 ms to push one job after another); the sends run on the pusher
        threads (a prefill group's other ranks ship their own decode ranks' shards).
        """
        sends = progress.sends
        started = time.perf_counter()
        lo, hi = sends.rows, progress.done - job.cached_tokens
        self._shipping.acquire()
        try:
            timed = job.trace.timed if job.trace is not None else None
            futures = self.runner.ship(planned, n, k_pe, timed, (lo, hi), keys)
        except BaseException:  # e.g. the pool is shut down: the job fails, its slot is free
            self._shipping.release()
            raise
        when_all(futures, self._shipping.release)
        sends.add(futures, hi, started)

    def _shipped(
        self,
        fut: Future[PrefillResult],
        first: FirstTokens,
        progress: PromptProgress,
        computed: float,
    ) -> None:
        """Resolve a finished prompt's job once every one of its sends finished (on the
        pusher thread that finished the last one; on the batcher's when none was left);
        `computed`: when its last chunk's compute ended."""
        sends = progress.sends
        if (error := sends.error()) is not None:
            if not fut.done():
                fut.set_exception(error)
            return
        now = time.perf_counter()
        transfer_s = now - sends.started if sends.futures and sends.started else 0.0
        exposed_s = now - computed if sends.futures else 0.0
        sent = sends.sent_bytes()
        with self._lock:
            self.transfer_bytes_total += sent
        if not fut.done():
            fut.set_result(
                PrefillResult(
                    first.tokens[0],
                    progress.seconds,
                    transfer_s,
                    sent,
                    progress.cached,
                    first.tokens if len(first.tokens) > 1 else (),
                    first.prompt_logprobs,
                    exposed_s,
                    first.hidden,
                )
            )
        if self.metrics is not None:
            transport = self.runner.transport
            self.metrics.transfer_bytes.labels(transport).inc(sent)
            self.metrics.transfer_seconds.labels(transport).observe(transfer_s)
            self.metrics.exposed_transfer_seconds.labels(transport).observe(exposed_s)

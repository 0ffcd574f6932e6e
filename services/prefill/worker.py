"""The prefill worker's core: batch prompts, run exact MLA, sample, ship per-rank shards.

Lifecycle of a job: queued -> batched with whatever else is waiting (up to a token budget) ->
one packed exact prefill -> first token sampled with the request's params (n of them for n
choices, each from its own generator; the prompt's logprobs too when asked) -> the latent cut
into each decode rank's shard (its latent columns, or its token ranges in SP mode) and pushed
over the chosen transport, all ranks and all of the batch's jobs in parallel, while the next
batch already runs -> the job's future resolves when its last shard is acknowledged. A failed
push fails only its job; the decode side frees the reservation by lease or by the router's
abort.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from common.kv.transfer import KvSender, TransferError, cut_shard, staged_on_host
from common.metrics import PrefillMetrics
from common.model.model import DeepseekForCausalLM, PrefillOutput
from common.prefill_threads import PrefillThreads
from common.rpc.convert import KvTargetInfo
from common.sampling import (
    PREFILL_STAGE,
    SampledToken,
    SamplingParams,
    choice_stream,
    make_generator,
    sample_batch,
)

# Jobs in flight to the decode ranks at once (a few batches of short prompts).
MAX_SHIPPING = 64


@dataclass(frozen=True)
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    targets: tuple[KvTargetInfo, ...]
    block_size: int
    deadline_s: float
    n: int = 1  # choices: first tokens to sample
    prompt_logprobs: int | None = None  # set: the prompt's logprobs, this many alternatives


@dataclass(frozen=True)
class FirstTokens:
    """What a job samples from its prefill: each choice's first token, and the logprobs of
    prompt tokens 1..N-1 when asked for (the first has nothing to be predicted from)."""

    tokens: tuple[SampledToken, ...]
    prompt_logprobs: tuple[SampledToken, ...] = ()


@dataclass(frozen=True)
class PrefillDone:
    sampled: FirstTokens
    prefill_seconds: float
    transfer_seconds: float
    transfer_bytes: int

    @property
    def first_token(self) -> SampledToken:
        return self.sampled.tokens[0]


def first_tokens(logits: Tensor, job: PrefillJob) -> tuple[SampledToken, ...]:
    """Choice i's first token from the last prompt position's logits [V], drawn from its
    own generator (stream `choice_stream(i, PREFILL_STAGE)`), so every choice is seeded
    apart and reproducible."""
    gens = [
        make_generator(job.params, logits.device, stream=choice_stream(i, PREFILL_STAGE))
        for i in range(job.n)
    ]
    return tuple(sample_batch(logits[None].expand(job.n, -1), [job.params] * job.n, gens))


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
        model: DeepseekForCausalLM,
        sender: KvSender,
        max_batch_tokens: int = 2048,
        metrics: PrefillMetrics | None = None,
        transfer_timeout_s: float = 30.0,
        threads: PrefillThreads | None = None,
    ) -> None:
        self.model = model
        # None: every batch on the process's current thread count.
        self.threads = threads
        # One push may take at most this long even when the request allows more: a hung
        # decode rank must fail the request, not hold this worker's pushers for minutes.
        self.transfer_timeout_s = transfer_timeout_s
        self.metrics = metrics
        self.sender = sender
        # Prompts per batch fill this many tokens at most (a longer prompt runs alone). Past a
        # few hundred tokens a batch gains no matmul efficiency, while every prompt in it
        # waits for the whole batch and the decode ranks get nothing new meanwhile.
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        self.max_batch_tokens = max_batch_tokens
        self._held: tuple[PrefillJob, Future[PrefillDone]] | None = None  # next batch's first
        self._jobs: queue.Queue[tuple[PrefillJob, Future[PrefillDone]] | None] = queue.Queue()
        self._pushers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-push")
        # Jobs whose shards are still travelling, at most this many: past it the batcher waits
        # for pushes instead of queueing more batches' latents in memory behind a slow rank.
        self._shipping = threading.BoundedSemaphore(MAX_SHIPPING)
        self.queued_tokens = 0
        self.transfer_bytes_total = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="prefill-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: PrefillJob) -> Future[PrefillDone]:
        vocab = self.model.config.vocab_size
        if not job.prompt_ids or min(job.prompt_ids) < 0 or max(job.prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be non-empty and in [0, {vocab})")
        if len(job.prompt_ids) > self.model.config.max_position_embeddings:
            raise ValueError("prompt exceeds the model's context length")
        if any(t.token_ranges for t in job.targets):
            # SP targets name the prompt positions they cache; together they must be the prompt.
            covered = sum(
                hi - lo
                for t in job.targets
                for lo, hi in zip(t.token_ranges[::2], t.token_ranges[1::2], strict=True)
            )
            if covered != len(job.prompt_ids):
                raise ValueError(
                    f"the KV targets cover {covered} prompt tokens, the prompt has "
                    f"{len(job.prompt_ids)}: reserve for this prompt"
                )
        fut: Future[PrefillDone] = Future()
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
        self._pushers.shutdown(wait=False, cancel_futures=True)
        self.sender.close()

    def _next_batch(self) -> list[tuple[PrefillJob, Future[PrefillDone]]] | None:
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

    def _prefill(self, batch: list[tuple[PrefillJob, Future[PrefillDone]]]) -> None:
        t0 = time.perf_counter()
        lens = [len(job.prompt_ids) for job, _ in batch]
        device = self.model.lm_head.weight.device
        ids = torch.tensor(
            [t for job, _ in batch for t in job.prompt_ids], dtype=torch.long, device=device
        )
        # Prompt logprobs need every position's logits: only batches that ask pay for them.
        every = any(job.prompt_logprobs is not None for job, _ in batch)
        with self.threads.applied(len(ids)) if self.threads else contextlib.nullcontext():
            out = self.model.prefill(ids, lens, all_logits=every)
        prefill_s = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.prefill_seconds.observe(prefill_s)
        start = 0
        for row, (job, fut) in enumerate(batch):
            end = start + len(job.prompt_ids)
            try:
                first = FirstTokens(
                    first_tokens(out.logits[end - 1 if every else row], job),
                    ()
                    if job.prompt_logprobs is None
                    else prompt_logprobs(
                        out.logits[start : end - 1], job.prompt_ids, job.prompt_logprobs
                    ),
                )
                self._ship(out, start, end, job, fut, first, prefill_s)
            except Exception as exc:  # this job's error; the batch's other jobs go on
                if not fut.done():
                    fut.set_exception(exc)
            start = end

    def _ship(
        self,
        out: PrefillOutput,
        start: int,
        end: int,
        job: PrefillJob,
        fut: Future[PrefillDone],
        first: FirstTokens,
        prefill_s: float,
    ) -> None:
        """Push the job's shards to every target rank without waiting for them.

        The batcher goes on to the next batch while they travel (measured in the short-prompt
        mix at 16 streams: a batch of 15 prompts took 320 ms to prefill and then 262 ms to
        push one job after another). `fut` resolves when the last rank acknowledged, or fails
        with the first error; the shards' sends run on the pusher threads.
        """
        cut = [
            cut_shard(out.n, out.k_pe, start, end, t, job.request_id, job.block_size)
            for t in job.targets
        ]
        shards = list(zip(staged_on_host(cut), job.targets, strict=True))
        timeout = min(job.deadline_s, self.transfer_timeout_s)
        self._shipping.acquire()
        t0 = time.perf_counter()
        try:
            sends = [
                self._pushers.submit(
                    self.sender.send, shard, t.grpc_address, t.torch_address, timeout
                )
                for shard, t in shards
                if shard.n.shape[1]  # an SP rank may own none of a short prompt
            ]
        except BaseException:  # e.g. the pool is shut down: the job fails, its slot is free
            self._shipping.release()
            raise
        if not sends:
            self._shipping.release()
            self._shipped(fut, first, prefill_s, 0.0, sends)
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
            self._shipped(fut, first, prefill_s, time.perf_counter() - t0, sends)

        for send in sends:
            send.add_done_callback(arrived)

    def _shipped(
        self,
        fut: Future[PrefillDone],
        first: FirstTokens,
        prefill_s: float,
        transfer_s: float,
        sends: list[Future[int]],
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
            fut.set_result(PrefillDone(first, prefill_s, transfer_s, sent))
        if self.metrics is not None:
            self.metrics.transfer_bytes.labels(self.sender.name).inc(sent)
            self.metrics.transfer_seconds.labels(self.sender.name).observe(transfer_s)

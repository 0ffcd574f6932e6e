"""The decode engine: a leader (rank 0, in this process) driving a TP group of ranks.

API (thread-safe; the decode gRPC servicer is a thin shell over it):
    reserve(request_id, prompt_len, max_tokens, prompt_ids, n) -> Reservation
        blocks on every rank, leased (the prompt once, max_tokens per choice; each shard
        landing on rank 0 renews the lease), reusing the longest cached prefix of
        prompt_ids; its targets: where each rank's shard goes
    prefill(request_id, prompt_ids, params, n, ...) -> Future[PrefillResult]
        the group prefills the reserved prompt itself, between its decode steps, and samples
        every choice's first token (leader/local_prefill.py): what a prefill worker does
    generate(request_id, first_tokens, params, prompt_ids, output_ids, resumed) -> TokenStream
        streams every choice's tokens as sampled (a resumed choice's after its replay)
    abort(request_id, choices)   at any time; blocks are freed
    load() -> DecodeLoad         running, waiting, blocks used / total
    drain()                      reserve no more (scale-in); live() -> count
    probe                        what benchmarks, metrics and tests observe of the steps
A local tool writes a prompt's KV in process: services/decode/local_kv.py.

Start-up: services/decode/group/start.py. All collectives run on one loop thread
(services/decode/leader/loop.py): each call here is a command it runs between two decode
steps (services/decode/leader/step.py).

n > 1 choices: the prompt's KV arrives once; `generate` forks it into n sequences (shared
full blocks, a copied last block: see Scheduler) that decode side by side in the batch, each
with its own draw keys and controls (penalty counts, grammar state: forked from the
request's at its first token), into one TokenStream with each event's choice index. A
migrated n > 1 request's choices are such forks too (`resumed`): each first replays the
tokens it generated on the group it left, then samples on.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from common.kv.block_pool import RankPools
from common.kv.prefix_cache import block_hashes, model_identity
from common.messages import DecodeLoad, PrefillResult, Reservation, ResumedChoice
from common.runtime.errors import Unavailable
from common.sampling.params import SamplingParams
from common.step_shapes import StepShape
from services.decode.config import EngineConfig, SpecConfig
from services.decode.group.start import start_group
from services.decode.leader.drafts import check_proposer
from services.decode.leader.kv_targets import epoch_plan, reservation
from services.decode.leader.local_prefill import LocalPrefill, LocalPrefills
from services.decode.leader.loop import LeaderLoop
from services.decode.leader.scheduler import Scheduler, SchedulerError, SeqState
from services.decode.leader.step import DecodeStep
from services.decode.stream import TokenStream


class DecodeEngine:
    """A decode group's leader: the API above over its scheduler, pool and loop."""

    def __init__(self, cfg: EngineConfig, *, eos_token_ids: tuple[int, ...] | None = None) -> None:
        self.group = start_group(cfg)
        self.cfg = cfg = self.group.cfg
        self.runtime = self.group.runtime
        model_cfg = self.runtime.model.config
        eos = model_cfg.eos_token_ids if eos_token_ids is None else eos_token_ids
        self.eos_token_ids = frozenset(eos)
        max_len = cfg.context_limit(model_cfg.max_position_embeddings)
        self.pool = RankPools(
            self.runtime.cache.usable_blocks,
            cfg.block_size,
            cfg.parallel,
            prefix_cache=cfg.prefix_cache,
        )
        # The root of this group's block hash chains: the model and its side file.
        self.prefix_root = model_identity(cfg.model, cfg.reparam) if cfg.prefix_cache else 0
        self.scheduler = Scheduler(self.pool, cfg.max_batch, max_len)
        self._step = DecodeStep(self.group, self.scheduler, self.eos_token_ids)
        self.controls, self.probe = self._step.controls, self._step.probe
        # 0 where the ranks hold no prefill pass (asked for none, or a model it cannot run).
        local_chunk = cfg.local_prefill_chunk_tokens if self.runtime.prefills is not None else 0
        self.prefills = LocalPrefills(
            self._step.ranks,
            self.scheduler,
            local_chunk,
            self.eos_token_ids,
            cfg.lease_seconds,
        )
        self._loop = LeaderLoop(self.group, self.scheduler, self._step, self.prefills)
        self.runtime.landed = self._renew
        # The last load the loop answered: what a heartbeat reports while a long step keeps
        # the loop from answering (see services/decode/server/records.py).
        self.last_load: DecodeLoad | None = None
        # Told to go: reserves nothing more, while what it admitted runs to its end.
        self.draining = False
        self._epochs = itertools.count(1)  # each reservation's (common/kv/epochs.py)
        if self.runtime.device.type == "cuda":
            # Compiles every kernel variant and captures every bucket's graph before the
            # group serves: a first request's step that compiled would run for seconds.
            try:
                self.warm_up()
            except BaseException:
                self.shutdown()
                raise

    def warm_up(self) -> None:
        """A step of padding rows at every bucket on every rank (`DecodeStep.warm_up`); it
        leaves no trace but compiled kernels and captured graphs. Start-up runs it on CUDA."""
        self._loop.call(self._step.warm_up)

    @property
    def shapes(self) -> list[StepShape]:
        """Every shape a step is padded to, as this group speculates (DecodePlans.shapes):
        one CUDA graph each where the ranks capture them."""
        spec, mtp = self._step.speculation.spec, self.runtime.model.mtp is not None
        return self._step.plans.shapes(spec, mtp)

    def reserve(
        self,
        request_id: str,
        prompt_len: int,
        max_tokens: int,
        prompt_ids: Sequence[int] = (),
        n: int = 1,
    ) -> Reservation:
        """Blocks for the prompt once and max_tokens for each of the n choices, on every
        rank. With `prompt_ids` (and prefix caching on), the blocks of the longest cached
        prefix are reused: `cached_tokens` of them."""
        if self.draining:
            # Unavailable: the router tries another group (and skips this one meanwhile).
            raise Unavailable("the decode group is draining", code="draining")
        if prompt_ids and len(prompt_ids) != prompt_len:
            raise SchedulerError(f"{len(prompt_ids)} prompt ids for a prompt of {prompt_len}")
        size = self.cfg.block_size
        hashes = block_hashes(self.prefix_root, prompt_ids, size) if self.cfg.prefix_cache else []

        def run() -> Reservation:
            deadline = time.monotonic() + self.cfg.lease_seconds
            tables = self.scheduler.reserve(
                request_id, prompt_len, max_tokens, deadline, hashes, n, tuple(prompt_ids)
            )
            cached = self.scheduler.seqs[request_id].cached_tokens
            # The blocks are this reservation's before its targets leave: a late push of the
            # one they served before is dropped from now on, on every rank.
            epoch = next(self._epochs)
            forks = [seq.seq_id for seq in self.scheduler.forks(request_id)]
            self._step.ranks.give_blocks(epoch_plan(self.pool, forks, epoch))
            return reservation(self.group, self.pool, request_id, tables, prompt_len, cached, epoch)

        return self._loop.call(run)

    def prefill(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        n: int = 1,
        num_output_tokens: int = 0,
        prompt_logprobs: int | None = None,
    ) -> Future[PrefillResult]:
        """Prefill the reserved request's prompt on this group, a piece between decode steps,
        and sample each of its n choices' first token: a `PrefillResult` as a prefill worker
        answers, its KV in place for `generate`. The last `num_output_tokens` of `prompt_ids`
        are the request's own earlier output (a migrated request); `prompt_logprobs`: the
        prompt's logprobs with this many alternatives. Cancel the future to drop it."""
        vocab = self.runtime.model.config.vocab_size
        if not prompt_ids or min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise SchedulerError(f"prompt token ids must be non-empty and in [0, {vocab})")
        if not 0 <= num_output_tokens < len(prompt_ids):
            raise SchedulerError("num_output_tokens must be smaller than the prompt")
        history = prompt_ids[len(prompt_ids) - num_output_tokens :]
        # Compiled here, off the loop thread, as `generate` compiles its own.
        matcher = self.controls.matcher(params, history)
        job = LocalPrefill(
            request_id,
            tuple(prompt_ids),
            params,
            n,
            num_output_tokens,
            prompt_logprobs,
            matcher,
        )
        self._loop.call(lambda: self.prefills.submit(job))
        return job.future

    def generate(
        self,
        request_id: str,
        first_tokens: int | list[int],
        params: SamplingParams,
        prompt_ids: Sequence[int] = (),
        output_ids: Sequence[int] = (),
        resumed: Sequence[ResumedChoice] = (),
        hidden: Tensor | Sequence[float] | None = None,
    ) -> TokenStream:
        """Start the reserved request from each choice's first token (one per choice it was
        reserved for); its stream carries every choice's events. `output_ids`: what the
        request generated before on another group (a migrated n = 1 request); `prompt_ids`:
        its prompt, needed only for a repetition penalty. Both feed the penalties and grammar.
        `resumed` (a migrated n > 1 request): the choice each fork continues and the tokens
        it replays after its first token before it samples again (`DecodeStep.start`).
        `hidden`: the prefill's hidden state at the prompt's last position (before the final
        norm), from which mtp drafts start at the first step."""
        firsts = [first_tokens] if isinstance(first_tokens, int) else list(first_tokens)
        last = None if hidden is None else torch.as_tensor(hidden, dtype=torch.float32)
        if resumed and (output_ids or len(resumed) != len(firsts)):
            raise SchedulerError("resumed choices need one first token each and no output_ids")
        stream = TokenStream(len(firsts))
        # The grammar is compiled and replayed here, off the loop thread: a new schema must
        # not stall the running sequences' steps. Each choice's copy takes its first token.
        matcher = self.controls.matcher(params, output_ids)
        self._loop.call(
            lambda: self._step.start(
                request_id, firsts, params, matcher, prompt_ids, output_ids, stream, resumed, last
            )
        )
        return stream

    def drain(self) -> None:
        """Admit no new request (`reserve` raises Unavailable); the reserved and running ones
        go on. The service waits for `live()` to reach 0 before it shuts the group down."""
        self.draining = True

    def live(self, timeout: float | None = None) -> int:
        """Requests the group holds (running, waiting for their first step, reserved): what
        a drain waits for. EngineError if the loop does not answer within `timeout`."""
        load = self.load(timeout)
        return load.running + load.waiting + load.reserved

    def abort(self, request_id: str, choices: frozenset[int] | None = None) -> bool:
        """End the request's live choices (only `choices` when given); whether any was."""
        return self._loop.call(lambda: self._step.abort(request_id, choices))

    def load(self, timeout: float | None = None) -> DecodeLoad:
        """The group's load; EngineError if the loop does not answer within `timeout`."""

        def run() -> DecodeLoad:
            reserved = sum(s.state is SeqState.RESERVED for s in self.scheduler.seqs.values())
            return DecodeLoad(
                self.scheduler.num_running,
                self.scheduler.num_waiting,
                reserved,
                self.pool.num_used,
                self.pool.num_blocks,
                self.cfg.block_size,
                blocks_cached=self.pool.num_cached,
                prefix_queried_tokens=self.scheduler.prefix_queried_tokens,
                prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
            )

        self.last_load = self._loop.call(run, timeout)
        return self.last_load

    def cached_hashes(self, limit: int, timeout: float | None = None) -> list[int]:
        """Up to `limit` block hashes this group holds, most recently used first (what it
        publishes for KV-aware routing); EngineError if the loop does not answer in time."""
        return self._loop.call(lambda: self.pool.recent_hashes(limit), timeout)

    def run_between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the loop thread between two decode steps and return its result: every
        running sequence waits for it (a colocated server's prefill does exactly this)."""
        return self._loop.call(fn)

    def speculate(self, spec: SpecConfig) -> None:
        """Speculative decoding as `spec` says from the next step on, for requests started
        from then on (`tpla bench`, tests: one group serves with and without). Outputs do
        not change with it (docs/design.md §7)."""
        check_proposer(spec, self.cfg.model, self.runtime.model.mtp is not None)
        self._loop.call(lambda: self._step.speculation.use(spec))

    def follower_alive(self) -> list[bool]:
        """Whether each rank's process is running: rank 0 (this process) while its loop
        has not failed, then each follower (GroupProcesses.alive)."""
        return [self._loop.error is None, *self.group.processes.alive()]

    @property
    def follower_pids(self) -> list[int]:
        """Each follower's pid, as it introduced itself (on its own host)."""
        return self.group.processes.pids

    @property
    def failed(self) -> BaseException | None:
        return self._loop.error

    def step_running_for(self) -> float:
        """Seconds the current decode step has been running (0 between steps): a step that
        never ends means a rank hangs, and the group reports itself unhealthy."""
        return self._loop.step_running_for()

    def shutdown(self) -> None:
        self._loop.stop()
        self.group.stop()

    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _renew(self, request_id: str) -> None:
        """A shard of the request landed on rank 0 (a receiver thread): its reservation's
        lease runs another lease period from now. Posted, not waited for: the shard's
        acknowledgement must not wait out a decode step."""
        deadline = time.monotonic() + self.cfg.lease_seconds
        self._loop.post(lambda: self.scheduler.renew(request_id, deadline))

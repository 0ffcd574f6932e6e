"""The leader's decode step: each live choice's next token, sampled, streamed, and its finish.

A choice is live from its first token (`start`) until it finishes or is aborted: it holds
its sampling params, the seed its draws are keyed by, its controls (penalty counts, grammar
state) and the stream its events go to. Each step sends the batch's plan to every rank,
gathers the logits, samples every live choice's next token at once, streams it, and decides
in one place (`finish_reason`) whether the token ends its choice. A resumed choice (a
migrated n > 1 request's) first replays the tokens it generated on the group it left: steps
that feed them in place of what it samples. Runs on the leader's loop thread only.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from common.messages import FailureScope, ResumedChoice, TokenEvent
from common.runtime.host_syncs import HostSyncCounter, host_side
from common.runtime.transfers import to_device, to_host
from common.sampling.grammar import GrammarMatcher
from common.sampling.keyed import DrawKey
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken, request_seed, sample_batch
from services.decode.group.buckets import batch_bucket, batch_buckets, width_bucket, width_buckets
from services.decode.group.start import RunningGroup
from services.decode.group.step_plan import CopyPlan, DecodePlan, MtpPlan, send_plan
from services.decode.leader.controls import SequenceControls, StepControls
from services.decode.leader.drafts import MtpDrafts, Proposer, check_proposer, proposer
from services.decode.leader.mtp_plan import fed_drafts, fed_rows, mtp_plan, start_copy
from services.decode.leader.scheduler import DecodeSequence, Scheduler
from services.decode.leader.speculation import Acceptance
from services.decode.leader.verify import StepRows, draft_room, kept_tokens
from services.decode.stream import TokenStream


@dataclass
class LiveChoice:
    """One choice of a request, from its first token until it ends."""

    params: SamplingParams
    stream: TokenStream
    seed: int  # its draws' key with (choice, position): the request's seed or one drawn
    controls: SequenceControls
    choice: int = 0  # its index in the request (a resumed choice's need not be its fork's)
    # A resumed choice's own earlier tokens, still to be fed in place of its samples.
    replay: deque[int] = field(default_factory=deque)
    drafts: Proposer | None = None  # its draft proposer (speculative decoding on)


class DecodeStep:
    """The step and the live choices of one group's leader."""

    def __init__(
        self, group: RunningGroup, scheduler: Scheduler, eos_token_ids: frozenset[int]
    ) -> None:
        cfg, runtime = group.cfg, group.runtime
        self.group, self.scheduler, self.eos_token_ids = group, scheduler, eos_token_ids
        self.live: dict[str, LiveChoice] = {}
        vocab_size = runtime.model.config.vocab_size
        self.controls = StepControls(
            cfg.model, vocab_size, eos_token_ids, cfg.max_batch, runtime.device, cfg.grammar_limits
        )
        # Rank k's logits are padded to a common width for the gather; these columns of the
        # gathered row are the real vocabulary, in order (None: the first vocab_size, when
        # only the last rank's slice is short or none is). Computed once, used every step.
        columns = cfg.parallel.vocab_columns(vocab_size)
        self._vocab_size = vocab_size
        self._vocab_columns = (
            None
            if columns == list(range(len(columns)))
            else to_device(columns, runtime.device, torch.int64)
        )
        # `tpla bench decode-step`: count each step's host waits on every rank; the most
        # on any rank (the leader's sampling included) of the last step.
        self.count_host_syncs = False
        # Steps padded to their buckets: where the ranks replay a CUDA graph per bucket. A
        # CPU step is not padded: a padding row or block is work for nothing there.
        self.bucketed = runtime.graphs is not None
        self.last_host_syncs = 0
        check_proposer(cfg.speculative, cfg.model, runtime.model.mtp is not None)
        self.spec = cfg.speculative
        self.acceptance = Acceptance()

    def start(
        self,
        request_id: str,
        firsts: list[int],
        params: SamplingParams,
        matcher: GrammarMatcher | None,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        stream: TokenStream,
        resumed: Sequence[ResumedChoice] = (),
        hidden: Tensor | None = None,
    ) -> None:
        """The reserved request's choices go live from their first tokens (see
        `DecodeEngine.generate`); a choice its first token ends finishes at once.

        `resumed` (one per fork): fork i continues choice resumed[i].index, from that
        choice's own first token, with its own draw keys, and feeds its resumed[i].replay
        tokens before it samples again. The replay steps compute those tokens' KV as the
        group it left did, count them in its penalties and move its grammar, so the choice
        then samples as it would have there (its keys are its positions': nothing to
        advance)."""
        seqs = self.scheduler.start(request_id, firsts)
        self._copy_blocks(seqs)
        # The request's controls before its first tokens, forked once per choice.
        base = self.controls.start(params, matcher, prompt_ids, output_ids)
        controls = [base, *(self.controls.fork(base) for _ in seqs[1:])]
        self.controls.advance(controls, firsts)
        seed = request_seed(params)
        spec = self.spec
        prompt = prompt_ids or seqs[0].prompt_ids
        for k, (seq, ctl) in enumerate(zip(seqs, controls, strict=True)):
            choice = resumed[k].index if resumed else seq.choice
            replay = deque(resumed[k].replay if resumed else ())
            live = LiveChoice(params, stream, seed, ctl, choice, replay)
            if spec.enabled:
                # The prefill's last hidden state seeds mtp drafts (a fresh request's only).
                last = None if output_ids or resumed else hidden
                output = [*output_ids, seq.generated[0]]
                live.drafts = proposer(spec, prompt, output, last, seq.next_position - 1)
            self.live[seq.seq_id] = live
        for seq in seqs:
            live = self.live[seq.seq_id]
            if live.replay:
                continue  # its first token did not end it on the group it left
            reason = self.finish_reason(live, seq.generated[0], 1, seq.max_tokens)
            if reason is not None:
                self.scheduler.finish(seq.seq_id)
                self.drop(seq.seq_id)
                live.stream.put(_event(live, None, reason))

    def run(self, batch: list[DecodeSequence]) -> None:
        """One step of every running sequence: each one's next token, or with drafts the
        tokens it keeps of them (leader/verify.py), streamed."""
        counter = HostSyncCounter() if self.count_host_syncs else nullcontext()
        with counter:
            lives = [self.live[seq.seq_id] for seq in batch]
            rows = StepRows(self._drafts(batch, lives))
            positions = [seq.next_position for seq in batch]
            sizes = rows.sizes
            params = [live.params for live, n in zip(lives, sizes, strict=True) for _ in range(n)]
            processed = any(p.processed for p in params)
            logits, rank_syncs, fed = self._logits(batch, rows, self._mtp(lives, rows))
            copied = None
            if fed is not None and rows.speculative:
                if processed:  # the processors count the drafts: read them first
                    fed = to_host(fed)
                    with host_side():
                        rows = fed_drafts(fed, rows)
                else:  # read after the sampler's one wait, which this copy precedes
                    copied = start_copy(fed)
            context = None
            if processed:
                context = self.controls.context(
                    [live.controls for live in lives],
                    [len(seq.generated) for seq in batch],
                    rows.drafts if rows.speculative else None,
                )
            keys = [
                DrawKey(live.seed, live.choice, seq.next_position + 1 + j)
                for seq, live, n in zip(batch, lives, sizes, strict=True)
                for j in range(n)
            ]
            sampled = rows.split(sample_batch(logits, params, keys, context))
            if copied is not None:
                with host_side():
                    rows = fed_drafts(copied, rows)
            runs = [kept_tokens(d, s) for d, s in zip(rows.drafts, sampled, strict=True)]
            replayed = [bool(live.replay) for live in lives]
            if any(replayed):
                _replay(lives, runs)
            reasons = self._finishes(batch, lives, runs, replayed, processed)
        if isinstance(counter, HostSyncCounter):
            assert rank_syncs is not None
            self.last_host_syncs = max([counter.count, *rank_syncs.tolist()])
        record = self.group.cfg.record_logits
        kept = logits.to("cpu", copy=True) if record else None
        for s, (seq, live, start) in enumerate(zip(batch, lives, rows.starts, strict=True)):
            # The step's drafts and kept drafts ride on its first event for the choice, so
            # a caller's sum holds them even when it stops the stream early (a stop string).
            spec = (len(rows.drafts[s]), len(runs[s]) - 1) if rows.drafts[s] else (0, 0)
            if rows.drafts[s]:
                self.acceptance.record(*spec)
            events = []
            for i, reason in enumerate(reasons[s]):
                tok = runs[s][i]
                if replayed[s]:
                    # Sent before, and it did not end the choice there. An empty event keeps
                    # the caller's wait for the next token from timing out over a long replay.
                    events.append(TokenEvent(None, index=live.choice))
                    self.scheduler.append(seq.seq_id, tok.token_id, finished=False)
                    continue
                logits_row = kept[start + i].clone() if kept is not None else None
                events.append(_event(live, tok, reason, logits_row, spec))
                spec = (0, 0)
                self.scheduler.append(seq.seq_id, tok.token_id, finished=reason is not None)
                if reason is not None:
                    self.drop(seq.seq_id)
            live.stream.put(*events)
            if isinstance(live.drafts, MtpDrafts):
                live.drafts.kept(
                    start, positions[s], [t.token_id for t in runs[s][: len(reasons[s])]]
                )
            elif live.drafts is not None:
                live.drafts.extend(t.token_id for t in runs[s][: len(reasons[s])])

    def _finishes(
        self,
        batch: list[DecodeSequence],
        lives: list[LiveChoice],
        runs: list[list[SampledToken]],
        replayed: list[bool],
        processed: bool,
    ) -> list[list[str | None]]:
        """Each sequence's finish reason token by token, through the first token that ends
        it: its controls advance one token at a time, as over plain steps, so a stop, a
        length or a grammar failure ends a run of kept drafts exactly where plain decoding
        ends."""
        reasons: list[list[str | None]] = [[] for _ in batch]
        going = list(range(len(batch)))
        i = 0
        while going := [s for s in going if i < len(runs[s])]:
            if processed:
                tokens = [runs[s][i].token_id for s in going]
                self.controls.advance([lives[s].controls for s in going], tokens)
            for s in going:
                seq, token = batch[s], runs[s][i].token_id
                generated = len(seq.generated) + i + 1
                reason = (
                    None
                    if replayed[s]
                    else self.finish_reason(lives[s], token, generated, seq.max_tokens)
                )
                reasons[s].append(reason)
            going = [s for s in going if reasons[s][-1] is None]
            i += 1
        return reasons

    def _drafts(self, batch: list[DecodeSequence], lives: list[LiveChoice]) -> list[list[int]]:
        """Each sequence's drafts for this step: none above the speculation batch limit or
        while replaying; at most k, what its max_tokens leaves room for (`draft_room`), and
        rows for the whole step within max_batch, so a speculative step fits a batch bucket
        (its CUDA graph) and the grammar bitmask."""
        spec = self.spec
        if not spec.speculates(len(batch)):
            return [[] for _ in batch]
        budget = self.scheduler.max_batch - len(batch)
        out = []
        for seq, live in zip(batch, lives, strict=True):
            k = min(spec.tokens, draft_room(seq.max_tokens, len(seq.generated)), budget)
            # A proposer of another method than the step's (speculate() switched it) idles.
            own = isinstance(live.drafts, MtpDrafts) == (spec.method == "mtp")
            ok = k > 0 and own and not live.replay
            drafts = live.drafts.propose(k) if ok and live.drafts is not None else []
            budget -= len(drafts)
            out.append(drafts)
        return out

    def finish_reason(
        self, live: LiveChoice, token: int, generated: int, max_tokens: int
    ) -> str | None:
        """Why `token`, a choice's `generated`-th, ends it: a structured output the grammar
        could not go on with (the request's own failure), a stop token, "length" at the
        `max_tokens` its blocks were reserved for; None while it goes on."""
        if live.controls.failed:  # before a stop token: the token is outside the grammar
            return f"error: {live.controls.failure}"
        return live.params.finish_reason(token, generated, self.eos_token_ids, max_tokens)

    def abort(self, request_id: str, choices: frozenset[int] | None) -> bool:
        """End the request's live choices (only `choices`, the request's indices, when
        given); whether any was."""
        if choices is not None:
            # The scheduler knows forks; a resumed choice's index need not be its fork's.
            choices = frozenset(
                seq.choice
                for seq in self.scheduler.forks(request_id)
                if self._index(seq) in choices
            )
        ended = self.scheduler.abort(request_id, choices)
        for seq in ended:
            live = self.drop(seq.seq_id)
            if live is not None:
                live.stream.put(TokenEvent(None, "abort", index=live.choice))
        return bool(ended)

    def _index(self, seq: DecodeSequence) -> int:
        """The fork's choice index in its request."""
        live = self.live.get(seq.seq_id)
        return live.choice if live is not None else seq.choice

    def drop(self, seq_id: str) -> LiveChoice | None:
        """The choice is no longer live (its controls' rows are free again)."""
        live = self.live.pop(seq_id, None)
        if live is not None:
            self.controls.release(live.controls)
        return live

    def end_all(self, message: str) -> None:
        """Every live choice ends with the group's failure `message`: no stream waits forever."""
        for live in self.live.values():
            live.stream.put(TokenEvent.failed(FailureScope.GROUP, message, live.choice))
        self.live.clear()

    def _mtp(self, lives: list[LiveChoice], rows: StepRows) -> MtpPlan | None:
        """The step's MTP draft pass: in a step that speculates (the batch within the
        speculation limit), over every mtp sequence's pending positions. A step that does
        not leaves the MTP cache at its positions unwritten: later drafts read stale
        latents there, which costs acceptance, never a token."""
        if self.spec.method != "mtp" or not self.spec.speculates(len(lives)):
            return None
        hidden = self.group.runtime.model.config.hidden_size
        return mtp_plan([live.drafts for live in lives], rows, hidden)

    def _logits(
        self, batch: list[DecodeSequence], rows: StepRows, mtp: MtpPlan | None = None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The batch's plan (at its bucket where steps are padded), run by every rank: the
        rows' logits [N, V], each follower's host waits in its step when counted, and with a
        draft pass the fed tokens' rows (`fed_rows`, on the device)."""
        plan = dataclasses.replace(self.plan(batch, rows), mtp=mtp)
        runtime, par = self.group.runtime, self.group.cfg.parallel
        if par.tp > 1:
            send_plan(plan, runtime.comm)
        local = runtime.step(plan)
        parts = runtime.comm.gather(local)
        assert parts is not None  # rank 0
        rank_syncs = parts[1:, -1, 0] if plan.count_syncs else None
        fed = fed_rows(parts, len(plan.tokens)) if mtp is not None else None
        # [tp, N, V / tp] real rows -> [N, tp * V / tp]: one copy (none at tp = 1).
        n = rows.total
        real = parts[:, :n]
        logits = real[0] if par.tp == 1 else real.transpose(0, 1).reshape(n, -1)
        if self._vocab_columns is None:
            return logits[:, : self._vocab_size], rank_syncs, fed
        return logits[:, self._vocab_columns], rank_syncs, fed

    def buckets(self) -> list[tuple[int, int]]:
        """Every (batch, table width) a step can be padded to, largest first."""
        max_blocks = -(-self.scheduler.max_model_len // self.group.cfg.block_size)
        sizes = batch_buckets(self.scheduler.max_batch)
        return sorted(((b, w) for b in sizes for w in width_buckets(max_blocks)), reverse=True)

    def warm_up(self) -> None:
        """A step of padding rows at every bucket, on every rank: it compiles each kernel
        variant and captures each bucket's CUDA graph (rank/graphs.py) before the group
        serves, so no request's step pays for either. Largest first: the first step grows the
        workspaces to their final size. Padding rows write only the trash slot."""
        runtime, par = self.group.runtime, self.group.cfg.parallel
        ranks = par.token_ranks
        for size, width in self.buckets():
            zeros = torch.zeros(size, dtype=torch.int64)
            plan = DecodePlan(zeros, zeros, torch.full((ranks, size, width), -1))
            if par.tp > 1:
                send_plan(plan, runtime.comm)
            runtime.comm.gather(runtime.step(plan))

    def plan(self, batch: list[DecodeSequence], rows: StepRows | None = None) -> DecodePlan:
        """The step's plan: a row per fed token (a sequence's last token, then its drafts at
        the positions after it, each row with the sequence's tables), every table cut to the
        blocks under every row's position (padded with -1 for shorter rows). Where the ranks
        replay captured steps (`bucketed`), at its bucket (services/decode/group/buckets.py):
        the rows padded with rows of token 0 at position 0 and an all -1 table (each rank
        writes them to its trash slot; their logits are dropped), the tables padded to the
        bucket's width."""
        rows = rows or StepRows([[] for _ in batch])
        pool, scheduler = self.scheduler.pool, self.scheduler
        bs = self.group.cfg.block_size
        par = self.group.cfg.parallel
        ranks = par.token_ranks
        per_seq = [pool.tables(s.seq_id) for s in batch]
        sizes = rows.sizes
        blocks = max(
            -(-pool.local_tokens(k, s.next_position + n) // bs)
            for s, n in zip(batch, sizes, strict=True)
            for k in range(ranks)
        )
        width, size = max(blocks, 1), rows.total
        if self.bucketed:
            width = width_bucket(width, -(-scheduler.max_model_len // bs))
            size = batch_bucket(size, max(scheduler.max_batch, size))
        pad_row = [-1] * width
        tables = [
            [
                [*tables[k][:width], *pad_row[: max(width - len(tables[k]), 0)]]
                for tables, n in zip(per_seq, sizes, strict=True)
                for _ in range(n)
            ]
            + [pad_row] * (size - rows.total)
            for k in range(ranks)
        ]
        pad = [0] * (size - rows.total)
        tokens = [t for s, d in zip(batch, rows.drafts, strict=True) for t in (s.last_token, *d)]
        positions = [
            s.next_position + j for s, n in zip(batch, sizes, strict=True) for j in range(n)
        ]
        return DecodePlan(
            torch.tensor(tokens + pad),
            torch.tensor(positions + pad),
            torch.tensor(tables, dtype=torch.int64),
            self.count_host_syncs,
        )

    def _copy_blocks(self, seqs: list[DecodeSequence]) -> None:
        """Every rank copies the forks' own blocks from the prompt's (before their first
        step): one plan for all of a request's forks."""
        pools = self.scheduler.pool.pools
        per_pool = [
            [pair for seq in seqs for pair in (seq.block_copies[k] if seq.block_copies else [])]
            for k in range(len(pools))
        ]
        width = max(len(p) for p in per_pool)
        if not width:
            return
        pairs = torch.full((len(per_pool), width, 2), -1, dtype=torch.int64)
        for k, pool_pairs in enumerate(per_pool):
            if pool_pairs:
                pairs[k, : len(pool_pairs)] = torch.tensor(pool_pairs, dtype=torch.int64)
        plan = CopyPlan(pairs)
        if self.group.cfg.parallel.tp > 1:
            send_plan(plan, self.group.runtime.comm)
        self.group.runtime.copy_blocks(plan)


def _replay(lives: list[LiveChoice], runs: list[list[SampledToken]]) -> None:
    """Each replaying choice's next own earlier token in place of what it sampled (it is
    fed no drafts)."""
    for row, live in enumerate(lives):
        if live.replay:
            runs[row] = [SampledToken(live.replay.popleft(), 0.0)]


def _event(
    live: LiveChoice,
    token: SampledToken | None,
    reason: str | None,
    logits: Tensor | None = None,
    spec: tuple[int, int] = (0, 0),
) -> TokenEvent:
    """The choice's event for `token`; one whose grammar failed ends without it (never sent)."""
    if live.controls.failed:
        return TokenEvent.failed(FailureScope.REQUEST, live.controls.failure, live.choice)
    return TokenEvent(token, reason, logits, live.choice, *spec)

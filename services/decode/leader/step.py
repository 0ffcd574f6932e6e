"""The leader's decode step: each live choice's next token, sampled, streamed, and its finish.

A choice is live from its first token (`start`) until it finishes or is aborted: it holds
its sampling params, the seed its draws are keyed by, its controls (penalty counts, grammar
state) and the stream its events go to. Each step sends the batch's plan to every rank,
gathers the logits, samples every live choice's next token at once (with speculation on,
the tokens it keeps of its drafts: leader/speculation.py), streams it, and decides in one
place (`finish_reason`) whether the token ends its choice. A resumed choice (a
migrated n > 1 request's) first replays the tokens it generated on the group it left: steps
that feed them in place of what it samples. Runs on the leader's loop thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from contextlib import nullcontext

from torch import Tensor

from common.messages import FailureScope, ResumedChoice, TokenEvent
from common.runtime.host_syncs import HostSyncCounter
from common.sampling.grammar import GrammarMatcher
from common.sampling.keyed import DrawKey
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken, request_seed, sample_batch
from services.decode.group.start import RunningGroup
from services.decode.leader.controls import StepControls
from services.decode.leader.decode_plans import DecodePlans
from services.decode.leader.drafts import check_proposer
from services.decode.leader.live_choice import LiveChoice
from services.decode.leader.probe import StepProbe
from services.decode.leader.ranks import Ranks
from services.decode.leader.scheduler import DecodeSequence, Scheduler
from services.decode.leader.speculation import Speculation, SpeculativeStep
from services.decode.stream import TokenStream


class DecodeStep:
    """The step and the live choices of one group's leader."""

    def __init__(
        self, group: RunningGroup, scheduler: Scheduler, eos_token_ids: frozenset[int]
    ) -> None:
        cfg, runtime = group.cfg, group.runtime
        self.group, self.scheduler, self.eos_token_ids = group, scheduler, eos_token_ids
        self.live: dict[str, LiveChoice] = {}
        model = runtime.model.config
        self.controls = StepControls(
            cfg.model,
            model.vocab_size,
            eos_token_ids,
            cfg.max_batch,
            runtime.device,
            cfg.grammar_limits,
        )
        self.ranks = Ranks(group)
        self.probe = StepProbe(record_logits=cfg.record_logits)
        # Steps padded to their buckets where the ranks replay a CUDA graph per bucket.
        self.plans = DecodePlans(scheduler, cfg, bucketed=runtime.graphs is not None)
        check_proposer(cfg.speculative, cfg.model, runtime.model.mtp is not None)
        self.speculation = Speculation(cfg.speculative, model.hidden_size, self.probe.acceptance)

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
        copies = self.plans.copies(seqs)
        if copies is not None:
            self.ranks.copy_blocks(copies)
        # The request's controls before its first tokens, forked once per choice.
        base = self.controls.start(params, matcher, prompt_ids, output_ids)
        controls = [base, *(self.controls.fork(base) for _ in seqs[1:])]
        self.controls.advance(controls, firsts)
        seed = request_seed(params)
        prompt = prompt_ids or seqs[0].prompt_ids
        # The prefill's last hidden state seeds mtp drafts (a fresh request's only).
        last = None if output_ids or resumed else hidden
        for k, (seq, ctl) in enumerate(zip(seqs, controls, strict=True)):
            choice = resumed[k].index if resumed else seq.choice
            replay = deque(resumed[k].replay if resumed else ())
            live = LiveChoice(params, stream, seed, ctl, choice, replay)
            output = [*output_ids, seq.generated[0]]
            live.drafts = self.speculation.proposer(prompt, output, last, seq.next_position - 1)
            self.live[seq.seq_id] = live
        for seq in seqs:
            live = self.live[seq.seq_id]
            if live.replay:
                continue  # its first token did not end it on the group it left
            reason = self.finish_reason(live, seq.generated[0], 1, seq.max_tokens)
            if reason is not None:
                self.scheduler.finish(seq.seq_id)
                self.drop(seq.seq_id)
                live.stream.put(live.event(None, reason))

    def run(self, batch: list[DecodeSequence]) -> None:
        """One step of every running sequence: each one's next token, or with drafts the
        tokens it keeps of them (leader/speculation.py), streamed."""
        counting = self.probe.count_syncs  # read once: a switch takes effect between steps
        counter = HostSyncCounter() if counting else nullcontext()
        with counter:
            lives = [self.live[seq.seq_id] for seq in batch]
            replayed = [bool(live.replay) for live in lives]
            proposers = [live.drafts for live in lives]
            verify = self.speculation.step(batch, proposers, replayed, self.scheduler.max_batch)
            processed = any(live.params.processed for live in lives)
            plan = self.plans.step(batch, verify.rows, counting, verify.mtp)
            parts = self.ranks.run(plan)
            logits = self.ranks.logits(parts, verify.rows.total)
            verify.fed(parts, len(plan.tokens), now=processed)
            runs = verify.kept(self._sample(batch, lives, verify, logits, processed))
            if any(replayed):
                _replay(lives, runs)
            reasons = self._finishes(batch, lives, runs, replayed, processed)
        if isinstance(counter, HostSyncCounter):
            self.probe.last_host_syncs = max([counter.count, *self.ranks.host_syncs(parts)])
        counts = verify.record(runs, [len(r) for r in reasons])
        kept = logits.to("cpu", copy=True) if self.probe.record_logits else None
        for s, (seq, live, start) in enumerate(zip(batch, lives, verify.rows.starts, strict=True)):
            row_logits = None if kept is None else kept[start : start + len(reasons[s])]
            self._emit(seq, live, runs[s], reasons[s], replayed[s], counts[s], row_logits)

    def _sample(
        self,
        batch: list[DecodeSequence],
        lives: list[LiveChoice],
        verify: SpeculativeStep,
        logits: Tensor,
        processed: bool,
    ) -> list[list[SampledToken]]:
        """Every row's token, each sequence's rows together: drawn with the key of its
        position, after the processors (penalties, grammar) where any sequence has them."""
        rows = verify.rows
        context = None
        if processed:
            context = self.controls.context(
                [live.controls for live in lives],
                [len(seq.generated) for seq in batch],
                verify.drafts(),
            )
        keys = [
            DrawKey(live.seed, live.choice, seq.next_position + 1 + j)
            for seq, live, n in zip(batch, lives, rows.sizes, strict=True)
            for j in range(n)
        ]
        params = rows.per_row([live.params for live in lives])
        return rows.split(sample_batch(logits, params, keys, context))

    def _emit(
        self,
        seq: DecodeSequence,
        live: LiveChoice,
        run: list[SampledToken],
        reasons: list[str | None],
        replayed: bool,
        spec: tuple[int, int],
        logits: Tensor | None,
    ) -> None:
        """A choice's events of the step, put in its stream at once, and its tokens in the
        scheduler. The step's drafts and kept drafts (`spec`) ride on its first event, so a
        caller's sum holds them even when it stops the stream early (a stop string)."""
        events = []
        for i, reason in enumerate(reasons):
            tok = run[i]
            if replayed:
                # Sent before, and it did not end the choice there. An empty event keeps
                # the caller's wait for the next token from timing out over a long replay.
                events.append(TokenEvent(None, index=live.choice))
                self.scheduler.append(seq.seq_id, tok.token_id, finished=False)
                continue
            logits_row = logits[i].clone() if logits is not None else None
            events.append(live.event(tok, reason, logits_row, spec))
            spec = (0, 0)
            self.scheduler.append(seq.seq_id, tok.token_id, finished=reason is not None)
            if reason is not None:
                self.drop(seq.seq_id)
        live.stream.put(*events)

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

    def warm_up(self) -> None:
        """A step of padding rows at every shape, on every rank (`DecodePlans.padding`),
        before the group serves: no request's step pays for a compile or a capture."""
        model = self.group.runtime.model
        mtp, hidden = model.mtp is not None, model.config.hidden_size
        for plan in self.plans.padding(self.speculation.spec, mtp, hidden):
            self.ranks.run(plan)


def _replay(lives: list[LiveChoice], runs: list[list[SampledToken]]) -> None:
    """Each replaying choice's next own earlier token in place of what it sampled (it is
    fed no drafts)."""
    for row, live in enumerate(lives):
        if live.replay:
            runs[row] = [SampledToken(live.replay.popleft(), 0.0)]

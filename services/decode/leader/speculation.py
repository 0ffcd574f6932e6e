"""The leader's speculative decoding: what a step drafts, verifies and keeps.

While speculation is on, each live choice holds a draft proposer (leader/drafts.py). A step
(`SpeculativeStep`) asks them for drafts, fed as extra rows (leader/verify.py), sends an MTP
draft pass where the ranks make the drafts (leader/mtp_plan.py), reads back the drafts the
ranks fed, keeps each sequence's verified run, and then tells the proposers and the group's
acceptance counts what was kept. A draft only ever costs a row, never a token: every kept
token is the one plain decoding would have drawn at its position (docs/design.md §7).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from common.runtime.host_syncs import host_side
from common.runtime.transfers import to_host
from common.sampling.sampler import SampledToken
from services.decode.config import SpecConfig
from services.decode.leader.drafts import MtpDrafts, Proposer, proposer
from services.decode.leader.mtp_plan import fed_drafts, fed_rows, mtp_plan, start_copy
from services.decode.leader.probe import Acceptance
from services.decode.leader.scheduler import DecodeSequence
from services.decode.leader.verify import StepRows, draft_room, kept_tokens
from services.decode.step_plan import MtpPlan


class Speculation:
    """The group's speculation: its setting (`spec`, switched between steps by
    `DecodeEngine.speculate`) and its steps."""

    def __init__(self, spec: SpecConfig, hidden_size: int, acceptance: Acceptance) -> None:
        self.spec = spec
        self.hidden_size = hidden_size  # an MTP seed's width
        self.acceptance = acceptance

    def use(self, spec: SpecConfig) -> None:
        """Speculate as `spec` says from the next step on; a live choice's proposer of
        another method idles (`drafts`)."""
        self.spec = spec

    def proposer(
        self,
        prompt: Sequence[int],
        output: Sequence[int],
        hidden: Tensor | None,
        position: int,
    ) -> Proposer | None:
        """A choice's proposer as it goes live, holding its tokens so far (`hidden`, mtp:
        its prefill's last hidden state, at `position`); None with speculation off."""
        if not self.spec.enabled:
            return None
        return proposer(self.spec, prompt, output, hidden, position)

    def step(
        self,
        batch: Sequence[DecodeSequence],
        proposers: Sequence[Proposer | None],
        replaying: Sequence[bool],
        max_batch: int,
    ) -> SpeculativeStep:
        """The step's speculation: each sequence's drafts (`drafts`) and the MTP pass."""
        rows = StepRows(self.drafts(batch, proposers, replaying, max_batch))
        mtp = None
        # A step that does not speculate leaves the MTP cache at its positions unwritten:
        # later drafts read stale latents there, which costs acceptance, never a token.
        if self.spec.method == "mtp" and self.spec.speculates(len(batch)):
            mtp = mtp_plan(proposers, rows, self.hidden_size, self.spec.tokens - 1)
        positions = [seq.next_position for seq in batch]
        return SpeculativeStep(rows, mtp, list(proposers), positions, self.acceptance)

    def drafts(
        self,
        batch: Sequence[DecodeSequence],
        proposers: Sequence[Proposer | None],
        replaying: Sequence[bool],
        max_batch: int,
    ) -> list[list[int]]:
        """Each sequence's drafts for this step: none above the speculation batch limit or
        while replaying; at most k, what its max_tokens leaves room for (`draft_room`), and
        rows for the whole step within max_batch, so a speculative step fits a batch bucket
        (its CUDA graph) and the grammar bitmask."""
        spec = self.spec
        if not spec.speculates(len(batch)):
            return [[] for _ in batch]
        budget = max_batch - len(batch)
        out = []
        for seq, drafts, replay in zip(batch, proposers, replaying, strict=True):
            k = min(spec.tokens, draft_room(seq.max_tokens, len(seq.generated)), budget)
            # A proposer of another method than the step's (speculate() switched it) idles.
            own = isinstance(drafts, MtpDrafts) == (spec.method == "mtp")
            ok = k > 0 and own and not replay
            proposed = drafts.propose(k) if ok and drafts is not None else []
            budget -= len(proposed)
            out.append(proposed)
        return out


class SpeculativeStep:
    """One step's speculation: its rows (`rows`: sequence s's last token, then its drafts),
    its MTP draft pass (`mtp`), the drafts the ranks fed, and what each sequence keeps."""

    def __init__(
        self,
        rows: StepRows,
        mtp: MtpPlan | None,
        proposers: list[Proposer | None],
        positions: list[int],
        acceptance: Acceptance,
    ) -> None:
        self.rows, self.mtp = rows, mtp
        self._proposers, self._positions, self._acceptance = proposers, positions, acceptance
        self._copied: Tensor | None = None  # the fed drafts on their way to the host

    def fed(self, parts: Tensor, size: int, now: bool) -> None:
        """The drafts the ranks fed, after the `size` logits rows of their gathered outputs
        (`fed_rows`, with a draft pass): read at once when the processors count them
        (`now`); otherwise their copy is queued, to be read after the sampler's one wait,
        which it precedes (`kept`)."""
        if self.mtp is None or not self.rows.speculative:
            return
        fed = fed_rows(parts, size)
        if now:
            host = to_host(fed)
            with host_side():
                self.rows = fed_drafts(host, self.rows)
        else:
            self._copied = start_copy(fed)

    def drafts(self) -> list[list[int]] | None:
        """Each sequence's drafts, as fed, for the step's controls (None: none drafted)."""
        return self.rows.drafts if self.rows.speculative else None

    def kept(self, sampled: list[list[SampledToken]]) -> list[list[SampledToken]]:
        """Each sequence's tokens of the step, of its rows' samples (leader/verify.py)."""
        if self._copied is not None:
            with host_side():
                self.rows = fed_drafts(self._copied, self.rows)
            self._copied = None
        return [kept_tokens(d, s) for d, s in zip(self.rows.drafts, sampled, strict=True)]

    def record(self, runs: list[list[SampledToken]], taken: list[int]) -> list[tuple[int, int]]:
        """Each sequence took the first `taken[s]` tokens of `runs[s]`: the acceptance
        counts and its proposer learn them. Each sequence's (drafts fed, drafts kept)."""
        counts = []
        for s, (drafts, run, start) in enumerate(
            zip(self.rows.drafts, runs, self.rows.starts, strict=True)
        ):
            count = (len(drafts), len(run) - 1) if drafts else (0, 0)
            if drafts:
                self._acceptance.record(*count)
            counts.append(count)
            tokens = [t.token_id for t in run[: taken[s]]]
            prop = self._proposers[s]
            if isinstance(prop, MtpDrafts):
                prop.kept(start, self._positions[s], tokens)
            elif prop is not None:
                prop.extend(tokens)
        return counts

"""A decode rank's part of a prompt its group prefills itself (a `PrefillPlan`), in its own
layout, one piece of a prompt at a time between the group's decode steps.

Every rank runs the prefill's one loop (`packed_prefill`) over its `RankPrefillStack`: its
prefill heads' attention over the whole latent, its FFN slice, the group's all-reduces. A
piece after a prompt's first tokens (its cached prefix, its earlier chunks) attends over
their whole latents, which each rank first gathers from where the group keeps them
(`CacheSplit.past`: TPLA's latent slices, SP's chunks; MLA-TP holds them whole), so the
piece's attention is exact in every layout, as the prefill worker's. Each rank then stores
its part of the piece's latents (its latent columns, or its own tokens in SP) where its
layout puts them (`CacheSplit.write_slots`), as a shipped shard would be: the decode steps
after it read the same cache either way. The plan's logits come back for the leader's
gather (its last rows, or every row for prompt logprobs). A rank holding the MTP module
computes the piece's MTP latents too, one more cache layer, as the prefill worker does
(`prefill_with_mtp`), and keeps each prompt's last hidden state for the leader.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.group.comm import Comm
from common.kv.paged_cache import PagedLatentCache
from common.model.causal_lm import PastLatents, PrefillOutput, packed_prefill
from common.model.mtp import prefill_with_mtp, prompt_own_next_ids
from common.parallel import ParallelConfig
from services.decode.rank.cache_split import CacheSplit
from services.decode.rank.prefill_stack import RankPrefillStack
from services.decode.step_plan import PrefillPlan


class PrefillPass:
    """Rank `rank`'s prefill pieces over its stack, into its cache."""

    def __init__(
        self,
        stack: RankPrefillStack,
        split: CacheSplit,
        cache: PagedLatentCache,
        comm: Comm,
        parallel: ParallelConfig,
    ) -> None:
        self.stack, self.split, self.cache, self.comm = stack, split, cache, comm
        model = stack.model
        self.rank = model.rank
        # The latent columns this rank caches (all of them but in TPLA at r > 1).
        self.columns = parallel.latent_columns(model.rank, model.config.kv_lora_rank)
        # The last piece's last hidden state of each prompt [S, D], with the MTP module.
        self.last_hidden: Tensor | None = None

    @torch.inference_mode()
    def run(self, plan: PrefillPlan) -> Tensor | None:
        """The plan's piece of each prompt, its latents stored; the logits it asks for (this
        rank's vocabulary rows, padded), else None."""
        device = self.cache.kv.device
        tables = plan.block_tables[self.rank if plan.block_tables.shape[0] > 1 else 0]
        tables = tables.to(device)
        lens, starts = plan.lens.tolist(), plan.starts.tolist()
        pasts = [self.past(tables[s], start) for s, start in enumerate(starts)]
        ids = plan.tokens.to(device)
        past = pasts if any(starts) else None
        mtp = self.stack.mtp
        if mtp is None:
            out = packed_prefill(self.stack, ids, lens, all_logits=plan.every_row, past=past)
        else:
            # Each row reads its next token: the prompt's own, after the piece the plan's.
            next_ids = prompt_own_next_ids(ids, lens)
            ends = torch.tensor(lens, device=device).cumsum(0) - 1
            after = plan.after.to(device)
            next_ids[ends] = torch.where(after >= 0, after, next_ids[ends])
            rope = self.stack.rope
            out = prefill_with_mtp(
                self.stack,
                lambda hidden: mtp.over(hidden, rope),
                ids,
                lens,
                next_ids,
                all_logits=plan.every_row,
                past=past,
            )
            assert out.hidden is not None
            self.last_hidden = out.hidden[ends]
        self.store(out, tables, plan)
        return out.logits if plan.logits else None

    def past(self, table: Tensor, length: int) -> PastLatents | None:
        """A prompt's first `length` tokens' whole latents, on every rank (None: none)."""
        if not length:
            return None
        n, k_pe = self.split.past(self.cache, table, length, self.comm)
        return PastLatents(list(n), list(k_pe))

    def store(self, out: PrefillOutput, tables: Tensor, plan: PrefillPlan) -> None:
        """This rank's part of the piece's latents, into the prompts' blocks (from each
        prompt's `stored_from` on)."""
        device = tables.device
        lens, starts = plan.lens.tolist(), plan.starts.tolist()
        positions = torch.cat(
            [torch.arange(s, s + n, device=device) for s, n in zip(starts, lens, strict=True)]
        )
        per_row = torch.tensor(lens, device=device)
        rows = tables.repeat_interleave(per_row, dim=0)
        stored = plan.stored_from.to(device).repeat_interleave(per_row)
        cache = self.cache
        block_size, trash = cache.layout.block_size, cache.trash_slot
        slots = self.split.write_slots(positions, rows, block_size, trash)
        slots = torch.where(positions >= stored, slots, trash)
        for layer, (n, k_pe) in enumerate(zip(out.n, out.k_pe, strict=True)):
            cache.write(layer, slots, n[:, self.columns], k_pe)

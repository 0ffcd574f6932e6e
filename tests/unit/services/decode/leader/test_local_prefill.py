"""The leader's queue of local prefills over a real scheduler and block pools, its ranks a
recorder of the plans they are sent (the ranks' own part: tests/integration/
test_local_prefill.py): pieces within the chunk budget in arrival order, what each plan
holds, first tokens from the last piece's logits, drops and failures."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from common.kv.block_pool import RankPools
from common.parallel import ParallelConfig, ParallelMode
from common.runtime.errors import LocalPrefillOff
from common.sampling.params import SamplingParams
from services.decode.leader.local_prefill import LocalPrefill, LocalPrefills
from services.decode.leader.scheduler import Scheduler, SchedulerError
from services.decode.step_plan import PrefillPlan
from services.decode.stream import EngineError

VOCAB = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


class PlanRecorder:
    """Stands in for `Ranks`: records each plan and answers logits whose argmax is each
    returned row's last token + 1."""

    def __init__(self) -> None:
        self.plans: list[PrefillPlan] = []

    def prefill(self, plan: PrefillPlan) -> tuple[Tensor | None, Tensor | None]:
        self.plans.append(plan)
        if not plan.logits:
            return None, None
        ends = plan.lens.cumsum(0) - 1
        rows = plan.tokens if plan.every_row else plan.tokens[ends]
        return torch.nn.functional.one_hot((rows + 1) % VOCAB, VOCAB).float(), None


def _queue(
    chunk: int, parallel: ParallelConfig | None = None
) -> tuple[LocalPrefills, PlanRecorder]:
    pools = RankPools(64, 4, parallel or ParallelConfig(), prefix_cache=True)
    ranks = PlanRecorder()
    return LocalPrefills(ranks, Scheduler(pools, 8, 256), chunk, (), 30.0), ranks  # type: ignore[arg-type]


def _submit(queue: LocalPrefills, rid: str, prompt: list[int], **kw: object) -> LocalPrefill:
    queue.scheduler.reserve(rid, len(prompt), 4, 1e9, n=int(kw.get("n", 1)))  # type: ignore[arg-type]
    job = LocalPrefill(rid, tuple(prompt), GREEDY, **kw)  # type: ignore[arg-type]
    queue.submit(job)
    return job


def test_pieces_follow_the_budget_in_arrival_order() -> None:
    queue, ranks = _queue(chunk=8)
    long = _submit(queue, "long", list(range(1, 13)))
    short = _submit(queue, "short", [5, 6, 7])
    assert queue.queued_tokens == 15
    queue.run()  # 8 of the long prompt
    queue.run()  # its last 4, then the short one's 3
    queue.run()  # nothing left
    first, second = ranks.plans
    assert first.lens.tolist() == [8] and first.starts.tolist() == [0]
    assert first.after.tolist() == [9] and not first.logits  # the next token; no first token yet
    assert second.lens.tolist() == [4, 3] and second.starts.tolist() == [8, 0]
    assert second.after.tolist() == [-1, -1] and second.logits and not second.every_row
    assert second.tokens.tolist() == [9, 10, 11, 12, 5, 6, 7]
    assert second.block_tables.shape[:2] == (1, 2)  # one table for every rank, per prompt
    assert long.future.result().first_token.token_id == 13
    assert short.future.result().first_token.token_id == 8
    assert not queue.pending() and queue.queued_tokens == 0


def test_sp_plans_carry_each_ranks_table_and_n_choices_each_a_token() -> None:
    queue, ranks = _queue(8, ParallelConfig(2, mode=ParallelMode.SP, chunk_size=4))
    job = _submit(queue, "sp", list(range(1, 7)), n=3)
    queue.run()
    assert ranks.plans[0].block_tables.shape[0] == 2
    assert len(job.future.result().first_tokens) == 3


def test_a_scored_prompt_runs_whole_alone_and_leaves_its_cached_blocks() -> None:
    queue, ranks = _queue(chunk=4)
    queue.scheduler.reserve("first", 9, 4, 1e9, [11, 22])
    queue.scheduler.start("first", 1)  # its two full blocks are cached now
    queue.scheduler.finish("first")
    queue.scheduler.reserve("scored", 9, 4, 1e9, [11, 22])
    scored = LocalPrefill("scored", tuple(range(1, 10)), GREEDY, prompt_logprobs=1)
    queue.submit(scored)
    other = _submit(queue, "other", [3, 4])
    assert scored.cached == 8 and scored.done == 0
    queue.run()
    plan = ranks.plans[0]
    assert plan.lens.tolist() == [9] and plan.every_row  # whole, over the budget, alone
    assert plan.stored_from.tolist() == [8]  # the cached blocks are not written again
    assert len(scored.future.result().prompt_logprobs) == 8
    queue.run()
    assert other.future.result().first_token.token_id == 5


def test_a_prompt_held_whole_computes_its_last_token_again() -> None:
    queue, ranks = _queue(chunk=4)
    queue.scheduler.reserve("first", 8, 4, 1e9, [11, 22])
    queue.scheduler.start("first", 1)
    queue.scheduler.finish("first")
    queue.scheduler.reserve("again", 8, 4, 1e9, [11, 22])
    again = LocalPrefill("again", tuple(range(1, 9)), GREEDY)
    queue.submit(again)
    assert again.cached == 8 and again.done == 7
    queue.run()
    plan = ranks.plans[0]
    assert (plan.starts.tolist(), plan.lens.tolist(), plan.stored_from.tolist()) == ([7], [1], [8])
    assert again.future.result().first_token.token_id == 9


def test_drops_and_failures() -> None:
    queue, _ = _queue(chunk=2)
    with pytest.raises(SchedulerError, match="no open reservation"):
        queue.submit(LocalPrefill("nobody", (1, 2), GREEDY))
    gone = _submit(queue, "gone", [1, 2, 3, 4])
    queue.run()
    queue.scheduler.abort("gone")
    left = _submit(queue, "left", [1, 2, 3])
    left.future.cancel()  # its caller went away
    kept = _submit(queue, "kept", [1, 2, 3])
    queue.run()
    with pytest.raises(EngineError, match="reservation ended"):
        gone.future.result()
    assert not kept.future.done() and queue.queue == type(queue.queue)([kept])
    queue.fail_all("rank 1 died")
    with pytest.raises(EngineError, match="rank 1 died"):
        kept.future.result()
    off, _ = _queue(chunk=0)
    with pytest.raises(LocalPrefillOff, match="does not prefill"):
        _submit(off, "x", [1])

"""A batch plan crosses to the other ranks as JSON and comes back whole: every job's ids,
lookup, hit and KV targets (SP token ranges included), and the prompts dropped."""

from __future__ import annotations

import torch

from common.messages import KvTargetInfo
from services.prefill.batch.batch_plan import BatchPlan, JobPlan
from services.prefill.shipping import ShipOrder


def test_a_plan_survives_its_encoding() -> None:
    targets = (
        KvTargetInfo(0, "a:1", "a:101", 0, 8, (3, 4), (0, 8, 16, 20)),
        KvTargetInfo(1, "b:1", "", 8, 8, (5,)),
    )
    plan = BatchPlan(
        (
            JobPlan(7, (5, 6, 7, 8), True, 0, ShipOrder("r1", 4, 0, 16, targets, 9.5)),
            JobPlan(8, tuple(range(40)), False, 32, ShipOrder("r2", 40, 16, 16, (), 30.0)),
        ),
        all_logits=True,
        dropped=("r0",),
    )
    back = BatchPlan.from_json(plan.to_json())
    assert back == plan
    assert back.lens == [4, 8]
    assert back.ids(torch.device("cpu")).tolist() == [5, 6, 7, 8, *range(32, 40)]

"""What keeps a decode step from CUDA graph capture (services/decode/rank/graphs.py): a MoE
layer whose experts run the per-expert loop, chosen or forced by its weights."""

from __future__ import annotations

import torch

from common.model.moe import MoE, use_experts_kernel
from services.decode.rank.graphs import uncapturable
from tests.unit.common.model.test_experts import CFG


def test_a_moe_on_the_per_expert_loop_is_not_captured() -> None:
    model = torch.nn.ModuleDict({"moe": MoE(CFG)})
    assert uncapturable(model) is None  # fp32 on the CPU: the grouped GEMMs
    use_experts_kernel(model, "loop")
    assert uncapturable(model) == (
        "the MoE experts run the per-expert loop (the loop was chosen (TPLA_EXPERTS_KERNEL))"
    )
    use_experts_kernel(model, "grouped")
    model.double()  # no float64 grouped_mm: the loop, whatever was chosen
    assert "grouped_mm does not run torch.float64" in (uncapturable(model) or "")

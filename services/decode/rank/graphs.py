"""A rank's decode step as CUDA graphs: one graph per step bucket, captured once, replayed.

A decode step of a small batch is hundreds of small kernels; launched one by one from Python
the GPU waits on the host between them. The leader pads every plan to a bucket (its batch
and its block tables' width: common/step_shapes.py), so a bucket's step always has
the same shapes, and its kernels can be recorded once into a CUDA graph and replayed with one
launch. The graph reads its inputs from static device buffers: each step copies its plan into
the bucket's buffers, then replays. The block tables are not among them: the rank keeps them
in one buffer that never moves (rank/block_tables.py), updated in place before the replay,
as are the draft pass's hidden states. Every step kind replays: a plain step, an n-gram
verify step (more rows, the same buckets) and a step with an MTP draft pass (its pass padded
to the step's rows and its chain to the configured drafts), each shape its own graph.

Every rank of a group sees the same plans in the same order, so each one captures a bucket at
the same step: collectives inside the step (NCCL all-reduces) are captured in lockstep. The
engine captures every bucket at start-up (`DecodeEngine` warm-up), which also compiles every
Triton variant, so nothing compiles or captures while serving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from common.model.moe import MoE
from services.decode.step_plan import DecodePlan

Forward = Callable[[DecodePlan], Tensor]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: DecodePlan  # the static buffers the graph reads
    output: Tensor  # the static buffer it writes: this rank's logits slice


class StepGraphs:
    """The captured steps of one rank, keyed by the plan's shape (its bucket)."""

    def __init__(
        self, device: torch.device, forward: Forward, state: tuple[Tensor, ...] = ()
    ) -> None:
        """`state`: buffers a step reads from the step before (the draft pass's hidden
        states): kept as they were across a capture's eager run."""
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.device, self._forward, self._state = device, forward, state
        self._graphs: dict[tuple[int, int, int], _Captured] = {}
        # One memory pool for every bucket's graph: only one replays at a time, so they can
        # share their intermediate buffers instead of each holding its own.
        self._pool = torch.cuda.graph_pool_handle()

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, plan: DecodePlan) -> Tensor:
        """The step of `plan` (on the rank's device): its bucket's graph replayed, captured
        first if this bucket is new. The result is the graph's output buffer, valid until the
        next step."""
        key = plan.shape
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._graphs[key] = self._capture(plan)
        for static, value in zip(graph_inputs(captured.inputs), graph_inputs(plan), strict=True):
            static.copy_(value, non_blocking=True)
        captured.graph.replay()
        return captured.output

    def _capture(self, plan: DecodePlan) -> _Captured:
        inputs = _static(plan)
        # One eager run first, on a side stream as capture requires: it compiles the Triton
        # variants and grows the workspaces that the graph then records at their final size.
        # Running the plan's step twice is harmless: it writes the same cache slots again,
        # and the state the replay reads is put back as it was.
        kept = [t.clone() for t in self._state]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(inputs)
            for t, was in zip(self._state, kept, strict=True):
                t.copy_(was)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self._forward(inputs)
        return _Captured(graph, inputs, output)


def graph_inputs(plan: DecodePlan) -> tuple[Tensor, ...]:
    """What a step's graph reads from its plan (the tables are the rank's own buffer)."""
    plain = (plan.tokens, plan.positions, plan.slots)
    return plain if plan.mtp is None else (*plain, plan.mtp.rows, plan.mtp.drafts)


def _static(plan: DecodePlan) -> DecodePlan:
    """The buffers a graph reads, first filled from `plan`."""
    mtp = plan.mtp
    if mtp is not None:
        mtp = replace(mtp, rows=mtp.rows.clone(), drafts=mtp.drafts.clone(), seeds=mtp.seeds[:0])
    tokens, positions, slots = (t.clone() for t in graph_inputs(plan)[:3])
    return DecodePlan(tokens, positions, slots, plan.width, mtp=mtp)


def uncapturable(model: nn.Module) -> str | None:
    """Why `model`'s decode step cannot be captured, or None where it can: a MoE layer whose
    experts run the per-expert loop (chosen, or no grouped GEMM for their dtype) reads each
    expert's token count back to the host, which a graph cannot replay."""
    for module in model.modules():
        if isinstance(module, MoE):
            why = module.loop_reason()
            if why is not None:
                return f"the MoE experts run the per-expert loop ({why})"
    return None

"""A decode plan's tensors on the rank's device, through buffers made once."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from services.decode.step_plan import DecodePlan


class StepInputs:
    """A decode plan's tensors on the rank's device, through buffers made once.

    On a GPU the plan's words (CPU tensors from the control group: rows, and an MTP pass's
    rows and drafts; its seeds go to the rank's own buffer) are packed into pinned host
    memory and copied asynchronously into a device buffer that later steps reuse; two host
    buffers alternate, each reused only after its previous copy finished. On the CPU the
    plan's tensors are the step's inputs as they are.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: list[Tensor] = []
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._device_words = torch.empty(0, dtype=torch.int64, device=device)
        self._turn = 0

    def load(self, plan: DecodePlan) -> DecodePlan:
        if self.device.type == "cpu":
            return plan
        b, mtp = len(plan.tokens), plan.mtp
        parts = [plan.tokens, plan.positions, plan.slots]
        if mtp is not None:
            parts += [mtp.rows.flatten(), mtp.drafts.flatten()]
        words = sum(p.numel() for p in parts)
        if self._device_words.numel() < words:
            size = max(words, 2 * self._device_words.numel())
            self._host = [torch.empty(size, dtype=torch.int64).pin_memory() for _ in range(2)]
            self._done = [None, None]
            self._device_words = torch.empty(size, dtype=torch.int64, device=self.device)
        turn = self._turn
        self._turn ^= 1
        if (done := self._done[turn]) is not None:
            done.synchronize()
        host = self._host[turn][:words]
        torch.cat(parts, out=host)
        dev = self._device_words[:words]
        dev.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._done[turn] = event
        if mtp is not None:
            m, rows = mtp.rows.shape[1], dev[3 * b :]
            mtp = replace(mtp, rows=rows[: 4 * m].view(4, m), drafts=rows[4 * m :].view(3, -1))
        return replace(
            plan, tokens=dev[:b], positions=dev[b : 2 * b], slots=dev[2 * b : 3 * b], mtp=mtp
        )

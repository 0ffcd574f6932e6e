"""The leader's side of its group's ranks: a plan goes to every follower and runs here too;
what the ranks return comes back in one gather (`Ranks`).

Each rank returns its slice of the rows' logits, padded to a common width, then (with a
draft pass) the tokens its rows were fed, then (when counted) its host waits in one last row
(services/decode/rank/runtime.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.runtime.transfers import to_device
from services.decode.group.start import RunningGroup
from services.decode.step_plan import (
    CopyPlan,
    DecodePlan,
    EpochPlan,
    Plan,
    PrefillPlan,
    send_plan,
)


class Ranks:
    """Rank 0's calls into its group, made on the loop thread."""

    def __init__(self, group: RunningGroup) -> None:
        self.runtime, self.tp = group.runtime, group.cfg.parallel.tp
        vocab_size = self.runtime.model.config.vocab_size
        # Rank k's logits are padded to a common width for the gather; these columns of the
        # gathered row are the real vocabulary, in order (None: the first vocab_size, when
        # only the last rank's slice is short or none is). Computed once, used every step.
        columns = group.cfg.parallel.vocab_columns(vocab_size)
        self._vocab_size = vocab_size
        self._vocab_columns = (
            None
            if columns == list(range(len(columns)))
            else to_device(columns, self.runtime.device, torch.int64)
        )

    def send(self, plan: Plan) -> None:
        """`plan` to every follower (none at tp = 1)."""
        if self.tp > 1:
            send_plan(plan, self.runtime.comm)

    def run(self, plan: DecodePlan) -> Tensor:
        """`plan` run by every rank: their outputs [tp, rows, width], gathered here."""
        self.send(plan)
        parts = self.runtime.comm.gather(self.runtime.step(plan))
        assert parts is not None  # rank 0
        return parts

    def prefill(self, plan: PrefillPlan) -> tuple[Tensor | None, Tensor | None]:
        """A piece of prompts every rank prefills (rank/prefill_pass.py): the logits it asks
        for [rows, V], gathered here, else None; and, where the group drafts with MTP, each
        prompt's last hidden state [S, D] (whole on every rank: rank 0's)."""
        self.send(plan)
        out = self.runtime.prefill(plan)
        hidden = self.runtime.prefilled_hidden()
        if out is None:
            return None, hidden
        parts = self.runtime.comm.gather(out)
        assert parts is not None  # rank 0
        return self.logits(parts, parts.shape[1]), hidden

    def copy_blocks(self, plan: CopyPlan) -> None:
        """Every rank copies `plan`'s blocks."""
        self.send(plan)
        self.runtime.copy_blocks(plan)

    def give_blocks(self, plan: EpochPlan) -> None:
        """Every rank gives a new reservation's blocks to its epoch."""
        self.send(plan)
        self.runtime.give_blocks(plan)

    def logits(self, parts: Tensor, n: int) -> Tensor:
        """The step's `n` rows of logits [n, V], from every rank's output."""
        # [tp, N, V / tp] real rows -> [N, tp * V / tp]: one copy (none at tp = 1).
        real = parts[:, :n]
        logits = real[0] if self.tp == 1 else real.transpose(0, 1).reshape(n, -1)
        if self._vocab_columns is None:
            return logits[:, : self._vocab_size]
        return logits[:, self._vocab_columns]

    @staticmethod
    def host_syncs(parts: Tensor) -> list[int]:
        """Each follower's host waits in a counted step (its output's last row)."""
        return parts[1:, -1, 0].tolist()

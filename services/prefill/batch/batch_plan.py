"""The plan of one prefill batch: what every rank of a prefill group must know to run it.

The leader's worker batches prompts and looks them up in its prefix cache; the plan carries
each prompt's ids, its cache lookup and hit (every rank holds an identical replica of the
cache, so each finds the same past latents), whether every position's logits are wanted,
the prompts dropped between their pieces, and where each prompt's KV goes (`ShipOrder`: each
rank ships its own decode ranks' shards). It crosses to the other ranks over the group's
control group as JSON bytes (`send_plan` / `recv_plan`); an empty plan ends the group, and a
`PING` (`send_ping`) is an idle leader's keep-alive.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

from common.group.comm import Comm
from common.messages import KvTargetInfo
from common.model.mtp import prompt_next_ids
from services.prefill.shipping import ShipOrder


@dataclass(frozen=True)
class JobPlan:
    seq: int  # the leader's number for this piece: the key its ranks report its sends under
    prompt_ids: tuple[int, ...]
    lookup: bool  # looked up in the prefix cache (a prompt-logprobs job prefills whole)
    hit: int  # cached prefix tokens the prefill runs over: the leader's lookup
    order: ShipOrder
    # The prompt's token after this piece (None: the piece ends the prompt): the MTP layer
    # reads it at the piece's last row, whose own next token is otherwise not yet sampled.
    next_id: int | None = None

    @property
    def new_ids(self) -> tuple[int, ...]:
        return self.prompt_ids[self.hit :]


@dataclass(frozen=True)
class BatchPlan:
    jobs: tuple[JobPlan, ...]
    all_logits: bool  # every position's logits (a job asked for its prompt's logprobs)
    # Request ids of prompts the leader dropped between their pieces since its last plan:
    # the other ranks drop what they keep of them.
    dropped: tuple[str, ...] = ()

    @property
    def lens(self) -> list[int]:
        return [len(job.new_ids) for job in self.jobs]

    def ids(self, device: torch.device) -> torch.Tensor:
        """The batch's new tokens, packed."""
        flat = [t for job in self.jobs for t in job.new_ids]
        return torch.tensor(flat, dtype=torch.long, device=device)

    def next_ids(self, device: torch.device) -> torch.Tensor:
        """What the MTP layer reads at each packed row: the prompt's next token, and at a
        prompt's last row its own (the first token is sampled after the prefill; the decode
        ranks' first draft pass writes that row again)."""
        ends = [job.new_ids[-1] if job.next_id is None else job.next_id for job in self.jobs]
        return prompt_next_ids(self.ids(device), self.lens, ends)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BatchPlan:
        raw = json.loads(text)
        jobs = []
        for job in raw["jobs"]:
            order = job.pop("order")
            targets = tuple(
                KvTargetInfo(
                    **{
                        **t,
                        "block_ids": tuple(t["block_ids"]),
                        "token_ranges": tuple(t["token_ranges"]),
                    }
                )
                for t in order.pop("targets")
            )
            jobs.append(
                JobPlan(
                    **{**job, "prompt_ids": tuple(job["prompt_ids"])},
                    order=ShipOrder(**order, targets=targets),
                )
            )
        return cls(tuple(jobs), raw["all_logits"], tuple(raw["dropped"]))


@dataclass(frozen=True)
class PingPlan:
    """Sent by an idle leader about every second (services/prefill/group/leader.py). A
    follower waits for its next plan in a collective that times out
    (`collective_timeout_s`): without pings an idle group's followers would fail after that
    long, and a leader that hangs while idle shows as a ping that does not come."""


# The size word of a ping: a plan's size is its JSON's length, 0 the group's end.
_PING = -1


def send_ping(comm: Comm) -> None:
    """Leader: a `PingPlan` to every other rank."""
    comm.broadcast_plan_(torch.tensor([_PING], dtype=torch.int64))


def send_plan(plan: BatchPlan | None, comm: Comm) -> None:
    """Leader: the plan (None: the group's end) to every other rank."""
    data = plan.to_json().encode() if plan is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    comm.broadcast_plan_(size)
    if data:
        comm.broadcast_plan_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def recv_plan(comm: Comm) -> BatchPlan | PingPlan | None:
    """A follower: the leader's next plan, a ping, or None when the group ends."""
    size = torch.zeros(1, dtype=torch.int64)
    comm.broadcast_plan_(size)
    if int(size) == _PING:
        return PingPlan()
    if not int(size):
        return None
    data = torch.empty(int(size), dtype=torch.uint8)
    comm.broadcast_plan_(data)
    return BatchPlan.from_json(bytes(data.numpy()).decode())

"""Where the settings place this process in a group whose hosts join over the network.

Two forms: `--rank K --group-size N --group-addr HOST:PORT` runs one rank (rank K of N) in
this process; `--node K --nodes M --group-addr HOST:PORT` runs host K of M, the ranks
K x L .. K x L + L - 1 of a group of the service's tp (TPLA_TP, TPLA_PREFILL_TP), L = tp / M,
the first in this process and the rest spawned beside it (one pod per node holding that
node's GPUs; a LeaderWorkerSet's `size` is M). Neither form: the leader spawns every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.group.spec import parse_group_addr
from common.runtime.settings import Settings


@dataclass(frozen=True)
class Membership:
    """This process's place in a joined group."""

    size: int  # the group's ranks
    local_ranks: int  # ranks per host
    rank: int  # this process's rank: its host's first
    addr: str  # the leader's rendezvous
    port: int


def joined(s: Settings) -> bool:
    """Whether the settings name a group whose hosts join over the network."""
    return bool(s.group_size or s.group_addr or s.rank or s.nodes or s.node)


def membership(s: Settings, tp: int, tp_setting: str) -> Membership:
    """This process's place in the joined group the settings name (`tp`: the service's group
    size as `tp_setting` sets it); ValueError naming what is wrong."""
    if s.nodes or s.node:
        return _hosts(s, tp, tp_setting)
    if not s.group_size:
        raise ValueError("--rank and --group-addr need --group-size (TPLA_GROUP_SIZE)")
    if not s.group_addr:
        raise ValueError("--group-size needs --group-addr HOST:PORT (TPLA_GROUP_ADDR)")
    if s.rank >= s.group_size:
        raise ValueError(f"--rank {s.rank} is outside a group of {s.group_size} ranks (0..N-1)")
    host, port = parse_group_addr(s.group_addr)
    # A rank is one tensor-parallel shard: the group size is tp (which may be left unset).
    if tp_setting.removeprefix("TPLA_").lower() in s.model_fields_set and tp != s.group_size:
        raise ValueError(
            f"--group-size {s.group_size} but {tp_setting}={tp}: a group has one rank per "
            "tensor-parallel shard"
        )
    return Membership(s.group_size, 1, s.rank, host, port)


def _hosts(s: Settings, tp: int, tp_setting: str) -> Membership:
    if s.rank or s.group_size:
        raise ValueError("--node / --nodes and --rank / --group-size are two ways: give one")
    if not s.nodes or not s.group_addr:
        raise ValueError("--node K needs --nodes M and --group-addr HOST:PORT (TPLA_NODES)")
    if s.node >= s.nodes:
        raise ValueError(f"--node {s.node} is outside a group of {s.nodes} hosts (0..M-1)")
    if tp % s.nodes:
        raise ValueError(
            f"{tp_setting}={tp} ranks do not split evenly over --nodes {s.nodes} hosts"
        )
    host, port = parse_group_addr(s.group_addr)
    per_host = tp // s.nodes
    return Membership(tp, per_host, s.node * per_host, host, port)


def process_rank(s: Settings, tp: int, tp_setting: str) -> int:
    """The rank this process runs: 0 (the leader) unless the settings join it to a group."""
    return membership(s, tp, tp_setting).rank if joined(s) else 0

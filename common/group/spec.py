"""What a rank group is, for the machinery that forms it: its size, rendezvous, device kind,
collectives, timeouts and the identity every rank must share.

Decode groups and prefill groups each map their own config onto a `GroupSpec`; everything in
common/group (process-group init, the shared-memory file, spawned ranks, the join protocol)
reads only this.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GroupSpec:
    role: str  # "decode" or "prefill": names the group's ranks in messages and commands
    size: int  # ranks, the leader included
    device: str = "cpu"  # "cpu", or "cuda" / "cuda:N": rank k on GPU N + its local index
    # "shm": CPU collectives through the group's shared-memory file when the native library
    # is there (spawned ranks share a host); "dist": torch.distributed's gloo.
    collectives: str = "shm"
    collective_timeout_s: float = 120.0
    join_timeout_s: float = 300.0  # every follower joins (a follower: the leader answers) by then
    spawned: bool = True  # followers are the leader's children; else each joins on its own
    addr: str = "127.0.0.1"  # the leader's rendezvous store (served on every interface)
    port: int = 0
    port_setting: str = "TPLA_DIST_PORT"  # the setting that moves `port` (spawned groups)
    shm_path: str | None = None  # set by the leader: the group file its ranks map
    host: str = "127.0.0.1"  # the interface this process binds (its ports are checked there)
    advertise_host: str = "127.0.0.1"  # where the others reach this rank
    # What a rank serves, as strings, read when the group forms (it may read files); and
    # for each of its keys the setting that changes it (the config check names it).
    identity: Callable[[], dict[str, str]] = dict
    settings: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a group has at least one rank, not {self.size}")
        if self.collectives not in ("shm", "dist"):
            raise ValueError(f"collectives {self.collectives!r} is not shm or dist")

    @property
    def address(self) -> str:
        return f"{self.addr}:{self.port}"

    def local_index(self, rank: int) -> int:
        """Rank `rank`'s index on its host (the offset of its GPU): spawned ranks share the
        leader's host; a rank started on its own is the first of its process."""
        return rank if self.spawned else 0

    def setting(self, key: str) -> str:
        """The setting that changes identity field `key`."""
        return dict(self.settings).get(key, key)

    @property
    def join_command(self) -> str:
        """How an operator starts one missing rank."""
        return f"tpla {self.role} --rank K --group-size {self.size} --group-addr {self.address}"


def parse_group_addr(addr: str) -> tuple[str, int]:
    """HOST:PORT of a group's leader rendezvous (an IPv6 literal as [::1]:29500);
    ValueError naming the setting."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--group-addr {addr!r} is not HOST:PORT (TPLA_GROUP_ADDR)")
    return host, int(port)


def config_digest(model_dir: str) -> str:
    """A model as identities compare it: ranks on other hosts may mount it at other paths."""
    config_json = Path(model_dir) / "config.json"
    return f"config.json sha256 {hashlib.sha256(config_json.read_bytes()).hexdigest()[:16]}"

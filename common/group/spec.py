"""What a rank group is, for the machinery that forms it: its size, how its ranks sit on
hosts, rendezvous, device kind, collectives, timeouts and the identity every rank must share.

Ranks sit on hosts in runs of `local_size`: host h runs ranks h x local_size ..
(h + 1) x local_size - 1, the first of them spawning the others beside itself (one device
each: NCCL then joins them over NVLink and shared memory). A spawned group is one host
(`local_size` = size); a group whose hosts join the leader over the network has size /
local_size of them, one pod per node in Kubernetes.

Decode groups and prefill groups each build theirs from their own config (`GroupSpec.from_config`
reads what both configs name alike, `GroupConfig`); everything in common/group (process-group
init, the shared-memory file, spawned ranks, the join protocol) reads only this.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class GroupConfig(Protocol):
    """Where and how a service's ranks meet, as its config names it (the decode leader's
    `EngineConfig`, a prefill worker's `PrefillGroupConfig`)."""

    @property
    def device(self) -> str: ...
    @property
    def collectives(self) -> str: ...
    @property
    def collective_timeout_s(self) -> float: ...
    @property
    def join_timeout_s(self) -> float: ...
    @property
    def load_timeout_s(self) -> float: ...
    @property
    def master_addr(self) -> str: ...
    @property
    def master_port(self) -> int: ...
    @property
    def shm_path(self) -> str | None: ...
    @property
    def host(self) -> str: ...
    @property
    def advertise_host(self) -> str: ...  # "": the host
    @property
    def local_ranks(self) -> int: ...  # ranks per host of a joined group


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
    # Every rank has loaded its share by then (the start-up barrier): reading a real
    # checkpoint's share takes minutes, and ranks finish it minutes apart.
    load_timeout_s: float = 1800.0
    spawned: bool = True  # every rank is the leader's child; else hosts join on their own
    # Ranks per host, each host's first spawning the rest (None: every rank when spawned,
    # else one); the size is a multiple of it.
    local_size: int | None = None
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

    @classmethod
    def from_config(
        cls,
        cfg: GroupConfig,
        *,
        role: str,
        size: int,
        spawned: bool,
        port_setting: str,
        identity: Callable[[], dict[str, str]],
        settings: tuple[tuple[str, str], ...],
    ) -> GroupSpec:
        """The spec of a group whose config is `cfg`: its rendezvous, device, collectives,
        timeouts and addresses as `cfg` names them; the rest as its service says."""
        return cls(
            role=role,
            size=size,
            device=cfg.device,
            collectives=cfg.collectives,
            collective_timeout_s=cfg.collective_timeout_s,
            join_timeout_s=cfg.join_timeout_s,
            load_timeout_s=cfg.load_timeout_s,
            spawned=spawned,
            local_size=None if spawned else cfg.local_ranks,
            addr=cfg.master_addr,
            port=cfg.master_port,
            port_setting=port_setting,
            shm_path=cfg.shm_path,
            host=cfg.host,
            advertise_host=cfg.advertise_host or cfg.host,
            identity=identity,
            settings=settings,
        )

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a group has at least one rank, not {self.size}")
        if self.collectives not in ("shm", "dist"):
            raise ValueError(f"collectives {self.collectives!r} is not shm or dist")
        if self.local_size is None:
            object.__setattr__(self, "local_size", self.size if self.spawned else 1)
        if not (self.local_size and self.size % self.local_size == 0):
            raise ValueError(f"a group of {self.size} ranks cannot sit {self.local_size} to a host")

    @property
    def address(self) -> str:
        return f"{self.addr}:{self.port}"

    @property
    def per_host(self) -> int:
        """Ranks on each host (`local_size`, filled in)."""
        assert self.local_size is not None  # __post_init__
        return self.local_size

    @property
    def hosts(self) -> int:
        return self.size // self.per_host

    def local_index(self, rank: int) -> int:
        """Rank `rank`'s index on its host (the offset of its GPU and its ports)."""
        return rank % self.per_host

    def host_ranks(self, rank: int) -> range:
        """The ranks that rank `rank` spawns beside itself: the rest of its host's when it is
        the host's first, else none."""
        if self.local_index(rank):
            return range(0)
        return range(rank + 1, rank + self.per_host)

    def setting(self, key: str) -> str:
        """The setting that changes identity field `key`."""
        return dict(self.settings).get(key, key)

    @property
    def join_command(self) -> str:
        """How an operator starts one missing rank (a host's ranks, when it runs several)."""
        if self.per_host > 1 and not self.spawned:
            return f"tpla {self.role} --node K --nodes {self.hosts} --group-addr {self.address}"
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

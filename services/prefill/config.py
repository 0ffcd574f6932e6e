"""A prefill worker's configuration: everything its ranks and its batcher start with.

Frozen dataclasses, validated when built; `prefill_config` maps the settings (env and flags,
`common/runtime/settings.py`) onto them, once. A spawned rank of a prefill group receives its
leader's `PrefillGroupConfig` as JSON; a rank started on its own builds its own from its
settings, which the join checks against the leader's (services/prefill/group/spec.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from common.group.membership import joined, membership
from common.kv.prefix_cache import model_identity
from common.loading.side_file_choice import resolve_reparam
from common.parallel import MoeParallel, ParallelConfig
from common.runtime.kernel_choice import KernelConfig, kernel_config
from common.runtime.settings import Settings
from common.sampling.grammar_limits import DEFAULT_LIMITS, GrammarLimits
from services.prefill.batch.latent_cache import LatentPrefixCache
from services.prefill.batch.threads import PrefillThreads


@dataclass(frozen=True)
class PrefillGroupConfig:
    model: str
    reparam: str | None = None
    tp: int = 1
    dtype: str = "float32"
    weight_dtype: str = "auto"
    index_cache_dtype: str = "model"  # DSA: the decode groups' indexer key format
    device: str = "cpu"  # "cpu", or "cuda" / "cuda:N": rank k on GPU N + k
    # What each kernel selector is asked for (TPLA_ATTENTION_BACKEND, TPLA_FP8_GEMM,
    # TPLA_EXPERTS_KERNEL): each rank chooses by it at start-up (`PrefillKernels`).
    kernels: KernelConfig = field(default_factory=KernelConfig)
    moe_parallel: str = "tp"  # routed experts: a column slice of each (tp) or whole ones (ep)
    transport: str = "grpc"  # each rank's KV sender
    token: str | None = None  # the internal token on KV pushes
    worker_id: str = "prefill"  # the worker's id: its ranks' torch pairs are named after it
    prefix_cache_mb: float = 0.0  # per rank: every rank holds a replica
    torch_threads: int = 1
    prefill_threads: int = 1  # a large batch's threads (services/prefill/batch/threads.py)
    collectives: str = "shm"
    mtp: bool = False  # TPLA_SPECULATIVE=mtp: every rank runs its share of the MTP layer
    spawned: bool = True  # the leader spawns its ranks; else hosts join (`--rank K`, `--node K`)
    local_ranks: int = 1  # joined: ranks per host, the first spawning the rest
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free one (a spawned group)
    join_timeout_s: float = 300.0
    load_timeout_s: float = 1800.0  # every rank has loaded its share by then
    collective_timeout_s: float = 120.0
    shm_path: str | None = None  # set by the leader
    host: str = "127.0.0.1"
    advertise_host: str = ""

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"a prefill group has at least one rank, not {self.tp}")
        if not self.spawned and self.collectives == "shm":
            raise ValueError(
                "TPLA_COLLECTIVES=shm: shared memory cannot reach ranks started on their own "
                "(--rank / --node / --group-addr), which may run on other hosts; use dist or auto"
            )
        if self.local_ranks < 1 or self.tp % self.local_ranks:
            raise ValueError(f"{self.local_ranks} ranks a host do not divide a group of {self.tp}")

    @property
    def in_process(self) -> bool:
        """Whether the whole model runs in this process: no other rank to start or join."""
        return self.tp == 1 and self.spawned

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PrefillGroupConfig:
        raw = json.loads(text)
        return cls(kernels=KernelConfig(**raw.pop("kernels")), **raw)


def prefill_group_config(s: Settings) -> PrefillGroupConfig:
    """A prefill worker's group from `placed` settings: TPLA_PREFILL_TP ranks the leader
    spawns, or (`--rank K --group-size N --group-addr HOST:PORT`) ranks each started on its
    own; ValueError naming what is wrong."""
    if s.collectives not in ("auto", "shm", "dist"):
        raise ValueError(f"collectives {s.collectives!r} is not auto, shm or dist")
    if s.moe_parallel not in ("tp", "ep"):
        raise ValueError(f"MoE parallel mode {s.moe_parallel!r} is not tp or ep")
    tp, spawned, addr, port, local = s.prefill_tp, True, "127.0.0.1", s.prefill_dist_port, 1
    if joined(s):
        place = membership(s, s.prefill_tp, "TPLA_PREFILL_TP")
        tp, spawned, addr, port, local = (
            place.size,
            False,
            place.addr,
            place.port,
            place.local_ranks,
        )
    collectives = s.collectives
    if collectives == "auto":
        collectives = "shm" if spawned else "dist"
    return PrefillGroupConfig(
        model=s.model,
        reparam=resolve_reparam(s.model, s.reparam),
        tp=tp,
        dtype=s.dtype,
        weight_dtype=s.weight_dtype,
        index_cache_dtype=s.index_cache_dtype,
        device=s.device,
        kernels=kernel_config(s),
        moe_parallel=s.moe_parallel,
        transport=s.transport,
        token=s.internal_token.get_secret_value() if s.internal_token else None,
        prefix_cache_mb=s.prefix_cache_mb if s.prefix_cache else 0.0,
        torch_threads=s.torch_threads,
        prefill_threads=s.prefill_threads,
        collectives=collectives,
        mtp=s.speculative == "mtp",
        spawned=spawned,
        local_ranks=local,
        master_addr=addr,
        master_port=port,
        join_timeout_s=s.group_join_timeout_s,
        load_timeout_s=s.load_timeout_s,
        host=s.host,
        advertise_host=s.advertise_host,
    )


@dataclass(frozen=True)
class PrefillConfig:
    """A prefill worker: its model and ranks (`group`), how its batcher batches and ships."""

    group: PrefillGroupConfig
    # One push may take at most this long even when the request allows more: a hung decode
    # rank must fail the request, not hold this worker's pushers for minutes.
    transfer_timeout_s: float = 30.0
    max_batch_tokens: int = 2048  # prompts per batch fill this many tokens at most
    chunk_tokens: int | None = None  # a longer prompt's piece per batch; None: the device's
    threads: PrefillThreads | None = None  # None: every batch on the process's thread count
    grammar_limits: GrammarLimits = DEFAULT_LIMITS  # each structured output's parser budget


def prefill_config(s: Settings) -> PrefillConfig:
    """A prefill worker's config from `placed` settings: the one mapping of the two;
    ValueError naming what is wrong."""
    return PrefillConfig(
        group=prefill_group_config(s),
        transfer_timeout_s=s.transfer_timeout_s,
        max_batch_tokens=s.prefill_batch_tokens,
        chunk_tokens=s.prefill_chunk_tokens,
        threads=PrefillThreads.from_settings(s),
        grammar_limits=GrammarLimits.from_settings(s),
    )


def prefix_cache(cfg: PrefillGroupConfig) -> LatentPrefixCache | None:
    """A rank's replica of the group's latent prefix cache (None: no cache). Every rank
    builds it alike and runs the same lookups and stores in the same order (the leader's
    plans), so every replica holds the same prompts: each rank prefills over its own copy of
    a prompt's past latents, and nothing crosses between ranks."""
    budget = int(cfg.prefix_cache_mb * 2**20)
    if budget <= 0:
        return None
    return LatentPrefixCache(model_identity(cfg.model, cfg.reparam), budget)


def rank_layout(cfg: PrefillGroupConfig) -> ParallelConfig:
    """The ranks' shares: MLA-TP over the group (heads, FFN columns or experts, vocabulary)."""
    return ParallelConfig(tp=cfg.tp, moe=MoeParallel(cfg.moe_parallel))

"""The decode engine's configuration: everything a rank starts with.

Frozen dataclasses, validated when built; `engine_config` maps the settings (env and flags,
`common/runtime/settings.py`) onto them, once. A spawned follower receives its leader's
`EngineConfig` as JSON; a rank started on its own builds its own, which it checks against
the group's (common/group/join.py).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field

from common.group.membership import joined, membership
from common.loading.side_file_choice import resolve_reparam
from common.parallel import ParallelConfig, RmsNormMode, parse_mode, parse_moe
from common.runtime.kernel_choice import KernelConfig, kernel_config
from common.runtime.ports import TORCH_PORT_OFFSET
from common.runtime.settings import Settings
from common.sampling.grammar_limits import GrammarLimits


class Launch(enum.Enum):
    """How a decode group's follower ranks start (common/group/join.py: both then join
    the same way)."""

    SPAWN = "spawn"  # children of the leader, on its host (`tpla decode`, `tpla serve`)
    # Hosts join over the network (`tpla decode --rank K`, one rank a host, or `--node K`,
    # `local_ranks` a host, the first spawning the rest).
    JOIN = "join"


# Draft proposers (services/decode/leader/drafts.py); "mtp" needs the model's MTP layer
# (`num_nextn_predict_layers`) and is refused, named, on a model without one.
PROPOSERS = ("none", "ngram", "mtp")
# Drafts per sequence and step when TPLA_SPEC_TOKENS is 0, by proposer (benchmarks/
# speculative.md): n-gram drafts cost no model pass and on edits are kept in long runs
# (k = 4 beat k = 8); each chained MTP draft costs a pass of the MTP layer and is kept less
# often than the first (k = 1 beat k = 4 at every load), as DeepSeek-V3 serves its one module.
DEFAULT_SPEC_TOKENS = {"ngram": 4, "mtp": 1}
# TPLA_LOCAL_PREFILL_CHUNK_TOKENS when unset, on the CPU and on CUDA: a chunk costs the running
# streams about one step's time there (benchmarks/disagg.md).
DEFAULT_LOCAL_PREFILL_CHUNK = {False: 256, True: 2048}


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: drafts verified in the step (docs/design.md §7)."""

    method: str = "none"  # PROPOSERS
    tokens: int = 4  # k: drafts per sequence and step at most
    # No speculation in a step of more sequences than this: drafts pay at low batch, where a
    # step costs its overhead, and cost at high batch, where it costs its rows.
    max_batch: int = 4

    def __post_init__(self) -> None:
        if self.method not in PROPOSERS:
            raise ValueError(
                f"speculative method {self.method!r} is not one of {', '.join(PROPOSERS)}"
            )
        if self.tokens < 1 or self.max_batch < 1:
            raise ValueError("TPLA_SPEC_TOKENS and TPLA_SPEC_MAX_BATCH must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def speculates(self, batch: int) -> bool:
        """Whether a step of `batch` sequences drafts (and runs an MTP pass)."""
        return self.enabled and batch <= self.max_batch


@dataclass(frozen=True)
class EngineConfig:
    model: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    reparam: str | None = None  # TPLA side file in the model dir, e.g. "tpla_pca"; None: none
    block_size: int = 16
    kv_budget_mb: float = 256.0  # per rank
    max_batch: int = 32
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    dtype: str = "float32"
    weight_dtype: str = "auto"  # an FP8 checkpoint's weights: auto | float8 | dequantize
    index_cache_dtype: str = "model"  # DSA's indexer keys: model | fp8 (index_keys.FORMATS)
    # "cpu" for every rank, or "cuda" / "cuda:N": rank k on GPU N + k (`rank_device`).
    device: str = "cpu"
    lease_seconds: float = 30.0
    torch_threads: int = 1
    # What each kernel selector is asked for (TPLA_DECODE_KERNEL, TPLA_FP8_GEMM,
    # TPLA_EXPERTS_KERNEL): each rank chooses by it at start-up (rank/runtime.py).
    kernels: KernelConfig = field(default_factory=KernelConfig)
    # Replay each step bucket's CUDA graph (services/decode/rank/graphs.py) where the ranks
    # run on CUDA; ignored on the CPU.
    cuda_graphs: bool = True
    # "shm": the group's CPU collectives (plans; activations too on the CPU) go through
    # shared memory when the native library is there (its ranks share a host); "dist":
    # torch.distributed's gloo. Activations on GPUs always go through NCCL.
    collectives: str = "shm"
    shm_path: str | None = None  # set by the leader: the group file its ranks map
    launch: Launch = Launch.SPAWN
    local_ranks: int = 1  # JOIN: ranks per host (a spawned group is one host)
    # The leader's rendezvous store (a TCPStore it serves on master_port, every interface):
    # where the followers join the group.
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    join_timeout_s: float = 300.0  # every follower joins (a follower: the leader answers) by then
    load_timeout_s: float = 1800.0  # every rank has loaded its share by then
    collective_timeout_s: float = 120.0
    record_logits: bool = False  # keep each step's logits on token events (tests, eval)
    # KV receivers: rank k serves KvReceiver on kv_port_base + k and, for the torch
    # transport, a TCPStore on kv_port_base + TORCH_PORT_OFFSET + k. None: no receivers.
    host: str = "127.0.0.1"
    # The host others (the leader, prefill workers) reach this rank's receiver at; "" = host.
    advertise_host: str = ""
    kv_port_base: int | None = None
    internal_token: str | None = None
    # Keep finished prompts' full blocks for reuse by later prompts (common.kv.prefix_cache).
    prefix_cache: bool = True
    speculative: SpecConfig = field(default_factory=SpecConfig)
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)  # the leader's
    # Prompt tokens the group prefills itself between two decode steps at most, when a router
    # sends it a prompt to prefill (services/decode/leader/local_prefill.py); 0: it never
    # does, and its ranks hold no prefill weights.
    local_prefill_chunk_tokens: int = 256

    def __post_init__(self) -> None:
        if self.launch is Launch.JOIN and self.collectives == "shm":
            raise ValueError(
                "TPLA_COLLECTIVES=shm: shared memory cannot reach ranks started on their own "
                "(--rank / --node / --group-addr), which may run on other hosts; use dist or auto"
            )
        if self.local_ranks < 1 or self.parallel.tp % self.local_ranks:
            raise ValueError(f"{self.local_ranks} ranks a host do not divide tp={self.parallel.tp}")

    @property
    def per_host(self) -> int:
        """Ranks on each host: the whole group when spawned."""
        return self.parallel.tp if self.launch is Launch.SPAWN else self.local_ranks

    def context_limit(self, model_positions: int) -> int:
        """The longest sequence (prompt + output) the group holds: `max_model_len`
        (TPLA_MAX_MODEL_LEN) within the model's context, `model_positions`."""
        return min(self.max_model_len or model_positions, model_positions)

    @property
    def local_prefill(self) -> bool:
        """Whether the group prefills prompts itself when asked (its ranks hold the weights)."""
        return self.local_prefill_chunk_tokens > 0

    def local_index(self, rank: int) -> int:
        """Rank `rank`'s index on its host: the offset of its GPU (`rank_device`) and of its
        KV ports (its host's TPLA_DEVICE and TPLA_KV_PORT_BASE)."""
        return rank % self.per_host

    def kv_addresses(self, rank: int) -> tuple[str, str]:
        """(gRPC receiver, torch TCPStore) addresses of rank `rank`'s KV endpoints, when this
        process runs it: receiver on kv_port_base + its local index, the store 100 above."""
        assert self.kv_port_base is not None
        host, port = self.advertise_host or self.host, self.kv_port_base + self.local_index(rank)
        return f"{host}:{port}", f"{host}:{port + TORCH_PORT_OFFSET}"

    def to_json(self) -> str:
        raw = dataclasses.asdict(self)
        raw["parallel"] = self.parallel.to_dict()
        raw["launch"] = self.launch.value
        return json.dumps(raw)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        raw = json.loads(text)
        parallel = ParallelConfig.parse(**raw.pop("parallel"))
        raw["launch"] = Launch(raw["launch"])
        spec = SpecConfig(**raw.pop("speculative"))
        limits = GrammarLimits(**raw.pop("grammar_limits"))
        kernels = KernelConfig(**raw.pop("kernels"))
        return cls(
            parallel=parallel, speculative=spec, grammar_limits=limits, kernels=kernels, **raw
        )


def engine_config(s: Settings) -> EngineConfig:
    """The decode engine's config from `placed` settings: the one mapping of the two."""
    mode, moe = parse_mode(s.parallel), parse_moe(s.moe_parallel)
    if s.cuda_graphs not in ("auto", "0"):
        raise ValueError(f"cuda_graphs {s.cuda_graphs!r} is not auto or 0")
    if s.collectives not in ("auto", "shm", "dist"):
        raise ValueError(f"collectives {s.collectives!r} is not auto, shm or dist")
    tp, launch, master_addr, master_port, local = s.tp, Launch.SPAWN, "127.0.0.1", s.dist_port, 1
    if joined(s):
        place = membership(s, s.tp, "TPLA_TP")
        tp, master_addr, master_port, local = place.size, place.addr, place.port, place.local_ranks
        launch = Launch.JOIN
    collectives = s.collectives
    if collectives == "auto":
        collectives = "shm" if launch is Launch.SPAWN else "dist"
    return EngineConfig(
        model=s.model,
        parallel=ParallelConfig(
            tp=tp,
            latent_groups=mode.latent_groups(s.latent_groups),
            rmsnorm=RmsNormMode(s.rmsnorm),
            mode=mode,
            chunk_size=s.chunk_size,
            moe=moe,
        ),
        reparam=resolve_reparam(s.model, s.reparam),
        block_size=s.block_size,
        kv_budget_mb=s.kv_budget_mb,
        max_batch=s.max_batch,
        max_model_len=s.max_model_len or None,
        dtype=s.dtype,
        weight_dtype=s.weight_dtype,
        index_cache_dtype=s.index_cache_dtype,
        device=s.device,
        lease_seconds=s.lease_seconds,
        torch_threads=s.torch_threads,
        kernels=kernel_config(s),
        cuda_graphs=s.cuda_graphs == "auto",
        collectives=collectives,
        launch=launch,
        local_ranks=local,
        master_addr=master_addr,
        master_port=master_port,
        join_timeout_s=s.group_join_timeout_s,
        load_timeout_s=s.load_timeout_s,
        host=s.host,
        advertise_host=s.advertise_host,
        kv_port_base=s.kv_port_base,
        internal_token=s.internal_token.get_secret_value() if s.internal_token else None,
        prefix_cache=s.prefix_cache,
        speculative=SpecConfig(
            s.speculative,
            s.spec_tokens or DEFAULT_SPEC_TOKENS.get(s.speculative, 1),
            s.spec_max_batch,
        ),
        grammar_limits=GrammarLimits.from_settings(s),
        local_prefill_chunk_tokens=(
            s.local_prefill_chunk_tokens
            if s.local_prefill_chunk_tokens is not None
            else DEFAULT_LOCAL_PREFILL_CHUNK[s.device.startswith("cuda")]
        ),
    )

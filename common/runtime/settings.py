"""The one place environment variables are read (prefix `TPLA_`); CLI flags override them."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TPLA_", extra="ignore")

    # -- model and compute ----------------------------------------------------------------
    model: str = Field("models/demo", description="HF-format model directory")
    served_model_name: str = Field("tpla-demo", description="the `model` name clients use")
    generation_config: str = Field(
        "auto",
        description="sampling defaults for requests that leave them out: auto (the model's "
        "generation_config.json) | none (the server's own) | a JSON object of overrides over "
        "the file (common/sampling/defaults.py)",
    )
    dtype: str = Field(
        "auto", description="auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16"
    )
    weight_dtype: str = Field(
        "auto",
        pattern="^(auto|quantized|float8|dequantize)$",
        description="a quantized checkpoint's weights (DeepSeek's block FP8 linears, "
        "compressed-tensors' INT4 experts): quantized (kept as stored, dequantized as each is "
        "used; float8 is its older name) | dequantize (to TPLA_DTYPE at load) | auto "
        "(quantized on CUDA, dequantize on the CPU, where the per-use dequantization costs "
        "more than it saves)",
    )
    fp8_gemm: str = Field(
        "auto",
        pattern="^(auto|scaled_mm|triton|dequantize)$",
        description="how an FP8-resident linear weight is applied: scaled_mm (the activation "
        "quantized per 1x128 group, torch's block-scaled scaled_mm; sm_90, CUDA 12.9+) | "
        "triton (the same recipe in the Triton block-scaled GEMM; CUDA sm_89+, or the CPU "
        "under TRITON_INTERPRET=1) | dequantize (on use, any device) | auto (on CUDA scaled_mm "
        "where the device runs it, else triton where it runs; else dequantize); a weight "
        "whose slice the GEMM cannot read dequantizes either way, with the reason logged; a "
        "named GEMM the device cannot run stops the start-up",
    )
    device: str = Field(
        "auto", description="auto (cuda when visible) | cpu | cuda | cuda:N (decode rank k: N + k)"
    )
    # The local stack runs several processes on a small machine: each process gets a fixed
    # intra-op thread budget instead of torch's default of one thread per core.
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per process")
    prefill_threads: int = Field(
        1,
        ge=1,
        description="intra-op threads of a prefill batch of >= 512 tokens (at least "
        "torch_threads, at most the usable cores): for prefill workers with cores of their "
        "own; see services/prefill/batch/threads.py",
    )
    prefill_batch_tokens: int = Field(
        2048,
        ge=1,
        description="prompt tokens per prefill batch at most (a longer prompt runs alone)",
    )
    prefill_chunk_tokens: int | None = Field(
        None,
        ge=0,
        description="a longer prompt is prefilled in chunks of this many tokens, one per "
        "batch (0: never; unset: 8192 on CUDA, 1024 on the CPU)",
    )
    local_prefill_chunk_tokens: int | None = Field(
        None,
        ge=0,
        description="a decode group that prefills a prompt itself (TPLA_DISAGG_POLICY) runs "
        "at most this many prompt tokens between two decode steps, so running streams keep "
        "stepping (0: the group never prefills, its ranks hold no prefill weights; unset: "
        "2048 on CUDA, 256 on the CPU)",
    )
    attention_backend: str = Field(
        "auto",
        description="prefill attention: auto (flash-attn on CUDA in fp16 / bf16 where "
        "installed, native on the CPU in fp32 where it builds; else sdpa) | sdpa | native "
        "(C++, fp32 CPU) | flash-attn; a named one that cannot run here stops the start-up",
    )
    index_cache_dtype: str = Field(
        "model",
        pattern="^(model|fp8)$",
        description="DeepSeek Sparse Attention models' indexer keys in the KV pools and on the "
        "wire: model (the model's dtype, HF-exact) | fp8 (DeepSeek's: Hadamard-rotated e4m3 "
        "with a power-of-two scale per key, 132 bytes a token a layer; benchmarks/fidelity.md)",
    )
    decode_kernel: str = Field(
        "auto",
        description="decode backend: auto (native on the CPU in fp32, triton on CUDA, each "
        "where it runs; else torch) | torch | native (C++, fp32 CPU) | triton; a named one "
        "that cannot run here stops the start-up",
    )
    experts_kernel: str = Field(
        "auto",
        description="a MoE layer's routed experts: auto (on CUDA triton where it runs; else "
        "grouped where this torch, device and dtype run grouped_mm: bf16 on CUDA sm_80+, fp32 / "
        "bf16 on the CPU; else loop) | triton (the Triton grouped GEMM over quantized experts, "
        "no dequantized copy: FP8 experts multiplied in FP8 over their blocks, INT4 experts as "
        "W4A16 over their packed words and group scales; CUDA sm_80+ (FP8 experts sm_89+), or "
        "the CPU under TRITON_INTERPRET=1; a layer whose experts are neither, whose FP8 column "
        "blocks it cannot read, or FP8 on a GPU before sm_89, runs grouped) | grouped (two "
        "grouped GEMMs, routed on the device) | loop "
        "(the per-expert reference); quantized experts without triton are dequantized a few "
        "experts at a time; a layer whose sizes grouped_mm cannot take runs the loop either "
        "way, with the reason logged; a named kernel the device cannot run stops the start-up",
    )
    cuda_graphs: str = Field(
        "auto",
        description="decode steps as CUDA graphs, one per batch and table-width bucket, all "
        "captured at start-up: auto (on CUDA devices) | 0 (never)",
    )
    collectives: str = Field(
        "auto",
        description="rank group collectives (decode and prefill groups): auto (shm for a "
        "spawned group, dist for ranks that joined over the network) | shm (shared memory, "
        "one host; else dist) | dist",
    )

    # -- structured outputs (common/sampling/grammar.py) ------------------------------------
    json_whitespace: str = Field(
        "compact",
        pattern="^(compact|bounded)$",
        description="whitespace a JSON output (response_format, structured_outputs.json, tool "
        "calls) allows between two of its tokens: compact (at most one space, no line breaks; "
        "bounded like vLLM's and SGLang's 'disable any whitespace') | bounded (a "
        "pretty-printer's indentation, at most 16 blanks)",
    )
    grammar_max_items_in_row: int = Field(
        2000, ge=1, description="llguidance: Earley items in one parser row (ambiguity)"
    )
    grammar_step_max_items: int = Field(
        50_000, ge=1, description="llguidance: Earley items one token mask may create (~20k/ms)"
    )
    grammar_step_lexer_fuel: int = Field(
        200_000, ge=1, description="llguidance: lexer work one token mask may spend (~14k/ms)"
    )
    grammar_initial_lexer_fuel: int = Field(
        1_000_000, ge=1, description="llguidance: lexer work to build a grammar (~50k/ms)"
    )

    # -- reasoning models (services/router/reasoning.py) ------------------------------------
    reasoning_parser: str = Field(
        "auto",
        description="how a reasoning model's output is split into reasoning and content: auto "
        "(by config.json's model_type and the chat template; off for a model that never writes "
        "</think>, the demo's) | none | deepseek_r1 | deepseek_v3 (V3.1, V3.2) | glm45 | "
        "kimi_k2 (vLLM's and SGLang's names, with _ or -)",
    )
    reasoning_fields: str = Field(
        "both",
        pattern="^(both|reasoning_content|reasoning)$",
        description="the response fields the reasoning goes out in: both (reasoning_content, "
        "SGLang's and DeepSeek's, and reasoning, vLLM's: a client reads the one it knows) | "
        "reasoning_content | reasoning",
    )

    # -- decode group -----------------------------------------------------------------------
    tp: int = Field(2, ge=1, description="decode ranks per group")
    latent_groups: int = Field(2, ge=1, description="TPLA latent groups r (1 = MLA-TP)")
    parallel: str = Field("tpla", description="decode parallel mode: tpla | mla-tp | sp")
    chunk_size: int = Field(256, ge=1, description="SP: tokens per round-robin chunk")
    moe_parallel: str = Field(
        "tp",
        description="MoE experts over a group's ranks: tp (a column slice of every expert) | "
        "ep (whole experts, E/tp per rank); shared experts are split by columns either way",
    )
    rmsnorm: str = Field("exact", description="TPLA RMSNorm for new tokens: exact | sliced")
    reparam: str = Field(
        "auto",
        description="TPLA side file in the model dir: auto (tpla_pca.json when present, else "
        "the identity basis with a warning) | none (the identity basis) | a side file's name, "
        "required (tpla_hadamard, my_basis.json: a missing one is a start-up error)",
    )
    block_size: int = Field(16, ge=1)
    kv_budget_mb: float = Field(256.0, gt=0, description="KV pool per decode rank")
    max_batch: int = Field(32, ge=1, description="decode batch limit per group")
    max_model_len: int = Field(
        0,
        ge=0,
        description="the longest sequence (prompt + max_tokens) served, at most the model's "
        "context (0: the model's): the router refuses longer requests, and a decode group's "
        "block tables and CUDA graphs are sized by it",
    )
    speculative: str = Field(
        "none",
        description="speculative decoding drafts: none | ngram (prompt lookup on the leader) | "
        "mtp (drafts from the checkpoint's MTP layer, DeepSeek-V3's num_nextn_predict_layers)",
    )
    spec_tokens: int = Field(
        0,
        ge=0,
        description="drafts per sequence and step at most (k); 0: the proposer's default "
        "(ngram 4, mtp 1: benchmarks/speculative.md)",
    )
    spec_max_batch: int = Field(
        4,
        ge=1,
        description="no speculation in a decode step of more sequences than this: drafts pay "
        "where a step costs its overhead, not its rows (benchmarks/speculative.md)",
    )
    lease_seconds: float = Field(
        30.0,
        gt=0,
        description="a reservation not started by then is freed; each of its KV shards "
        "landing on decode rank 0 (a prompt's chunk) runs it that long again",
    )
    # A group across hosts: every rank is a `tpla decode --rank K --group-size N --group-addr
    # HOST:PORT` of its own (common/group/join.py); without them the leader spawns
    # its ranks.
    rank: int = Field(0, ge=0, description="this process's rank in a joined group (0: leader)")
    group_size: int = Field(
        0, ge=0, description="ranks of a joined group (= tp); 0: the leader spawns its followers"
    )
    group_addr: str = Field("", description="HOST:PORT of a joined group's leader rendezvous")
    # Or a group over hosts that each run several ranks (one pod per node): `--node K --nodes
    # M`, host K running ranks K x L .. K x L + L - 1 of the service's tp, L = tp / M.
    node: int = Field(0, ge=0, description="this host's index in a group over hosts (0: leader)")
    nodes: int = Field(
        0, ge=0, description="hosts of a group over hosts, each spawning tp / nodes ranks; 0: none"
    )
    advertise_host: str = Field(
        "", description="host the leader and prefill workers reach this rank at (default: host)"
    )
    group_join_timeout_s: float = Field(
        300.0, gt=0, description="longest wait for every rank of a group to join (or its leader)"
    )
    load_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="longest wait at a group's start-up barrier for every rank to load its "
        "share (a real checkpoint's share takes minutes, its ranks finish minutes apart); "
        "each step's collectives keep their own, shorter timeout",
    )
    prefix_cache: bool = Field(
        True,
        description="reuse cached prompt prefixes: decode groups keep finished prompts' "
        "blocks (evicted least recently used), prefill workers keep their latents",
    )
    prefix_cache_mb: float = Field(
        256.0, ge=0, description="prefill worker's latent prefix cache budget (0 = none)"
    )
    overlap_weight: float = Field(
        1.0,
        ge=0,
        description="kv-aware routing: cost of one prompt block a group must receive, "
        "against one KV block it holds for live requests",
    )

    # -- prefill group -------------------------------------------------------------------------
    prefill_tp: int = Field(
        1, ge=1, description="ranks of a prefill worker, one device each (1: one process)"
    )
    prefill_dist_port: int = Field(
        29700, description="prefill group rendezvous port (apart from the decode groups')"
    )

    # -- local stack (`tpla serve`) ------------------------------------------------------------
    decode_groups: int = Field(1, ge=1, description="decode groups `tpla serve` starts")
    prefill_workers: int = Field(1, ge=1, description="prefill workers `tpla serve` starts")

    # -- network ---------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="interface the services bind")
    router_port: int = Field(8000)
    prefill_port: int = Field(50051)
    decode_port: int = Field(50061)
    kv_port_base: int = Field(50071, description="decode rank k receives KV on base + k")
    dist_port: int = Field(29500, description="decode group rendezvous port")
    redis_url: str | None = Field(None, description="unset: `tpla serve` embeds a Redis")
    transport: str = Field("grpc", description="KV transfer: grpc | torch")
    internal_token: SecretStr | None = Field(None, description="shared token on internal gRPC")
    api_keys: SecretStr | None = Field(None, description="comma-separated router API keys")

    # -- router admission --------------------------------------------------------------------
    max_inflight: int = Field(64, ge=1, description="requests in flight per router")
    max_waiting: int = Field(256, ge=0, description="admitted requests waiting for a slot")
    queue_timeout_s: float = Field(30.0, gt=0, description="longest wait for a slot or KV")
    max_inflight_per_group: int = Field(64, ge=1, description="per decode group, per router")
    routing_policy: str = Field(
        "kv-aware",
        description="kv-aware (prefix overlap against load) | least-loaded | round-robin",
    )
    disagg_policy: str = Field(
        "always",
        pattern="^(always|auto|never)$",
        description="where a prompt is prefilled: always (a prefill worker) | auto (the "
        "decode group when its uncached part is at most TPLA_LOCAL_PREFILL_MAX_TOKENS and "
        "the group's queue of local prefill tokens allows it, else a prefill worker) | never "
        "(the decode group); with no healthy prefill worker, or its circuit open, the decode "
        "group prefills whatever the policy",
    )
    local_prefill_max_tokens: int = Field(
        512, ge=0, description="auto: the largest uncached prompt part a decode group prefills"
    )
    local_prefill_queue_tokens: int = Field(
        256,
        ge=0,
        description="auto: a decode group prefills locally only while this router's local "
        "prefill tokens in flight there stay within this many",
    )
    prefill_circuit_failures: int = Field(
        3,
        ge=1,
        description="consecutive failed remote prefills that open the prefill circuit: the "
        "decode groups then prefill every prompt for TPLA_WORKER_TTL_S, after which one "
        "remote try closes it again or keeps it open",
    )
    request_timeout_s: float = Field(300.0, gt=0)
    # A stream that stalls this long (a hung rank, a stopped process) fails instead of hanging.
    token_timeout_s: float = Field(30.0, gt=0, description="longest gap between two tokens")
    transfer_timeout_s: float = Field(30.0, gt=0, description="deadline of one KV push")
    migrate: bool = Field(True, description="move a stream to another group if its group dies")
    heartbeat_s: float = Field(2.0, gt=0)
    worker_ttl_s: float = Field(10.0, gt=0)
    # Below Kubernetes' terminationGracePeriodSeconds (k8s/base), which must also cover the
    # shutdown after it: past that grace the pod is SIGKILLed and its streams re-prefilled.
    drain_grace_s: float = Field(
        25.0, ge=0, description="on SIGTERM, longest wait for a worker's live requests to end"
    )
    log_prompts: bool = Field(False, description="log prompts and outputs (off by default)")


def placed(settings: Settings) -> Settings:
    """`settings` with an `auto` device and dtype resolved for this machine; a DeviceError
    (a ValueError: the CLI prints it and exits 2) where the device does not exist. What every
    command that computes starts with, before it starts anything else."""
    from common.runtime.device import resolve_device, resolve_dtype  # torch only where it computes

    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    return settings.model_copy(update={"device": device, "dtype": dtype})


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit (non-None) overrides applied."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})

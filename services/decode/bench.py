"""`tpla bench decode-step`: the real engine's step time, MLA-TP and TPLA side by side.

Synthetic latents are written into reserved blocks (the step cost does not depend on their
values), then every request decodes with ignore_eos. Each configuration reports the median
of `steps` step times per batch size, timing only steps that run the whole batch (requests
join and leave one by one; a partial batch is a cheaper step), after warm-up; ratios against
MLA-TP (r = 1) come from the same run.
"""

from __future__ import annotations

import statistics
import uuid
from dataclasses import dataclass

import torch

from common.model.tpla import RmsNormMode
from common.sampling import SamplingParams
from services.decode.config import EngineConfig, ParallelConfig, ParallelMode
from services.decode.engine import DecodeEngine

WARMUP_STEPS = 2  # full-batch steps not timed (first calls into each kernel's buffers)


@dataclass(frozen=True)
class StepResult:
    layout: str  # mla-tp | tpla | sp
    collectives: str  # shm | dist
    tp: int
    latent_groups: int
    batch: int
    context: int
    median_ms: float
    step_ms: list[float]  # every timed step (full batch, after warm-up), in order
    cache_bytes_per_token_layer: int  # per rank, per cached token (SP: a rank caches ~1/tp)
    cache_bytes_per_sequence: int  # rank 0's share of one sequence's cache at `context`
    comm_bytes_per_step: int  # payload rank 0 puts into collectives per step (measured)
    parameter_bytes_rank0: int


def measure(
    model: str,
    layout: str,
    tp: int,
    r: int,
    batches: list[int],
    context: int,
    steps: int,
    reparam: str | None,
    threads: int = 1,
    chunk_size: int = 256,
    kernel: str = "auto",
    collectives: str = "shm",
) -> list[StepResult]:
    """Median step time per batch size for one layout, with its cache and comm footprint."""
    mode = ParallelMode.SP if layout == "sp" else ParallelMode.TPLA
    par = ParallelConfig(tp, r, RmsNormMode.EXACT, mode, chunk_size)
    cfg = EngineConfig(
        model=model,
        parallel=par,
        reparam=reparam if r > 1 else None,
        master_port=0,
        max_batch=max(batches),
        kv_budget_mb=512,
        torch_threads=threads,
        decode_kernel=kernel,
        collectives=collectives,
    )
    results = []
    with DecodeEngine(cfg) as engine:
        cache = engine.runtime.layout
        comm = engine.runtime.comm
        for batch in batches:
            # Requests join one by one and leave as they started: only steps that run the
            # whole batch are timed. Each request is long enough for `steps` of them plus
            # warm-up, whatever the spread of joins.
            params = SamplingParams(
                max_tokens=steps + batch + WARMUP_STEPS + 2, temperature=0.0, ignore_eos=True
            )
            streams = []
            for _ in range(batch):
                rid = uuid.uuid4().hex
                engine.reserve(rid, context, params.max_tokens)
                for rank in range(tp):
                    tokens = engine.pool.local_tokens(rank, context)
                    n = torch.randn(cache.num_layers, tokens, cache.latent_width) * 0.1
                    k_pe = torch.randn(cache.num_layers, tokens, cache.rope_width) * 0.1
                    engine.write_kv(rid, rank, n, k_pe)
                streams.append((rid, params))
            steps_seen: list[tuple[float, int, int]] = []  # (seconds, batch, comm bytes after)
            before = comm.bytes

            def record(seconds: float, size: int, seen: list = steps_seen) -> None:
                seen.append((seconds, size, comm.bytes))

            engine.on_step = record
            running = [engine.generate(rid, 1, p) for rid, p in streams]
            for stream in running:
                for _ in stream:
                    pass
            engine.on_step = None
            full = []
            for seconds, size, after in steps_seen:
                if size == batch:
                    full.append((seconds, after - before))
                before = after
            if len(full) <= WARMUP_STEPS:
                raise RuntimeError(f"batch {batch}: only {len(full)} steps ran the whole batch")
            timed = full[WARMUP_STEPS:][:steps]
            per_seq = (
                cache.bytes_per_token_per_layer
                * cache.num_layers
                * engine.pool.local_tokens(0, context)
            )
            results.append(
                StepResult(
                    layout,
                    collectives,
                    tp,
                    r,
                    batch,
                    context,
                    1000 * statistics.median(t for t, _ in timed),
                    [1000 * t for t, _ in timed],
                    cache.bytes_per_token_per_layer,
                    per_seq,
                    timed[-1][1],
                    engine.parameter_bytes(),
                )
            )
    return results

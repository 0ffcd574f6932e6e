"""`tpla bench decode-step`: the real engine's step time, MLA-TP and TPLA side by side.

Synthetic latents are written into reserved blocks (the step cost does not depend on their
values), then every request decodes with ignore_eos. Each configuration reports the median
of `steps` step times per batch size, timing only steps that run the whole batch (requests
join and leave one by one; a partial batch is a cheaper step), after warm-up; ratios against
MLA-TP (r = 1) come from the same run.

`host_syncs_per_step` is the most host waits any rank made in a full-batch step (the leader's
sampling included), counted after the timed steps (counting slows a step) by
`common.runtime.host_syncs` on every rank: each rank counts its own step when the plan asks
and returns the count with its logits. What is counted is what would make the host wait for a
GPU: reading a value computed in the step (`.item()`, `.tolist()`, `int(t)`, a `nonzero`),
and the one awaited copy of the sampled tokens. Host-side bookkeeping that stays on the host
on a GPU is not: the plan, built from the scheduler's Python lists into CPU tensors before
the step's inputs are copied to the device, and the sampled results read from their pinned
host copy.

`--json` prints only JSON on stdout; the table goes to stderr.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

import torch

from common.parallel import BASELINE, COMPARED, ParallelConfig, parse_mode
from common.runtime.kernel_choice import KernelConfig
from common.sampling.grammar import GrammarSpec, allowed_now
from common.sampling.params import SamplingParams
from services.decode.config import DEFAULT_SPEC_TOKENS, PROPOSERS, EngineConfig, SpecConfig
from services.decode.local_kv import write_kv
from tools.bench.dsa_model import NAME, model_dir

if TYPE_CHECKING:
    from services.decode.engine import DecodeEngine

WARMUP_STEPS = 2  # full-batch steps not timed (first calls into each kernel's buffers)
COUNTED_STEPS = 2  # full-batch steps whose host waits are counted, after the timed ones


@dataclass(frozen=True)
class StepResult:
    layout: str  # a layout's name (common/parallel.py)
    collectives: str  # shm | dist
    tp: int
    latent_groups: int
    batch: int
    context: int
    median_ms: float
    step_ms: list[float]  # every timed step (full batch, after warm-up), in order
    cache_bytes_per_token_layer: int  # per rank, per cached token (SP: a rank caches ~1/tp)
    cache_bytes_per_sequence: int  # rank 0's share of one sequence's cache (DSA keys too)
    comm_bytes_per_step: int  # payload rank 0 puts into collectives per step (measured)
    parameter_bytes_rank0: int
    host_syncs_per_step: int  # the most on any rank in a full-batch step
    cuda_graphs: bool  # each bucket's step replayed as a CUDA graph (CUDA only)
    sampling: str = "greedy"  # SAMPLINGS
    speculative: str = "none"  # the draft proposer (services/decode/config.py PROPOSERS)
    # Timed steps rank 0 ran without a graph where graphs were asked for (CUDA): 0 expected.
    eager_steps: int = 0


# `sampled`: requests take turns at a seeded top-p draw, penalties, a JSON grammar and greedy,
# so every logits processor and the grammar run in the counted steps.
SAMPLINGS = ("greedy", "sampled")
# A string far longer than any request here writes: the grammar never ends a request (one that
# closed its string would have only EOS left, which ignore_eos refuses).
GRAMMAR = {"type": "string", "minLength": 4096}


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
    device: str = "cpu",
    dtype: str = "float32",
    cuda_graphs: bool = False,
    sampling: str = "greedy",
    speculative: str = "none",
) -> list[StepResult]:
    """Median step time per batch size for one layout, with its cache and comm footprint.
    `speculative`: the group drafts so (k = its default) at every batch measured."""
    from services.decode.engine import DecodeEngine  # not imported by `tpla --help`

    par = ParallelConfig.parse(layout, tp, r, chunk_size=chunk_size)
    model = model_dir(model)
    cfg = EngineConfig(
        model=model,
        parallel=par,
        reparam=reparam if r > 1 else None,
        master_port=0,
        max_batch=max(batches),
        kv_budget_mb=_budget_mb(model, par, max(batches), context),
        torch_threads=threads,
        kernels=KernelConfig(decode_attention=kernel),
        collectives=collectives,
        device=device,
        dtype=dtype,
        cuda_graphs=cuda_graphs,
        speculative=SpecConfig(speculative, DEFAULT_SPEC_TOKENS.get(speculative, 1), max(batches)),
    )
    results = []
    with DecodeEngine(cfg) as engine:
        cache = engine.runtime.layout
        for batch in batches:
            eager = engine.runtime.eager_steps
            timed = _full_steps(engine, batch, context, steps, tp, sampling)
            eager = engine.runtime.eager_steps - eager
            syncs = _count_syncs(engine, batch, context, tp, sampling)
            keys = engine.runtime.index_cache  # DSA: the indexer keys' pool
            pools = [cache] if keys is None else [cache, keys.layout]
            per_token = sum(p.bytes_per_token_per_layer * p.num_layers for p in pools)
            per_seq = per_token * engine.pool.local_tokens(0, context)
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
                    engine.runtime.model.parameter_bytes(),
                    syncs,
                    engine.runtime.graphs is not None,
                    sampling,
                    speculative,
                    eager,
                )
            )
    return results


def _params(sampling: str, max_tokens: int, count: int) -> list[SamplingParams]:
    """`count` requests' params: all greedy, or taking turns at each kind of draw."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if sampling == "greedy":
        return [greedy] * count
    kinds = [
        SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0.7,
            seed=3,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.1,
            ignore_eos=True,
        ),
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0.9,
            seed=5,
            grammar=GrammarSpec.json_schema(GRAMMAR),
            ignore_eos=True,
        ),
        greedy,
    ]
    return [kinds[i % len(kinds)] for i in range(count)]


def _full_steps(
    engine: DecodeEngine, batch: int, context: int, steps: int, tp: int, sampling: str
) -> list[tuple[float, int]]:
    """(seconds, collective bytes) of `steps` steps that ran the whole batch, after warm-up.
    Requests join one by one and leave as they started: only steps that run the whole batch
    are timed. Each request is long enough for `steps` of them plus warm-up, whatever the
    spread of joins."""
    comm = engine.runtime.comm
    params = _params(sampling, _max_tokens(engine, steps + batch + WARMUP_STEPS + 2), batch)
    rids = [_reserve(engine, context, p, tp) for p in params]
    steps_seen: list[tuple[float, int, int]] = []  # (seconds, batch, comm bytes after)
    before = comm.bytes

    def record(seconds: float, size: int) -> None:
        steps_seen.append((seconds, size, comm.bytes))

    engine.probe.on_step = record
    _run(engine, rids, params)
    full = []
    for seconds, size, after in steps_seen:
        if size == batch:
            full.append((seconds, after - before))
        before = after
    if len(full) <= WARMUP_STEPS:
        raise RuntimeError(f"batch {batch}: only {len(full)} steps ran the whole batch")
    return full[WARMUP_STEPS:][:steps]


def _reserve(engine: DecodeEngine, context: int, params: SamplingParams, tp: int) -> str:
    """A request reserved with synthetic latents (and a DSA model's indexer keys, in the
    engine's key format) on every rank."""
    cache, sparse = engine.runtime.layout, engine.runtime.model.sparse
    rid = uuid.uuid4().hex
    engine.reserve(rid, context, params.max_tokens)
    for rank in range(tp):
        tokens = engine.pool.local_tokens(rank, context)
        n = torch.randn(cache.num_layers, tokens, cache.latent_width) * 0.1
        k_pe = torch.randn(cache.num_layers, tokens, cache.rope_width) * 0.1
        keys = None
        if sparse is not None and sparse.format is not None:
            layers = sparse.dsa.key_layers(sparse.layers)
            keys = sparse.format.encode(torch.randn(layers, tokens, sparse.head_dim))
        write_kv(engine, rid, rank, n, k_pe, keys)
    return rid


def _budget_mb(model: str, par: ParallelConfig, batch: int, context: int) -> float:
    """A KV budget per rank that holds `batch` sequences of `context` tokens (512 MB at
    least): latents and a DSA model's keys in fp32, the busiest rank's share, with room for
    the decoded tokens and the blocks' rounding."""
    from common.model.args import ModelConfig
    from common.tpla.rank_memory import kv_bytes_per_stored_token

    c = ModelConfig.from_dir(model)
    tokens = par.local_length(context + 256, 0) + 64
    per_token = kv_bytes_per_stored_token(c, par, "float32")
    return max(512.0, 1.1 * batch * tokens * per_token / 2**20)


def _run(engine: DecodeEngine, rids: list[str], params: list[SamplingParams]) -> None:
    """Decode every request to its end (they join one by one)."""
    running = [
        engine.generate(rid, _first_token(engine, p), p)
        for rid, p in zip(rids, params, strict=True)
    ]
    for stream in running:
        for _ in stream:
            pass


def _first_token(engine: DecodeEngine, params: SamplingParams) -> int:
    """A request's first token: 1, or where a grammar constrains it, the first it allows."""
    matcher = engine.controls.matcher(params, [])
    if matcher is None:
        return 1
    vocab = engine.runtime.model.config.vocab_size
    return int(allowed_now(matcher, vocab, "cpu")[0].nonzero()[0, 0])


def _max_tokens(engine: DecodeEngine, steps: int) -> int:
    """Tokens a request needs to stay for `steps` steps: a speculative step may keep every
    draft, so as many more a step."""
    spec = engine.cfg.speculative
    return steps * (1 + (spec.tokens if spec.method != "none" else 0))


def _count_syncs(engine: DecodeEngine, batch: int, context: int, tp: int, sampling: str) -> int:
    """The most host waits on any rank in a full-batch step (a short run, counted)."""
    params = _params(sampling, _max_tokens(engine, batch + WARMUP_STEPS + COUNTED_STEPS), batch)
    rids = [_reserve(engine, context, p, tp) for p in params]
    counts: list[int] = []

    def record(seconds: float, size: int) -> None:
        if size == batch:
            counts.append(engine.probe.last_host_syncs)

    engine.probe.on_step = record
    engine.probe.count_syncs = True
    try:
        _run(engine, rids, params)
    finally:
        engine.probe.count_syncs = False
        engine.probe.on_step = None
    if not counts:
        raise RuntimeError(f"batch {batch}: no counted step ran the whole batch")
    return max(counts)


def cmd_decode_step(args: argparse.Namespace) -> int:
    from common.runtime.device import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    # A CPU step has no launches to capture: graphs are a CUDA setting.
    graph_modes = [mode == "on" for mode in args.cuda_graphs] if device != "cpu" else [False]
    rows = []
    for collectives, graphs, speculative, layout in itertools.product(
        args.collectives, graph_modes, args.speculative, args.layouts
    ):
        r = parse_mode(layout).latent_groups(args.tp)
        rows += measure(
            args.model,
            layout,
            args.tp,
            r,
            args.batch,
            args.context,
            args.steps,
            args.reparam,
            args.threads,
            args.chunk_size,
            args.kernel,
            collectives,
            device,
            dtype,
            graphs,
            args.sampling,
            speculative,
        )
    out = _report(rows, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"rows": out}))
    return 0


def _report(rows: list[StepResult], table: TextIO) -> list[dict[str, object]]:
    """The table (speedups against MLA-TP with the same collectives, graphs, sampling and
    speculation, from this run) and the JSON rows."""

    def key(row: StepResult) -> tuple[object, ...]:
        return row.collectives, row.cuda_graphs, row.sampling, row.speculative, row.batch

    base = {key(row): row for row in rows if row.layout == BASELINE.value}
    print(
        f"{'coll':>5} {'layout':>7} {'tp':>3} {'r':>3} {'batch':>6} {'context':>8} {'step ms':>9} "
        f"{'speedup':>8} {'cache KiB/seq':>14} {'vs MLA-TP':>10} {'comm KiB/step':>14} "
        f"{'rank0 MB':>9} {'syncs':>6} {'graphs':>6} {'sampling':>8} {'spec':>6}",
        file=table,
    )
    out = []
    for row in rows:
        ref = base.get(key(row))
        speed = ref.median_ms / row.median_ms if ref else float("nan")
        mem = ref.cache_bytes_per_sequence / row.cache_bytes_per_sequence if ref else float("nan")
        print(
            f"{row.collectives:>5} {row.layout:>7} {row.tp:>3} {row.latent_groups:>3} "
            f"{row.batch:>6} {row.context:>8} {row.median_ms:>9.2f} {speed:>7.2f}x "
            f"{row.cache_bytes_per_sequence / 1024:>14.1f} {mem:>9.2f}x "
            f"{row.comm_bytes_per_step / 1024:>14.1f} {row.parameter_bytes_rank0 / 2**20:>9.1f} "
            f"{row.host_syncs_per_step:>6} {'on' if row.cuda_graphs else 'off':>6} "
            f"{row.sampling:>8} {row.speculative:>6}",
            file=table,
        )
        out.append({**row.__dict__, "speedup_vs_mla_tp": speed, "cache_saving_vs_mla_tp": mem})
    return out


def add_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ds = bsub.add_parser("decode-step", help="real engine step: MLA-TP vs TPLA vs SP")
    ds.add_argument(
        "--model", default="models/demo", help=f"a model directory, or {NAME} (DSA, V3.2's shape)"
    )
    ds.add_argument("--tp", type=int, default=2)
    ds.add_argument(
        "--layouts",
        nargs="+",
        choices=[m.value for m in COMPARED],
        default=[m.value for m in COMPARED],
        help="tpla uses r = tp",
    )
    ds.add_argument("--chunk-size", type=int, default=256, help="SP tokens per chunk")
    ds.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ds.add_argument("--context", type=int, default=1024)
    ds.add_argument("--steps", type=int, default=12, help="full-batch steps timed per batch size")
    ds.add_argument("--reparam", default="tpla_pca")
    ds.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ds.add_argument(
        "--kernel",
        choices=["auto", "native", "torch", "triton"],
        default="auto",
        help="decode backend (TPLA_DECODE_KERNEL)",
    )
    ds.add_argument(
        "--collectives",
        nargs="+",
        choices=["shm", "dist"],
        default=["shm"],
        help="group collectives: shared memory and/or torch.distributed (gloo)",
    )
    ds.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (rank k on GPU N + k)")
    ds.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA) | float32 | bfloat16")
    ds.add_argument(
        "--cuda-graphs",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="replay each bucket's step as a CUDA graph, or not (both: side by side); "
        "ignored on the CPU",
    )
    ds.add_argument(
        "--sampling",
        choices=SAMPLINGS,
        default="greedy",
        help="greedy requests, or requests taking turns at seeded top-p, penalties, a JSON "
        "grammar and greedy",
    )
    ds.add_argument(
        "--speculative",
        nargs="+",
        choices=PROPOSERS,
        default=["none"],
        help="draft proposers (mtp needs a model with an MTP layer); drafts at every batch",
    )
    ds.add_argument("--json", action="store_true")
    ds.set_defaults(func=cmd_decode_step)

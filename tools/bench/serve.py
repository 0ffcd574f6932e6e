"""`tpla bench serve`: serving configurations under a concurrency sweep, one run, same requests.

Configurations (each only when selected with --configs):
* tpla       - the disaggregated stack (`tpla serve`, tp=2, TPLA r=2, PCA basis), over HTTP;
* mla-tp     - the same stack with r=1 (plain MLA tensor parallelism), over HTTP;
  each once per --speculative method (`tpla+ngram`: with n-gram drafts; rows then say
  the drafts' acceptance);
* colocated  - the same TPLA decode group with prefill in its leader, no transfer
               (tools/bench/colocated.py), in-process;
* hf-naive / hf-static - HF transformers `generate` on the same weights
               (tools/bench/hf_baseline.py): one request at a time, or static batches.

Each mix has a fixed prompt length and exactly `max_tokens` outputs per request (ignore_eos,
greedy), prompts are windows of real Python source (tools/bench/prompts.py; the `edit` mix's
answers repeat what its prompts hold), and every configuration serves the same prompts
(overlapping windows: nothing here caches prefixes). The load is swept either as closed loops
(a level of concurrency c is c clients over waves * c requests, at least 2) or, with
--request-rate, as Poisson arrivals (a level is `requests` requests at that rate; see
tools/bench/load.py for why both), each level after one untimed warm-up request.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from common.parallel import BASELINE, ParallelMode
from common.runtime.settings import load_settings
from services.prefill.batch.threads import PrefillThreads, usable_cores
from tools.bench.load import Arrival, Load, drive_blocking, level
from tools.bench.prompts import Mix, make_prompts
from tools.bench.stats import LoadSummary, RequestTiming, summarize

# The disaggregated configurations are named after their decode layout: (latent groups, reparam).
DISAGGREGATED = {ParallelMode.TPLA.value: (2, "tpla_pca"), BASELINE.value: (1, "")}
CONFIGS = (*DISAGGREGATED, "colocated", "hf-naive", "hf-static")


@dataclass(frozen=True)
class SweepConfig:
    model: str
    configs: tuple[str, ...]
    mixes: tuple[Mix, ...]
    loads: tuple[Load, ...]  # all closed loops, or all Poisson rates
    waves: int  # closed loops: requests per level = waves x concurrency (at least 2)
    requests: int  # Poisson: requests per level
    hf_max_concurrency: int
    hf_threads: int
    reparam: str  # TPLA basis for the tpla and colocated configs ("" = identity)
    prefill_workers: int = 1  # of the disaggregated stacks
    speculative: tuple[str, ...] = ("none",)  # the disaggregated stacks' TPLA_SPECULATIVE

    def __post_init__(self) -> None:
        unknown = set(self.configs) - set(CONFIGS)
        if unknown:
            raise ValueError(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
        if not self.loads or len({load.arrival for load in self.loads}) != 1:
            raise ValueError("sweep one kind of load: closed loops or Poisson rates")
        if self.waves < 1 or self.requests < 2:
            raise ValueError("waves must be >= 1 and requests >= 2")

    @property
    def arrival(self) -> Arrival:
        return self.loads[0].arrival

    def count(self, load: Load) -> int:
        """Requests served at one level."""
        if load.arrival is Arrival.POISSON:
            return self.requests
        return max(self.waves * load.concurrency, 2)


Runner = Callable[[Sequence[Sequence[int]], int, Load], tuple[list[RequestTiming], float]]


def _sweep(
    name: str,
    runner: Runner,
    sweep: SweepConfig,
    prompts: dict[str, list[list[int]]],
    loads: Sequence[Load],
    spec_counts: Callable[[], tuple[float, float]] | None = None,
) -> list[dict]:
    rows = []
    for mix in sweep.mixes:
        # One untimed request first: connections, process groups and first-call paths.
        runner(prompts[mix.name][:1], mix.max_tokens, Load.closed(1))
        for load in loads:
            before = spec_counts() if spec_counts else (0.0, 0.0)
            timings, wall = runner(prompts[mix.name][: sweep.count(load)], mix.max_tokens, load)
            summary: LoadSummary = summarize(timings, wall)
            row = {"config": name, "mix": mix.name, **load.row(), **dataclasses.asdict(mix)}
            row.update(dataclasses.asdict(summary))
            if spec_counts:
                fed, kept = (b - a for a, b in zip(before, spec_counts(), strict=True))
                row.update(spec_draft_tokens=fed, spec_accepted_tokens=kept)
            rows.append(row)
            print(
                f"{name:<10} {mix.name:<6} {load.label():<7} "
                f"{summary.completed}/{summary.requests} ok "
                f"{summary.output_tok_s:8.1f} tok/s  TTFT p50 {summary.ttft_p50_ms:8.1f} ms  "
                f"TPOT p50 {summary.tpot_p50_ms:7.1f} p99 {summary.tpot_p99_ms:7.1f} ms  "
                f"ITL p99 {summary.itl_p99_ms:7.1f} ms",
                file=sys.stderr,
                flush=True,
            )
    return rows


def _run_config(name: str, sweep: SweepConfig, prompts: dict[str, list[list[int]]]) -> list[dict]:
    """One configuration over every mix and level; whatever it started is stopped on return."""
    if name in DISAGGREGATED:
        from tools.bench.serve_stack import StackConfig, drive_http, running_stack, spec_counts

        groups, reparam = DISAGGREGATED[name]
        rows = []
        for spec in sweep.speculative:
            method, _, tokens = spec.partition(":")
            cfg = StackConfig(
                name,
                groups,
                sweep.reparam if groups > 1 else reparam,
                prefill_workers=sweep.prefill_workers,
                speculative=method,
                spec_tokens=int(tokens) if tokens else None,
            )
            label = name if spec == "none" else f"{name}+{spec}"
            with running_stack(cfg, sweep.model) as url:
                http = functools.partial(drive_http, url, cfg.served_name)
                counts = None if spec == "none" else functools.partial(spec_counts, url)
                rows += _sweep(label, http, sweep, prompts, sweep.loads, counts)
        return rows
    if name == "colocated":
        from tools.bench.colocated import ColocatedServer

        with ColocatedServer(sweep.model, sweep.reparam, 2, 2) as server:
            runner = functools.partial(drive_blocking, server.request)
            return _sweep(name, runner, sweep, prompts, sweep.loads)
    if name == "hf-static" and sweep.arrival is Arrival.POISSON:
        # Static batches are the c prompts of a closed loop taken together: no schedule.
        print("hf-static: closed loops only, skipped under --request-rate", file=sys.stderr)
        return []
    from tools.bench.hf_baseline import HfServer

    hf = HfServer(sweep.model, sweep.hf_threads)
    hf_runner: Runner = (
        functools.partial(drive_blocking, hf.request)
        if name == "hf-naive"
        else lambda batch, max_tokens, load: hf.static_batches(batch, max_tokens, load.concurrency)
    )
    loads = [
        load
        for load in sweep.loads
        if load.arrival is Arrival.POISSON or load.concurrency <= sweep.hf_max_concurrency
    ]
    return _sweep(name, hf_runner, sweep, prompts, loads)


def run(sweep: SweepConfig) -> dict:
    most = max(sweep.count(load) for load in sweep.loads)
    prompts = {m.name: make_prompts(sweep.model, m, most) for m in sweep.mixes}
    rows: list[dict] = []
    for name in sweep.configs:
        rows += _run_config(name, sweep, prompts)
    # What the stack's processes (and the colocated prefill) ran on: the same settings.
    settings = load_settings()
    prefill = PrefillThreads.from_settings(settings)
    return {
        "bench": "serve",
        "model": sweep.model,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "stack_torch_threads_per_process": settings.torch_threads,
            "stack_prefill_threads": {
                "batches_from_tokens": prefill.min_tokens,
                "threads": prefill.large,
            },
            "hf_torch_threads": sweep.hf_threads,
        },
        "sweep": {
            "configs": list(sweep.configs),
            "arrival": sweep.arrival.value,
            "concurrency": [x.concurrency for x in sweep.loads if x.arrival is Arrival.CLOSED],
            "request_rates": [x.rate for x in sweep.loads if x.arrival is Arrival.POISSON],
            "waves": sweep.waves,
            "requests_per_rate": sweep.requests,
            "seed": sweep.loads[0].seed,
            "prefill_workers": sweep.prefill_workers,
            "speculative": list(sweep.speculative),
            "mixes": [dataclasses.asdict(m) for m in sweep.mixes],
        },
        "results": rows,
        "goals": goals(rows),
    }


def _find(rows: list[dict], config: str, mix: str, at: float) -> dict | None:
    for r in rows:
        if (r["config"], r["mix"], level(r)) == (config, mix, at):
            return r
    return None


def goals(rows: list[dict]) -> dict:
    """The issue's goals as measured ratios (None where a configuration was not run).

    Throughput against HF at 16 closed-loop streams (or the largest level); disaggregated
    against colocated TPOT p99 on the long mix at every level, and ITL p99 beside it."""
    out: dict = {}
    closed = sorted({r["concurrency"] for r in rows if r["arrival"] == Arrival.CLOSED})
    at = 16 if 16 in closed else (closed[-1] if closed else 0)
    for mix in sorted({r["mix"] for r in rows}):
        for disagg in DISAGGREGATED:
            d = _find(rows, disagg, mix, at)
            for hf in ("hf-naive", "hf-static"):
                h = _find(rows, hf, mix, at)
                if d and h and h["output_tok_s"] > 0:
                    out[f"{disagg}_vs_{hf}_throughput_{mix}_c{at}"] = (
                        d["output_tok_s"] / h["output_tok_s"]
                    )
    for r in rows:
        if r["config"] != "tpla" or r["mix"] != "long":
            continue
        col = _find(rows, "colocated", "long", level(r))
        closed = r["arrival"] == Arrival.CLOSED
        tag = f"c{r['concurrency']}" if closed else f"rate{r['request_rate']:g}"
        for metric in ("tpot_p99_ms", "itl_p99_ms"):
            if col and col[metric] > 0:
                out[f"tpla_vs_colocated_{metric[:-3]}_long_{tag}"] = r[metric] / col[metric]
    return out


def _speculative(value: str) -> str:
    """--speculative's METHOD[:K], checked."""
    method, _, tokens = value.partition(":")
    if method not in ("none", "ngram", "mtp"):
        raise argparse.ArgumentTypeError(f"{value!r}: the method is none, ngram or mtp")
    if tokens and (method == "none" or not tokens.isdigit() or int(tokens) < 1):
        raise argparse.ArgumentTypeError(f"{value!r}: K is a count >= 1 of drafts (not with none)")
    return value


def _mixes(quick: bool, names: Sequence[str]) -> tuple[Mix, ...]:
    catalog = (
        {
            "short": Mix("short", 16, 8),
            "long": Mix("long", 256, 8),
            "edit": Mix("edit", 64, 16),
            "completion": Mix("completion", 32, 16),
        }
        if quick
        else {
            "short": Mix("short", 64, 32),
            "long": Mix("long", 1536, 32),
            "edit": Mix("edit", 256, 128),
            "completion": Mix("completion", 128, 64),
        }
    )
    return tuple(catalog[n] for n in names)


def _shared_prefix(args: argparse.Namespace) -> int:
    """The shared-prefix mix: its own run (common/bench/shared_prefix.py)."""
    from tools.bench import shared_prefix

    cfg = shared_prefix.SharedPrefixConfig(
        model=args.model,
        users=args.users,
        turns=args.turns,
        system_tokens=args.system_tokens,
        max_tokens=args.max_tokens or 32,
        reparam=args.reparam,
    )
    report = shared_prefix.run(cfg)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        shared_prefix.plot(report, args.plot)
    print(json.dumps(report) if args.json else json.dumps(report["ratios"], indent=2))
    return 0 if all(r["completed"] == r["requests"] for r in report["results"]) else 1


def cmd(args: argparse.Namespace) -> int:
    if args.disagg:
        from tools.bench import disagg

        return disagg.cmd(args.disagg, args.model, args.rounds, args.out, args.plot)
    if args.mixes and "shared-prefix" in args.mixes:
        if len(args.mixes) > 1:
            raise SystemExit("--mixes shared-prefix is a run of its own: pass it alone")
        return _shared_prefix(args)
    mixes = args.mixes or (["short"] if args.quick else ["short", "long"])
    if args.request_rate:
        if args.concurrency:
            raise SystemExit("--concurrency and --request-rate are two kinds of load: pick one")
        loads = tuple(Load.poisson(rate, args.seed) for rate in args.request_rate)
    else:
        concurrency = args.concurrency or ([1, 2] if args.quick else [1, 4, 16, 32])
        loads = tuple(Load.closed(c) for c in concurrency)
    sweep = SweepConfig(
        model=args.model,
        configs=tuple(args.configs),
        mixes=_mixes(args.quick, mixes),
        loads=loads,
        waves=args.waves or 1,
        requests=args.requests,
        hf_max_concurrency=args.hf_max_concurrency,
        hf_threads=args.hf_threads,
        reparam=args.reparam,
        prefill_workers=args.prefill_workers,
        speculative=tuple(args.speculative),
    )
    report = json.loads(Path(args.from_report).read_text()) if args.from_report else run(sweep)
    if args.profile:
        from services.autoscaler.profile import save_profile
        from tools.bench.profile import profile_from_report
        from tools.bench.serve_stack import StackConfig

        save_profile(profile_from_report(report, StackConfig("", 1, "").tp), args.profile)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        from tools.bench.plots import plot_serve

        plot_serve(report, Path(args.plot))
    print(json.dumps(report) if args.json else json.dumps(report["goals"], indent=2))
    return 0 if all(r["completed"] == r["requests"] for r in report["results"]) else 1


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("serve", help="serving configurations under a concurrency sweep")
    p.add_argument("--model", default="models/demo")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument(
        "--mixes",
        nargs="+",
        choices=("short", "long", "edit", "completion", "shared-prefix"),
        help="default: short and long; edit: prompts whose answers repeat what they hold "
        "(tools/bench/prompts.py); completion: a window of source continued at length; "
        "shared-prefix (alone): multi-turn chat over one system prompt, prefix cache on and off",
    )
    p.add_argument(
        "--speculative",
        nargs="+",
        default=["none"],
        type=_speculative,
        metavar="METHOD[:K]",
        help="the disaggregated stacks once per TPLA_SPECULATIVE method (none, ngram, mtp), "
        "with TPLA_SPEC_TOKENS=K when given (e.g. mtp:1)",
    )
    p.add_argument(
        "--disagg",
        nargs="+",
        choices=("always", "auto", "never"),
        help="a run of its own: one stack per TPLA_DISAGG_POLICY over the short, chat (cached "
        "history) and long mixes at 1, 4 and 16 streams (tools/bench/disagg.py)",
    )
    p.add_argument("--rounds", type=int, default=3, help="--disagg: alternated rounds")
    p.add_argument("--users", type=int, default=16, help="shared-prefix: conversations")
    p.add_argument("--turns", type=int, default=4, help="shared-prefix: turns each")
    p.add_argument(
        "--system-tokens", type=int, default=1536, help="shared-prefix: system prompt tokens"
    )
    p.add_argument("--max-tokens", type=int, help="shared-prefix: answer tokens (default 32)")
    p.add_argument("--concurrency", nargs="+", type=int, help="default 1 4 16 32 (quick: 1 2)")
    p.add_argument(
        "--waves", type=int, help="requests per level = waves x concurrency (min 2); default 1"
    )
    p.add_argument(
        "--request-rate",
        nargs="+",
        type=float,
        help="instead of closed loops: Poisson arrivals at these rates (requests/s)",
    )
    p.add_argument(
        "--requests", type=int, default=32, help="requests per --request-rate level (default 32)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival schedule")
    p.add_argument("--hf-max-concurrency", type=int, default=16)
    p.add_argument(
        "--hf-threads",
        type=int,
        default=usable_cores(),
        help="HF intra-op threads (default: the usable cores; HF serves alone on the machine, "
        "and on the 2-core VM 2 threads ran the long mix 1.4x faster than 1, short alike)",
    )
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=1,
        help="prefill workers of the disaggregated stacks (tpla serve's default: 1)",
    )
    p.add_argument("--reparam", default="tpla_pca", help='TPLA basis side file ("" = identity)')
    p.add_argument("--quick", action="store_true", help="tiny prompts, concurrency 1 and 2")
    p.add_argument("--json", action="store_true", help="JSON report as the last stdout line")
    p.add_argument("--out", default="", help="also write the JSON report here")
    p.add_argument("--plot", default="", help="write the throughput / TPOT p99 chart here")
    p.add_argument(
        "--profile",
        default="",
        help="write the autoscaler's performance profile here (tools/bench/profile.py)",
    )
    p.add_argument(
        "--from-report",
        default="",
        help="no run: take the sweep from this saved report (e.g. with --profile)",
    )
    p.set_defaults(func=cmd)

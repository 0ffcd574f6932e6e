"""`tpla bench serve`: serving configurations under a concurrency sweep, one run, same requests.

Configurations (each only when selected with --configs):
* tpla       - the disaggregated stack (`tpla serve`, tp=2, TPLA r=2, PCA basis), over HTTP;
* mla-tp     - the same stack with r=1 (plain MLA tensor parallelism), over HTTP;
* colocated  - the same TPLA decode group with prefill in its leader, no transfer
               (common/bench/colocated.py), in-process;
* hf-naive / hf-static - HF transformers `generate` on the same weights
               (common/bench/hf_baseline.py): one request at a time, or static batches.

Each mix has a fixed prompt length and exactly `max_tokens` outputs per request (ignore_eos,
greedy), prompts are windows of real Python source, and every configuration serves the same
prompts (overlapping windows: nothing here caches prefixes). A level of concurrency c is a
closed loop of c clients over waves * c requests (at least 2), after one untimed warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from common.bench.stats import LoadSummary, RequestTiming, summarize

CONFIGS = ("tpla", "mla-tp", "colocated", "hf-naive", "hf-static")
DISAGGREGATED = {"tpla": (2, "tpla_pca"), "mla-tp": (1, "")}  # latent groups, reparam


@dataclass(frozen=True)
class Mix:
    name: str
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class SweepConfig:
    model: str
    configs: tuple[str, ...]
    mixes: tuple[Mix, ...]
    concurrency: tuple[int, ...]
    waves: int
    hf_max_concurrency: int
    hf_threads: int
    reparam: str  # TPLA basis for the tpla and colocated configs ("" = identity)
    prefill_workers: int = 1  # of the disaggregated stacks

    def __post_init__(self) -> None:
        unknown = set(self.configs) - set(CONFIGS)
        if unknown:
            raise ValueError(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
        if min(self.concurrency) < 1 or self.waves < 1:
            raise ValueError("concurrency and waves must be >= 1")


def make_prompts(model: str, mix: Mix, count: int) -> list[list[int]]:
    """`count` distinct windows of `mix.prompt_tokens` tokens of Python source text."""
    import inspect

    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    ids: list[int] = []
    for module in (argparse, json.decoder, dataclasses, inspect):
        ids += tok.encode(inspect.getsource(module), add_bos=False)
        if len(ids) >= mix.prompt_tokens + 97 * count:
            break
    span = len(ids) - mix.prompt_tokens
    if span < 1:
        raise ValueError(f"not enough text for {mix.prompt_tokens}-token prompts")
    return [ids[(97 * i) % span : (97 * i) % span + mix.prompt_tokens] for i in range(count)]


def drive_threads(
    request: Callable[[Sequence[int], int], RequestTiming],
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
) -> tuple[list[RequestTiming], float]:
    """Closed-loop load of `concurrency` blocking clients (in-process configurations)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        timings = list(pool.map(lambda p: request(p, max_tokens), prompts))
    return timings, time.perf_counter() - t0


Runner = Callable[[Sequence[Sequence[int]], int, int], tuple[list[RequestTiming], float]]


def _sweep(
    name: str,
    runner: Runner,
    sweep: SweepConfig,
    prompts: dict[str, list[list[int]]],
    levels: Sequence[int],
) -> list[dict]:
    rows = []
    for mix in sweep.mixes:
        # One untimed request first: connections, process groups and first-call paths.
        runner(prompts[mix.name][:1], mix.max_tokens, 1)
        for c in levels:
            batch = prompts[mix.name][: max(sweep.waves * c, 2)]
            timings, wall = runner(batch, mix.max_tokens, c)
            summary: LoadSummary = summarize(timings, wall)
            row = {"config": name, "mix": mix.name, "concurrency": c, **dataclasses.asdict(mix)}
            row.update(dataclasses.asdict(summary))
            rows.append(row)
            print(
                f"{name:<10} {mix.name:<6} c={c:<3} {summary.completed}/{summary.requests} ok "
                f"{summary.output_tok_s:8.1f} tok/s  TTFT p50 {summary.ttft_p50_ms:8.1f} ms  "
                f"TPOT p50 {summary.tpot_p50_ms:7.1f} p99 {summary.tpot_p99_ms:7.1f} ms",
                file=sys.stderr,
                flush=True,
            )
    return rows


def _run_config(name: str, sweep: SweepConfig, prompts: dict[str, list[list[int]]]) -> list[dict]:
    """One configuration over every mix and level; whatever it started is stopped on return."""
    if name in DISAGGREGATED:
        from common.bench.serve_stack import StackConfig, drive_http, running_stack

        groups, reparam = DISAGGREGATED[name]
        cfg = StackConfig(
            name,
            groups,
            sweep.reparam if groups > 1 else reparam,
            prefill_workers=sweep.prefill_workers,
        )
        with running_stack(cfg, sweep.model) as url:
            http = functools.partial(drive_http, url, cfg.served_name)
            return _sweep(name, http, sweep, prompts, sweep.concurrency)
    if name == "colocated":
        from common.bench.colocated import ColocatedServer

        with ColocatedServer(sweep.model, sweep.reparam, 2, 2) as server:
            runner = functools.partial(drive_threads, server.request)
            return _sweep(name, runner, sweep, prompts, sweep.concurrency)
    from common.bench.hf_baseline import HfServer

    hf = HfServer(sweep.model, sweep.hf_threads)
    hf_runner = (
        functools.partial(drive_threads, hf.request) if name == "hf-naive" else hf.static_batches
    )
    levels = [c for c in sweep.concurrency if c <= sweep.hf_max_concurrency]
    return _sweep(name, hf_runner, sweep, prompts, levels)


def run(sweep: SweepConfig) -> dict:
    most = max(max(sweep.waves * c, 2) for c in sweep.concurrency)
    prompts = {m.name: make_prompts(sweep.model, m, most) for m in sweep.mixes}
    rows: list[dict] = []
    for name in sweep.configs:
        rows += _run_config(name, sweep, prompts)
    return {
        "bench": "serve",
        "model": sweep.model,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "stack_torch_threads_per_process": 1,
            "hf_torch_threads": sweep.hf_threads,
        },
        "sweep": {
            "configs": list(sweep.configs),
            "concurrency": list(sweep.concurrency),
            "waves": sweep.waves,
            "prefill_workers": sweep.prefill_workers,
            "mixes": [dataclasses.asdict(m) for m in sweep.mixes],
        },
        "results": rows,
        "goals": goals(rows),
    }


def _find(rows: list[dict], config: str, mix: str, c: int) -> dict | None:
    for r in rows:
        if (r["config"], r["mix"], r["concurrency"]) == (config, mix, c):
            return r
    return None


def goals(rows: list[dict]) -> dict:
    """The issue's goals as measured ratios (None where a configuration was not run)."""
    out: dict = {}
    levels = sorted({r["concurrency"] for r in rows})
    at = 16 if 16 in levels else (levels[-1] if levels else 0)
    for mix in sorted({r["mix"] for r in rows}):
        for disagg in DISAGGREGATED:
            d = _find(rows, disagg, mix, at)
            for hf in ("hf-naive", "hf-static"):
                h = _find(rows, hf, mix, at)
                if d and h and h["output_tok_s"] > 0:
                    out[f"{disagg}_vs_{hf}_throughput_{mix}_c{at}"] = (
                        d["output_tok_s"] / h["output_tok_s"]
                    )
    for c in levels:
        d, col = _find(rows, "tpla", "long", c), _find(rows, "colocated", "long", c)
        if d and col and col["tpot_p99_ms"] > 0:
            out[f"tpla_vs_colocated_tpot_p99_long_c{c}"] = d["tpot_p99_ms"] / col["tpot_p99_ms"]
    return out


def plot(report: dict, path: Path) -> None:
    """Throughput and TPOT p99 against concurrency, one row per request mix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = [m["name"] for m in report["sweep"]["mixes"]]
    fig, axes = plt.subplots(len(mixes), 2, figsize=(12, 4.2 * len(mixes)), squeeze=False)
    colors = dict(zip(CONFIGS, ("C0", "C1", "C2", "C3", "C4"), strict=True))
    for (ax_t, ax_p), mix in zip(axes, mixes, strict=True):
        for config in report["sweep"]["configs"]:
            pts = [
                r
                for r in report["results"]
                if r["config"] == config and r["mix"] == mix and r["completed"]
            ]
            if not pts:
                continue
            xs = [r["concurrency"] for r in pts]
            kw = dict(color=colors[config], marker="o", label=config)
            ax_t.plot(xs, [r["output_tok_s"] for r in pts], **kw)
            ax_p.plot(xs, [r["tpot_p99_ms"] for r in pts], **kw)
        prompt = next(m for m in report["sweep"]["mixes"] if m["name"] == mix)
        what = f"{mix} mix ({prompt['prompt_tokens']} prompt, {prompt['max_tokens']} output tokens)"
        ax_t.set_title(f"Output throughput - {what}", fontsize=10)
        ax_p.set_title(f"TPOT p99 - {what}", fontsize=10)
        ax_t.set_ylabel("output tokens / s")
        ax_p.set_ylabel("ms per output token (log)")
        ax_p.set_yscale("log")
        for ax in (ax_t, ax_p):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.grid(True, which="both", alpha=0.3)
        ax_t.legend(fontsize=8)
    fig.suptitle(f"tpla bench serve - {report['model']} - {report['date']} (2-core CPU, fp32)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _mixes(quick: bool, names: Sequence[str]) -> tuple[Mix, ...]:
    catalog = (
        {"short": Mix("short", 16, 8), "long": Mix("long", 256, 8)}
        if quick
        else {"short": Mix("short", 64, 32), "long": Mix("long", 1536, 32)}
    )
    return tuple(catalog[n] for n in names)


def cmd(args: argparse.Namespace) -> int:
    mixes = args.mixes or (["short"] if args.quick else ["short", "long"])
    concurrency = args.concurrency or ([1, 2] if args.quick else [1, 4, 16, 32])
    sweep = SweepConfig(
        model=args.model,
        configs=tuple(args.configs),
        mixes=_mixes(args.quick, mixes),
        concurrency=tuple(concurrency),
        waves=args.waves or 1,
        hf_max_concurrency=args.hf_max_concurrency,
        hf_threads=args.hf_threads,
        reparam=args.reparam,
        prefill_workers=args.prefill_workers,
    )
    report = run(sweep)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, Path(args.plot))
    print(json.dumps(report) if args.json else json.dumps(report["goals"], indent=2))
    return 0 if all(r["completed"] == r["requests"] for r in report["results"]) else 1


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("serve", help="serving configurations under a concurrency sweep")
    p.add_argument("--model", default="models/demo")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--mixes", nargs="+", choices=("short", "long"), help="default: both")
    p.add_argument("--concurrency", nargs="+", type=int, help="default 1 4 16 32 (quick: 1 2)")
    p.add_argument(
        "--waves", type=int, help="requests per level = waves x concurrency (min 2); default 1"
    )
    p.add_argument("--hf-max-concurrency", type=int, default=16)
    p.add_argument(
        "--hf-threads",
        type=int,
        default=1,
        help="HF intra-op threads (1, like every stack process: on a shared 2-core machine "
        "2 OpenMP threads stall each other)",
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
    p.set_defaults(func=cmd)

"""`tpla bench serve --disagg always auto never`: where prompts are prefilled, side by side.

One `tpla serve` stack per disaggregation policy (TPLA_DISAGG_POLICY; the decode group TPLA
tp=2 r=2 on the PCA basis, one prefill worker, every other setting the shipped default), all
running at once and driven one at a time over the same requests, in at least three rounds
whose policy order rotates, so a policy's spread over its rounds shows what the machine's
noise does to it. The mixes (`MIXES`, defined here):
* short - short prompts, nothing cached;
* chat  - a chat turn whose history its decode group (and the prefill worker) holds from
          the turn before (sent first, untimed, as the history alone), plus a new message;
* long  - long prompts, nothing cached;
each at 1, 4 and 16 closed-loop streams (2 waves, at least 8 requests a level), exactly
`max_tokens` outputs per request (greedy,
ignore_eos), prompts windows of Python source (tools/bench/prompts.py), new ones every round.
Per (policy, mix, streams) it reports TTFT p50 / p99 and TPOT p99, each as the median over
the rounds and their spread (min, max), where the stack's router says the prompts went
(`tpla:prefill_route_total`), and the issue's goals (`goals`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx

from tools.bench.load import Load
from tools.bench.prompts import source_windows
from tools.bench.serve_stack import StackConfig, drive_http, running_stack
from tools.bench.stats import summarize

POLICIES = ("always", "auto", "never")
STREAMS = (1, 4, 16)
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms")


@dataclass(frozen=True)
class DisaggMix:
    name: str
    prompt_tokens: int  # the prompt, or a chat turn's new message
    max_tokens: int
    history: int = 0  # a chat turn's history, held by its decode group from the turn before


MIXES = (
    DisaggMix("short", 32, 16),
    DisaggMix("chat", 48, 16, history=768),
    DisaggMix("long", 1024, 16),
)


@dataclass(frozen=True)
class DisaggSweep:
    model: str
    policies: tuple[str, ...] = POLICIES
    mixes: tuple[DisaggMix, ...] = MIXES
    streams: tuple[int, ...] = STREAMS
    rounds: int = 3
    waves: int = 2  # requests per level = waves x streams, at least `least`
    least: int = 8  # a p50 over fewer requests is one request's luck
    reparam: str = "tpla_pca"

    def __post_init__(self) -> None:
        unknown = set(self.policies) - set(POLICIES)
        if unknown or not self.policies:
            raise ValueError(f"--disagg takes policies of {POLICIES}, got {self.policies}")
        if self.rounds < 1 or self.waves < 1:
            raise ValueError("rounds and waves must be >= 1")

    def requests(self, streams: int) -> int:
        return max(self.waves * streams, self.least)


def prompts(sweep: DisaggSweep) -> dict[tuple[int, str, int], list[list[int]]]:
    """Each (round, mix, streams) level's prompts: distinct windows everywhere (a chat turn's
    history included), the same for every policy."""
    levels = [(r, m, s) for r in range(sweep.rounds) for m in sweep.mixes for s in sweep.streams]
    out: dict[tuple[int, str, int], list[list[int]]] = {}
    for mix in sweep.mixes:
        mine = [lv for lv in levels if lv[1] is mix]
        count = sum(sweep.requests(s) for _, _, s in mine)
        windows = iter(source_windows(sweep.model, mix.history + mix.prompt_tokens, count))
        for r, _, s in mine:
            out[(r, mix.name, s)] = [next(windows) for _ in range(sweep.requests(s))]
    return out


def _measure(url: str, mix: DisaggMix, batch: list[list[int]], streams: int) -> dict:
    """One level on one stack: a chat mix's histories first (untimed), then the level."""
    drive = functools.partial(drive_http, url, "bench")
    load = Load.closed(streams)
    if mix.history:
        drive([p[: mix.history] for p in batch], 1, load)
    timings, wall = drive(batch, mix.max_tokens, load)
    return dataclasses.asdict(summarize(timings, wall))


def routes(url: str) -> dict[str, float]:
    """The stack's `tpla:prefill_route_total` series that counted anything: "route/reason"."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        f"{s.labels['route']}/{s.labels['reason']}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tpla:prefill_route_total" and s.value
    }


def run(sweep: DisaggSweep) -> dict:
    batches = prompts(sweep)
    rows: list[dict] = []
    with ExitStack() as stacks:
        urls = {}
        for policy in sweep.policies:
            cfg = StackConfig(f"disagg-{policy}", 2, sweep.reparam, disagg_policy=policy)
            urls[policy] = stacks.enter_context(running_stack(cfg, sweep.model))
        first = batches[(0, sweep.mixes[0].name, sweep.streams[0])][0]
        for url in urls.values():  # connections, process groups, first-call paths
            drive_http(url, "bench", [first], 2, Load.closed(1))
        for r in range(sweep.rounds):
            order = (
                sweep.policies[r % len(sweep.policies) :]
                + sweep.policies[: r % len(sweep.policies)]
            )
            for policy in order:
                for mix in sweep.mixes:
                    for streams in sweep.streams:
                        batch = batches[(r, mix.name, streams)]
                        row = _measure(urls[policy], mix, batch, streams)
                        rows.append(
                            {
                                "policy": policy,
                                "mix": mix.name,
                                "streams": streams,
                                "round": r,
                                **row,
                            }
                        )
                        _print(rows[-1])
        counted = {policy: routes(url) for policy, url in urls.items()}
    summary = aggregate(rows)
    return {
        "bench": "serve-disagg",
        "model": sweep.model,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "sweep": {
            "policies": list(sweep.policies),
            "mixes": [dataclasses.asdict(m) for m in sweep.mixes],
            "streams": list(sweep.streams),
            "rounds": sweep.rounds,
            "waves": sweep.waves,
            "stack": "tpla serve: decode TPLA tp=2 r=2 (PCA basis), 1 prefill worker, defaults",
        },
        "results": rows,
        "summary": summary,
        "routes": counted,
        "goals": goals(summary),
    }


def _print(row: dict) -> None:
    print(
        f"round {row['round']} {row['policy']:<6} {row['mix']:<5} c{row['streams']:<3} "
        f"{row['completed']}/{row['requests']} ok  TTFT p50 {row['ttft_p50_ms']:8.1f} "
        f"p99 {row['ttft_p99_ms']:8.1f} ms  TPOT p99 {row['tpot_p99_ms']:7.1f} ms",
        file=sys.stderr,
        flush=True,
    )


def aggregate(rows: Sequence[dict]) -> list[dict]:
    """Per (policy, mix, streams): each metric's median over the rounds and its spread."""
    keys = list(dict.fromkeys((r["policy"], r["mix"], r["streams"]) for r in rows))
    out = []
    for policy, mix, streams in keys:
        mine = [r for r in rows if (r["policy"], r["mix"], r["streams"]) == (policy, mix, streams)]
        entry: dict = {"policy": policy, "mix": mix, "streams": streams, "rounds": len(mine)}
        for metric in METRICS:
            values = [r[metric] for r in mine]
            entry[metric] = statistics.median(values)
            entry[f"{metric}_spread"] = [min(values), max(values)]
        entry["completed"] = sum(r["completed"] for r in mine)
        entry["requests"] = sum(r["requests"] for r in mine)
        out.append(entry)
    return out


def goals(summary: Sequence[dict]) -> dict:
    """The issue's goals, against `always` at each level: short and chat TTFT p50 at most
    0.6x (the median's ratio); long prompts' TTFT p50 and every mix's TPOT p99 within the
    rounds' spread of `always` (the median at most `always`'s worst round)."""
    at = {(e["policy"], e["mix"], e["streams"]): e for e in summary}
    out: dict = {}
    for (policy, mix, streams), e in at.items():
        base = at.get(("always", mix, streams))
        if policy == "always" or base is None:
            continue
        tag = f"{policy}_{mix}_c{streams}"
        ttft = e["ttft_p50_ms"] / base["ttft_p50_ms"]
        if mix == "long":
            out[f"{tag}_ttft_p50_within_spread"] = e["ttft_p50_ms"] <= base["ttft_p50_ms_spread"][1]
        else:
            out[f"{tag}_ttft_p50_ratio"] = round(ttft, 3)
            out[f"{tag}_ttft_p50_at_most_0.6"] = ttft <= 0.6
        out[f"{tag}_tpot_p99_within_spread"] = e["tpot_p99_ms"] <= base["tpot_p99_ms_spread"][1]
    return out


def cmd(policies: Sequence[str], model: str, rounds: int, out: str, plot: str) -> int:
    report = run(DisaggSweep(model, tuple(policies), rounds=rounds))
    if out:
        with open(out, "w") as f:
            f.write(json.dumps(report, indent=2) + "\n")
    if plot:
        from tools.bench.plots import plot_disagg

        plot_disagg(report, plot)
    print(json.dumps(report["goals"], indent=2))
    return 0 if all(e["completed"] == e["requests"] for e in report["summary"]) else 1

"""The performance profile `tpla bench serve --profile PATH` writes for the autoscaler
(services/autoscaler/profile.py), from the rows of one disaggregated configuration's sweep.

Prefill: per mix, the level with the fewest concurrent requests; its c prompts arrive
together and the last first token comes when all c are prefilled, so one worker's prompt
tokens/s is c x prompt tokens / TTFT p99 (at c = 1: the prompt over its TTFT). Decode: the
closed loop's c requests decode side by side, so TPOT p50 at concurrency c and context
prompt + output / 2 is the group's inter-token latency at batch c. The sweep's mixes and
levels must form a full grid (every mix at every level)."""

from __future__ import annotations

from common.parallel import BASELINE, ParallelMode
from services.autoscaler.profile import DecodeProfile, PerformanceProfile, PrefillProfile

PREFILL_WORKER_GPUS = 1


def profile_from_rows(
    rows: list[dict], config: str, model: str, decode_gpus: int, source: str
) -> PerformanceProfile:
    """The profile of `config`'s closed-loop rows of a `tpla bench serve` report."""
    mine = [
        r for r in rows if r["config"] == config and r["arrival"] == "closed" and r["completed"]
    ]
    if not mine:
        raise ValueError(f"no completed closed-loop rows of {config!r} to profile")
    prefill: dict[int, float] = {}
    for prompt in sorted({r["prompt_tokens"] for r in mine}):
        row = min((r for r in mine if r["prompt_tokens"] == prompt), key=lambda r: r["concurrency"])
        prefill[prompt] = row["concurrency"] * prompt / (row["ttft_p99_ms"] / 1e3)
    batches = sorted({r["concurrency"] for r in mine})
    contexts = sorted({r["prompt_tokens"] + r["max_tokens"] // 2 for r in mine})
    grid: dict[tuple[int, int], float] = {
        (r["concurrency"], r["prompt_tokens"] + r["max_tokens"] // 2): r["tpot_p50_ms"] / 1e3
        for r in mine
    }
    missing = [(b, c) for b in batches for c in contexts if (b, c) not in grid]
    if missing:
        raise ValueError(f"the sweep is not a full grid: no row at (batch, context) {missing}")
    return PerformanceProfile(
        model=model,
        source=source,
        prefill=PrefillProfile(
            PREFILL_WORKER_GPUS, tuple(prefill), tuple(round(v, 3) for v in prefill.values())
        ),
        decode=DecodeProfile(
            decode_gpus,
            tuple(batches),
            tuple(contexts),
            tuple(tuple(round(grid[(b, c)], 6) for c in contexts) for b in batches),
        ),
    )


def profile_from_report(report: dict, decode_gpus: int) -> PerformanceProfile:
    """The profile of the report's first disaggregated configuration (tpla, else mla-tp)."""
    disaggregated = (ParallelMode.TPLA.value, BASELINE.value)
    configs = [c for c in disaggregated if c in report["sweep"]["configs"]]
    if not configs:
        raise ValueError(
            "--profile needs a disaggregated configuration ({} or {})".format(*disaggregated)
        )
    machine = report.get("machine", {})
    source = (
        f"tpla bench serve --configs {configs[0]}, {report['date']}, "
        f"{machine.get('cpus', '?')} CPUs ({machine.get('platform', '?')})"
    )
    return profile_from_rows(report["results"], configs[0], report["model"], decode_gpus, source)

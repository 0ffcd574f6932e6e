"""The disaggregation bench's pure parts: its levels' prompts (distinct, a chat turn carrying
its history, the same for every policy), the rounds' medians and spreads, the goals."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench.disagg import DisaggMix, DisaggSweep, aggregate, goals, prompts

DEMO = Path(__file__).resolve().parents[4] / "models" / "demo"


def test_prompts_per_level() -> None:
    mixes = (DisaggMix("short", 8, 2), DisaggMix("chat", 4, 2, history=16))
    sweep = DisaggSweep(str(DEMO), ("always",), mixes, streams=(1, 4), rounds=2, waves=1, least=2)
    batches = prompts(sweep)
    assert sorted(batches) == [(r, m, s) for r in (0, 1) for m in ("chat", "short") for s in (1, 4)]
    assert [len(batches[(0, "short", s)]) for s in (1, 4)] == [2, 4]
    assert {len(p) for p in batches[(1, "chat", 4)]} == {20}  # history + message
    every = [tuple(p) for batch in batches.values() for p in batch]
    assert len(set(every)) == len(every)
    with pytest.raises(ValueError, match="--disagg"):
        DisaggSweep("m", ("sometimes",))


def _row(policy: str, mix: str, r: int, ttft: float, tpot: float) -> dict:
    return {
        "policy": policy,
        "mix": mix,
        "streams": 4,
        "round": r,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": 2 * ttft,
        "tpot_p99_ms": tpot,
        "completed": 4,
        "requests": 4,
    }


def test_medians_spreads_and_goals() -> None:
    rows = [
        *(_row("always", "short", r, t, 10.0 + r) for r, t in enumerate((100.0, 120.0, 90.0))),
        *(_row("auto", "short", r, t, 11.0) for r, t in enumerate((50.0, 70.0, 60.0))),
        *(_row("always", "long", r, t, 10.0) for r, t in enumerate((400.0, 500.0, 450.0))),
        *(_row("auto", "long", r, t, 13.0) for r, t in enumerate((480.0, 460.0, 470.0))),
    ]
    summary = aggregate(rows)
    short = next(e for e in summary if (e["policy"], e["mix"]) == ("always", "short"))
    assert short["ttft_p50_ms"] == 100.0 and short["ttft_p50_ms_spread"] == [90.0, 120.0]
    assert short["tpot_p99_ms_spread"] == [10.0, 12.0] and short["requests"] == 12
    got = goals(summary)
    assert got["auto_short_c4_ttft_p50_ratio"] == 0.6 and got["auto_short_c4_ttft_p50_at_most_0.6"]
    assert got["auto_short_c4_tpot_p99_within_spread"]
    assert got["auto_long_c4_ttft_p50_within_spread"]  # 470 <= 500, the worst round
    assert not got["auto_long_c4_tpot_p99_within_spread"]  # 13 > 10

"""`tpla bench autoscale`: a synthetic load trace with a burst through the simulated pools
(tools/bench/autoscale_sim.py) built from a performance profile, twice: the autoscaler
(services/autoscaler: sizing, then smoothing) deciding every interval, and a static
allocation sized by the same sizing for the peak. Reports the GPU-hours each held and the
TTFT / ITL quantiles each served against the SLOs."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from services.autoscaler.planner import Planner, PlannerConfig
from services.autoscaler.predictor import ForecastConfig
from services.autoscaler.profile import load_profile
from services.autoscaler.sizing import Observation, Replicas, RoleBounds, SizingConfig, size
from services.autoscaler.smoothing import SmoothingConfig
from tools.bench.autoscale_sim import (
    Pools,
    SimConfig,
    SimResult,
    quantile,
    simulate,
    trace,
    weighted_quantile,
)


@dataclass
class AutoscaledPools(Pools):
    planner: Planner

    def decide(self, obs: Observation, now: float, current: Replicas) -> Replicas:
        return self.planner.decide(obs, now, current).desired


@dataclass
class StaticPools(Pools):
    replicas: Replicas

    def decide(self, obs: Observation, now: float, current: Replicas) -> Replicas:
        return self.replicas


def _summary(res: SimResult, cfg: SizingConfig, burst: tuple[float, float]) -> dict:
    in_burst = [
        x for x, t in zip(res.ttft_s, res.first_at, strict=True) if burst[0] <= t < burst[1]
    ]
    q = cfg.ttft_quantile
    return {
        "gpu_hours": res.gpu_s / 3600,
        "requests": len(res.ttft_s),
        f"ttft_p{round(100 * q)}_ms": 1e3 * quantile(res.ttft_s, q),
        "ttft_p99_ms": 1e3 * quantile(res.ttft_s, 0.99),
        f"ttft_p{round(100 * q)}_burst_ms": 1e3 * quantile(in_burst, q),
        "itl_p50_ms": 1e3 * weighted_quantile(res.itl, 0.5),
        "itl_p99_ms": 1e3 * weighted_quantile(res.itl, 0.99),
        "ttft_within_slo": sum(x <= cfg.slo_ttft_s for x in res.ttft_s) / max(len(res.ttft_s), 1),
        "max_replicas": {
            "prefill": max(r[1] for r in res.replicas),
            "decode": max(r[2] for r in res.replicas),
        },
    }


def run(args: argparse.Namespace) -> tuple[dict, dict[str, SimResult]]:
    profile = load_profile(args.profile)
    cfg = SizingConfig(
        args.slo_ttft_ms / 1e3,
        args.slo_itl_ms / 1e3,
        RoleBounds(args.min_prefill, args.max_replicas),
        RoleBounds(1, args.max_replicas),
        ttft_quantile=args.ttft_quantile,
    )
    end = args.minutes * 60.0
    burst = (end * 0.4, end * 0.6)
    # The burst ramps up over --ramp-s in ten steps (0: a step), holds, then drops at once.
    ramp = (
        [
            (
                burst[0] + args.ramp_s * i / 10,
                args.base_rate + (args.peak_rate - args.base_rate) * (i + 1) / 10,
            )
            for i in range(10)
        ]
        if args.ramp_s > 0
        else [(burst[0], args.peak_rate)]
    )
    steps = [(0.0, args.base_rate), *ramp, (burst[1], args.base_rate)]
    requests = trace(steps, end, args.prompt_tokens, args.output_tokens, args.seed)
    peak = Observation(60.0, args.peak_rate, args.prompt_tokens, args.output_tokens, None, None,
                       0.0, 0.0)  # fmt: skip
    static = size(profile, peak, Replicas(1, 1), cfg).replicas
    sim = SimConfig(interval_s=args.interval_s)
    start = Replicas(args.min_prefill, 1)
    smoothing = SmoothingConfig(args.cooldown_s, max_step_up=4, max_step_down=1)
    # Sized for the load when a replica asked for now would serve, through the interval the
    # decision stands for.
    forecast = ForecastConfig(
        horizon_prefill_s=sim.start_prefill_s + sim.interval_s,
        horizon_decode_s=sim.start_decode_s + sim.interval_s,
        headroom=args.headroom,
    )
    planners = {
        "autoscaled": PlannerConfig(cfg, smoothing, forecast),
        "reactive": PlannerConfig(cfg, smoothing, ForecastConfig(headroom=args.headroom)),
    }
    results = {
        name: simulate(
            profile, requests, AutoscaledPools(Planner(profile, start, 0.0, pc)), start, end, sim
        )
        for name, pc in planners.items()
    }
    results["static_peak"] = simulate(profile, requests, StaticPools(static), static, end, sim)
    report = {
        "bench": "autoscale",
        "profile": args.profile,
        "profile_source": profile.source,
        "trace": {
            "minutes": args.minutes,
            "rates": steps,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "requests": len(requests),
            "seed": args.seed,
        },
        "slo": {
            "ttft_ms": args.slo_ttft_ms,
            "ttft_quantile": args.ttft_quantile,
            "itl_ms": args.slo_itl_ms,
        },
        "forecast": {
            "horizon_prefill_s": forecast.horizon_prefill_s,
            "horizon_decode_s": forecast.horizon_decode_s,
            "alpha": forecast.alpha,
            "beta": forecast.beta,
            "headroom": args.headroom,
            "min_prefill": args.min_prefill,
        },
        "static_peak_replicas": {"prefill": static.prefill, "decode": static.decode},
        "results": {name: _summary(res, cfg, burst) for name, res in results.items()},
    }
    a, s = report["results"]["autoscaled"], report["results"]["static_peak"]
    report["gpu_hours_ratio"] = a["gpu_hours"] / s["gpu_hours"]
    return report, results


def plot(report: dict, results: dict[str, SimResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_n, ax_t) = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    minutes = report["trace"]["minutes"]
    rates = report["trace"]["rates"]
    xs = [start / 60 for start, _ in rates] + [minutes]
    ax_r.step(xs, [rate for _, rate in rates] + [rates[-1][1]], where="post", color="C0")
    ax_r.set_ylabel("offered requests / s")
    ax_r.set_title("load: Poisson arrivals with a burst")
    for name, res, style in (("forecast", results["autoscaled"], "-"),
                             ("reactive", results["reactive"], "--"),
                             ("static (peak)", results["static_peak"], ":")):  # fmt: skip
        xs = [r[0] / 60 for r in res.replicas]
        ax_n.plot(xs, [r[1] for r in res.replicas], "C1" + style, label=f"prefill, {name}")
        ax_n.plot(xs, [r[2] for r in res.replicas], "C2" + style, label=f"decode, {name}")
        per_min: dict[int, list[float]] = {}
        for ttft, t in zip(res.ttft_s, res.first_at, strict=True):
            per_min.setdefault(int(t // 60), []).append(ttft)
        q = report["slo"]["ttft_quantile"]
        mins = sorted(per_min)
        ax_t.plot(mins, [1e3 * quantile(per_min[m], q) for m in mins], "C3" + style,
                  label=f"TTFT p{round(100 * q)} per minute, {name}")  # fmt: skip
    ax_t.axhline(report["slo"]["ttft_ms"], color="k", lw=0.8, label="TTFT SLO")
    ax_n.set_ylabel("replicas (live)")
    ax_n.legend(fontsize=8)
    ax_t.set_ylabel("ms")
    ax_t.set_xlabel("minutes")
    ax_t.legend(fontsize=8)
    a, s = report["results"]["autoscaled"], report["results"]["static_peak"]
    fig.suptitle(
        f"autoscaler vs static peak allocation: {a['gpu_hours']:.2f} vs {s['gpu_hours']:.2f} "
        f"GPU-hours ({report['gpu_hours_ratio']:.2f}x), simulated from {report['profile']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def cmd(args: argparse.Namespace) -> int:
    report, results = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, results, Path(args.plot))
    print(json.dumps(report) if args.json else json.dumps(report["results"], indent=2))
    return 0


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("autoscale", help="simulated autoscaler vs static peak allocation")
    p.add_argument("--profile", default="tests/data/autoscaler_profile.json")
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--base-rate", type=float, default=2.0, help="requests/s outside the burst")
    p.add_argument("--peak-rate", type=float, default=10.0, help="requests/s in the burst")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--ramp-s", type=float, default=300.0, help="the burst's rise (0: a step)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--ttft-quantile", type=float, default=0.9)
    p.add_argument("--slo-itl-ms", type=float, default=20.0)
    p.add_argument("--max-replicas", type=int, default=16)
    p.add_argument("--interval-s", type=float, default=30.0)
    p.add_argument("--cooldown-s", type=float, default=180.0)
    p.add_argument("--headroom", type=float, default=0.0, help="spare capacity (a fraction)")
    p.add_argument("--min-prefill", type=int, default=1, help="prefill workers at least")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--plot", default="")
    p.set_defaults(func=cmd)

"""`tpla autoscaler`: sizes the prefill and decode pools against TTFT / ITL SLOs from the
routers' metrics and a performance profile (services/autoscaler). `--once --json` prints one
decision and its inputs; otherwise it decides every interval and publishes
`tpla:autoscaler_desired_replicas{role, mode}` on its own /metrics for KEDA."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.autoscaler.sizing import SizingConfig


def _config(args: argparse.Namespace) -> SizingConfig:
    from services.autoscaler.sizing import RoleBounds, SizingConfig

    return SizingConfig(
        slo_ttft_s=args.slo_ttft_ms / 1e3,
        slo_itl_s=args.slo_itl_ms / 1e3,
        prefill=RoleBounds(args.min_prefill, args.max_prefill),
        decode=RoleBounds(args.min_decode, args.max_decode),
        ttft_quantile=args.ttft_quantile,
        backlog_s=args.backlog_s,
    )


def cmd_autoscaler(args: argparse.Namespace) -> int:
    from common.runtime.metrics import serve_metrics
    from common.runtime.settings import load_settings
    from services.autoscaler.planner import PlannerConfig
    from services.autoscaler.predictor import ForecastConfig
    from services.autoscaler.profile import load_profile
    from services.autoscaler.replica_counts import RegistryCounts
    from services.autoscaler.service import Autoscaler, LoopConfig, decide_once
    from services.autoscaler.sizing import Replicas
    from services.autoscaler.smoothing import SmoothingConfig
    from services.autoscaler.sources import LoadSource, PrometheusSource, RouterSource

    if bool(args.router_url) == bool(args.prometheus_url):
        raise ValueError("give --router-url (one or more) or --prometheus-url")
    profile = load_profile(args.profile)
    source: LoadSource = (
        RouterSource(args.router_url, args.window_s)
        if args.router_url
        else PrometheusSource(args.prometheus_url, args.window_s)
    )
    sizing = _config(args)
    current = Replicas(
        args.prefill_replicas if args.prefill_replicas is not None else args.min_prefill,
        args.decode_replicas if args.decode_replicas is not None else args.min_decode,
    )
    redis_url = load_settings(redis_url=args.redis_url or None).redis_url
    counts = RegistryCounts(redis_url) if redis_url else None
    if counts is not None and args.prefill_replicas is None and args.decode_replicas is None:
        current = counts.current()
    if args.once:
        # Scripts that drive load during the window wait for this line.
        print(f"tpla autoscaler: observing for {args.window_s:g} s", file=sys.stderr, flush=True)
        decision = decide_once(profile, source, current, sizing)
        out = decision.to_dict()
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    smoothing = SmoothingConfig(args.cooldown_s, args.max_step_up, args.max_step_down)
    forecast = ForecastConfig(
        horizon_prefill_s=args.startup_prefill_s + args.interval_s if args.forecast else 0.0,
        horizon_decode_s=args.startup_decode_s + args.interval_s if args.forecast else 0.0,
        headroom=args.headroom,
    )
    planner = PlannerConfig(sizing, smoothing, forecast)
    loop = Autoscaler(
        profile, source, current, LoopConfig(planner, args.interval_s, args.dry_run), counts
    )
    serve_metrics(loop.registry, args.host, args.port)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: loop.stop())
    loop.run()
    return 0


def add_autoscaler_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("autoscaler", help="size the prefill and decode pools against SLOs")
    src = p.add_argument_group("load source (one of)")
    src.add_argument("--router-url", nargs="+", default=[], help="router(s) to scrape /metrics")
    src.add_argument("--prometheus-url", default="", help="Prometheus HTTP API base URL")
    p.add_argument("--profile", required=True, help="from `tpla bench serve --profile PATH`")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-itl-ms", type=float, required=True)
    p.add_argument("--ttft-quantile", type=float, default=0.9, help="the TTFT SLO's quantile")
    for role, lo, hi in (("prefill", 1, 8), ("decode", 1, 8)):
        p.add_argument(f"--min-{role}", type=int, default=lo, help=f"{role} replicas at least")
        p.add_argument(f"--max-{role}", type=int, default=hi, help=f"{role} replicas at most")
        p.add_argument(
            f"--{role}-replicas",
            type=int,
            help=f"{role} replicas running now (the correction's baseline; default: --min)",
        )
    p.add_argument(
        "--redis-url",
        default="",
        help="the worker registry: the pools' real sizes are read from it (prefill records; "
        "decode groups = distinct groups of rank-0 records). Default TPLA_REDIS_URL; without "
        "either, the loop takes its last published counts as the sizes (dry: --*-replicas)",
    )
    p.add_argument("--window-s", type=float, default=30.0, help="the load's averaging window")
    p.add_argument("--backlog-s", type=float, default=30.0, help="clear a queue within this")
    p.add_argument("--once", action="store_true", help="print one decision and exit")
    p.add_argument("--json", action="store_true", help="--once: the decision as one JSON line")
    p.add_argument("--interval-s", type=float, default=15.0, help="loop: between decisions")
    p.add_argument("--cooldown-s", type=float, default=300.0, help="loop: before a scale-in")
    p.add_argument("--max-step-up", type=int, default=4, help="loop: replicas added at most")
    p.add_argument("--max-step-down", type=int, default=1, help="loop: replicas removed at most")
    p.add_argument(
        "--no-forecast",
        dest="forecast",
        action="store_false",
        help="loop: size for the observed load (default: for the load forecast, by Holt's "
        "linear trend, at the time a replica asked for now serves plus one interval)",
    )
    p.add_argument("--startup-prefill-s", type=float, default=60.0, help="loop: until a new "
                   "prefill worker serves (the forecast's lead)")  # fmt: skip
    p.add_argument("--startup-decode-s", type=float, default=120.0, help="loop: until a new "
                   "decode group serves")  # fmt: skip
    p.add_argument("--headroom", type=float, default=0.0, help="loop: spare capacity, a "
                   "fraction of the load sized for")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help='loop: publish with mode="dry-run"')
    p.add_argument("--host", default="0.0.0.0", help="loop: /metrics address")
    p.add_argument("--port", type=int, default=9100, help="loop: /metrics port")
    p.set_defaults(func=cmd_autoscaler)

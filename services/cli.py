"""Sub-commands that run services: `tpla decode | prefill | router | serve`."""

from __future__ import annotations

import argparse

from common.settings import Settings, load_settings, placed


def _settings(args: argparse.Namespace) -> Settings:
    fields = (
        "model",
        "tp",
        "latent_groups",
        "rmsnorm",
        "reparam",
        "transport",
        "redis_url",
        "host",
        "router_port",
        "prefill_port",
        "decode_port",
        "kv_port_base",
        "dist_port",
        "kv_budget_mb",
        "max_batch",
        "parallel",
        "chunk_size",
        "torch_threads",
    )
    over = {f: getattr(args, f, None) for f in fields}
    if getattr(args, "port", None) is not None:
        over[args.port_field] = args.port
    if over.get("reparam") == "none":
        over["reparam"] = ""
    return load_settings(**over)


def cmd_decode(args: argparse.Namespace) -> int:
    import torch

    from services.decode.config import engine_config
    from services.decode.service import serve_decode

    s = placed(_settings(args))
    torch.set_num_threads(s.torch_threads)
    return serve_decode(
        engine_config(s),
        s.decode_port,
        s.redis_url,
        heartbeat_s=s.heartbeat_s,
        worker_ttl_s=s.worker_ttl_s,
    )


def cmd_prefill(args: argparse.Namespace) -> int:
    import torch

    from common.prefill_threads import PrefillThreads
    from services.prefill.service import serve_prefill

    s = placed(_settings(args))
    torch.set_num_threads(s.torch_threads)
    token = s.internal_token.get_secret_value() if s.internal_token else None
    serve_prefill(
        s.model,
        s.reparam or None,
        s.host,
        s.prefill_port,
        s.redis_url,
        transport=s.transport,
        token=token,
        dtype=s.dtype,
        device=s.device,
        heartbeat_s=s.heartbeat_s,
        worker_ttl_s=s.worker_ttl_s,
        transfer_timeout_s=s.transfer_timeout_s,
        attention_backend=s.attention_backend,
        threads=PrefillThreads.from_settings(s),
        max_batch_tokens=s.prefill_batch_tokens,
        prefix_cache_mb=s.prefix_cache_mb if s.prefix_cache else 0.0,
    )
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from services.router.app import run_router

    run_router(_settings(args))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from services.serve import serve_stack

    settings = _settings(args)
    placed(settings)  # a device that does not exist fails here, before anything starts
    return serve_stack(settings, smoke=args.smoke)


def cmd_bench_decode_step(args: argparse.Namespace) -> int:
    import json

    from services.decode.bench import measure

    rows = []
    for collectives in args.collectives:
        for layout in args.layouts:
            r = args.tp if layout == "tpla" else 1
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
            )
    # Speedups are against MLA-TP with the same collectives, from this run.
    base = {(row.collectives, row.batch): row for row in rows if row.layout == "mla-tp"}
    print(
        f"{'coll':>5} {'layout':>7} {'tp':>3} {'r':>3} {'batch':>6} {'context':>8} {'step ms':>9} "
        f"{'speedup':>8} {'cache KiB/seq':>14} {'vs MLA-TP':>10} {'comm KiB/step':>14} "
        f"{'rank0 MB':>9}"
    )
    out = []
    for row in rows:
        ref = base.get((row.collectives, row.batch))
        speed = ref.median_ms / row.median_ms if ref else float("nan")
        mem = ref.cache_bytes_per_sequence / row.cache_bytes_per_sequence if ref else float("nan")
        print(
            f"{row.collectives:>5} {row.layout:>7} {row.tp:>3} {row.latent_groups:>3} "
            f"{row.batch:>6} {row.context:>8} {row.median_ms:>9.2f} {speed:>7.2f}x "
            f"{row.cache_bytes_per_sequence / 1024:>14.1f} {mem:>9.2f}x "
            f"{row.comm_bytes_per_step / 1024:>14.1f} {row.parameter_bytes_rank0 / 2**20:>9.1f}"
        )
        out.append({**row.__dict__, "speedup_vs_mla_tp": speed, "cache_saving_vs_mla_tp": mem})
    if args.json:
        print(json.dumps({"rows": out}))
    return 0


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (results as ratios from one run)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    ds = bsub.add_parser("decode-step", help="real engine step: MLA-TP vs TPLA vs SP")
    ds.add_argument("--model", default="models/demo")
    ds.add_argument("--tp", type=int, default=2)
    ds.add_argument(
        "--layouts",
        nargs="+",
        choices=["mla-tp", "tpla", "sp"],
        default=["mla-tp", "tpla", "sp"],
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
    ds.add_argument("--json", action="store_true")
    ds.set_defaults(func=cmd_bench_decode_step)
    from common.bench.cli import add_bench_commands

    add_bench_commands(bsub)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (TPLA_MODEL)")
    p.add_argument("--redis-url", help="TPLA_REDIS_URL")
    p.add_argument("--host", help="interface to bind (TPLA_HOST, default 127.0.0.1)")
    p.add_argument("--torch-threads", type=int)
    p.add_argument("--reparam", help="TPLA side file in the model dir (tpla_pca, ...) or none")


def _decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, help="decode ranks (TPLA_TP)")
    p.add_argument("--latent-groups", type=int, help="TPLA latent groups r (1 = MLA-TP)")
    p.add_argument("--rmsnorm", choices=["exact", "sliced"])
    p.add_argument("--parallel", choices=["tpla", "mla-tp", "sp"], help="decode parallel mode")
    p.add_argument("--chunk-size", type=int, help="SP: tokens per round-robin chunk")
    p.add_argument("--kv-port-base", type=int)
    p.add_argument("--dist-port", type=int)
    p.add_argument("--kv-budget-mb", type=float)
    p.add_argument("--max-batch", type=int)


def add_service_parsers(sub: argparse._SubParsersAction) -> None:
    add_bench_parsers(sub)
    dec = sub.add_parser("decode", help="run a decode group (leader + ranks) serving gRPC")
    _common(dec)
    _decode_args(dec)
    dec.add_argument("--port", type=int, help="Decode gRPC port (default 50061)")
    dec.set_defaults(func=cmd_decode, port_field="decode_port")

    pre = sub.add_parser("prefill", help="run a prefill worker serving gRPC")
    _common(pre)
    pre.add_argument("--port", type=int, help="Prefill gRPC port (default 50051)")
    pre.add_argument("--transport", choices=["grpc", "torch"])
    pre.set_defaults(func=cmd_prefill, port_field="prefill_port")

    rtr = sub.add_parser("router", help="run the OpenAI-compatible HTTP router")
    _common(rtr)
    rtr.add_argument("--port", type=int, help="HTTP port (default 8000)")
    rtr.add_argument("--transport", choices=["grpc", "torch"])
    rtr.set_defaults(func=cmd_router, port_field="router_port")

    srv = sub.add_parser("serve", help="the whole stack locally: Redis, prefill, decode, router")
    _common(srv)
    _decode_args(srv)
    srv.add_argument("--port", type=int, help="router HTTP port (default 8000)")
    srv.add_argument("--transport", choices=["grpc", "torch"])
    srv.add_argument(
        "--smoke",
        action="store_true",
        help="start, send one chat request, print it, stop (used by tests)",
    )
    srv.set_defaults(func=cmd_serve, port_field="router_port")

"""Sub-commands that run services: `tpla decode | prefill | router | serve`."""

from __future__ import annotations

import argparse

from common.group.membership import process_rank
from common.parallel import LAYOUT_NAMES, RMSNORM_MODES
from common.runtime.settings import Settings, load_settings, placed


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
        "rank",
        "group_size",
        "group_addr",
        "node",
        "nodes",
        "advertise_host",
        "prefill_tp",
        "prefill_dist_port",
    )
    over = {f: getattr(args, f, None) for f in fields}
    if getattr(args, "port", None) is not None:
        over[args.port_field] = args.port
    return load_settings(**over)


def cmd_decode(args: argparse.Namespace) -> int:
    import torch

    from common.rpc.server import Lifetime
    from services.decode.config import engine_config
    from services.decode.service import serve_decode

    s = placed(_settings(args))
    torch.set_num_threads(s.torch_threads)
    rank = process_rank(s, s.tp, "TPLA_TP")
    if rank > 0:  # a follower (a host's first) of a group whose hosts join on their own
        from services.decode.service import serve_rank

        return serve_rank(engine_config(s), rank, s.drain_grace_s)
    return serve_decode(engine_config(s), s.decode_port, Lifetime.from_settings(s))


def cmd_prefill(args: argparse.Namespace) -> int:
    import torch

    from common.rpc.server import Lifetime
    from services.prefill.config import prefill_config
    from services.prefill.service import serve_prefill

    s = placed(_settings(args))
    torch.set_num_threads(s.torch_threads)
    rank = process_rank(s, s.prefill_tp, "TPLA_PREFILL_TP")
    if rank > 0:  # a follower (a host's first) of a prefill group whose hosts join on their own
        from services.prefill.service import serve_rank

        return serve_rank(prefill_config(s), rank)
    return serve_prefill(prefill_config(s), s.prefill_port, Lifetime.from_settings(s))


def cmd_router(args: argparse.Namespace) -> int:
    from services.router.app import run_router

    run_router(_settings(args))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from services.stack.devices import stack_devices
    from services.stack.serve import serve_stack

    settings = _settings(args)
    # A device that does not exist, or too few GPUs for the groups, fails here, before
    # anything starts.
    device = placed(settings).device
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    devices = stack_devices(
        device,
        settings.decode_groups,
        settings.tp,
        settings.prefill_workers,
        gpus,
        settings.prefill_tp,
    )
    return serve_stack(settings, smoke=args.smoke, devices=devices)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (TPLA_MODEL)")
    p.add_argument("--redis-url", help="TPLA_REDIS_URL")
    p.add_argument("--host", help="interface to bind (TPLA_HOST, default 127.0.0.1)")
    p.add_argument("--torch-threads", type=int)
    p.add_argument(
        "--reparam", help="TPLA side file in the model dir: auto, none or a name (TPLA_REPARAM)"
    )


def _decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, help="decode ranks (TPLA_TP)")
    p.add_argument("--latent-groups", type=int, help="TPLA latent groups r (1 = MLA-TP)")
    p.add_argument("--rmsnorm", choices=RMSNORM_MODES)
    p.add_argument("--parallel", choices=LAYOUT_NAMES, help="decode parallel mode")
    p.add_argument("--chunk-size", type=int, help="SP: tokens per round-robin chunk")
    p.add_argument("--kv-port-base", type=int)
    p.add_argument("--dist-port", type=int)
    p.add_argument("--kv-budget-mb", type=float)
    p.add_argument("--max-batch", type=int)


def _host_args(p: argparse.ArgumentParser, size: str) -> None:
    """A group over hosts that each run several ranks (one pod per node, docs/deploy.md)."""
    p.add_argument(
        "--node",
        type=int,
        help=f"this host of a group over hosts: it runs ranks K x L .. K x L + L - 1, L = "
        f"{size} / --nodes, spawning all but the first (TPLA_NODE; 0 leads)",
    )
    p.add_argument("--nodes", type=int, help="hosts of the group (TPLA_NODES)")


def add_service_parsers(sub: argparse._SubParsersAction) -> None:
    dec = sub.add_parser("decode", help="run a decode group (leader + ranks) serving gRPC")
    _common(dec)
    _decode_args(dec)
    dec.add_argument("--port", type=int, help="Decode gRPC port (default 50061)")
    # A group across hosts: each rank its own process (docs/deploy.md); rank 0 leads.
    dec.add_argument("--rank", type=int, help="this rank of a joined group (TPLA_RANK)")
    dec.add_argument("--group-size", type=int, help="ranks of the group (TPLA_GROUP_SIZE)")
    dec.add_argument("--group-addr", help="leader's HOST:PORT rendezvous (TPLA_GROUP_ADDR)")
    _host_args(dec, "TPLA_TP")
    dec.add_argument(
        "--advertise-host", help="host others reach this rank at (TPLA_ADVERTISE_HOST)"
    )
    dec.set_defaults(func=cmd_decode, port_field="decode_port")

    pre = sub.add_parser("prefill", help="run a prefill worker (a group of ranks) serving gRPC")
    _common(pre)
    pre.add_argument("--port", type=int, help="Prefill gRPC port (default 50051)")
    pre.add_argument("--transport", choices=["grpc", "torch"])
    pre.add_argument(
        "--tp",
        type=int,
        dest="prefill_tp",
        metavar="N",
        help="ranks of the prefill group, one device each; the leader spawns them "
        "(TPLA_PREFILL_TP, default 1: one process)",
    )
    pre.add_argument(
        "--dist-port",
        type=int,
        dest="prefill_dist_port",
        metavar="PORT",
        help="the group's rendezvous port (TPLA_PREFILL_DIST_PORT, default 29700)",
    )
    # A group across hosts: each rank its own process; rank 0 leads and serves gRPC.
    pre.add_argument("--rank", type=int, help="this rank of a joined group (TPLA_RANK)")
    pre.add_argument("--group-size", type=int, help="ranks of the group (TPLA_GROUP_SIZE)")
    pre.add_argument("--group-addr", help="leader's HOST:PORT rendezvous (TPLA_GROUP_ADDR)")
    _host_args(pre, "TPLA_PREFILL_TP")
    pre.add_argument(
        "--advertise-host", help="host others reach this rank at (TPLA_ADVERTISE_HOST)"
    )
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
        "--prefill-tp",
        type=int,
        dest="prefill_tp",
        metavar="N",
        help="ranks of each prefill worker's group (TPLA_PREFILL_TP, default 1)",
    )
    srv.add_argument(
        "--smoke",
        action="store_true",
        help="start, send one chat request, print it, stop (used by tests)",
    )
    srv.set_defaults(func=cmd_serve, port_field="router_port")

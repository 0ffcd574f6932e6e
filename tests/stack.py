"""The stacks the tests start.

* `start_stack`: `tpla serve` (tools/local_stack.py) as a child process on a tiny model with
  small pools, shared by the end-to-end, fault-injection and GPU tests;
* `services_in_threads`: a real decode group and real prefill workers serving gRPC from
  threads of the test process, for the integration tests that talk to them directly.

The router's rig (scripted gRPC services under a real router) is tests/router_rig.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.messages import PrefillResult
from common.parallel import ParallelConfig
from common.rpc.clients import CHANNEL_OPTIONS, TOKEN_METADATA_KEY, DecodeClient, PrefillClient
from common.rpc.gen import common_pb2, prefill_pb2_grpc
from common.rpc.server import Lifetime
from common.runtime.ports import SERVICE_PORT_OFFSETS, free_port, kv_port_offsets
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig
from services.decode.service import serve_decode
from services.prefill.config import PrefillConfig, PrefillGroupConfig
from services.prefill.service import serve_prefill
from tools.local_stack import LocalStack

MODEL_NAME = "tiny-e2e"


def start_stack(model_dir: Path, transport: str, **settings: str) -> LocalStack:
    """The tiny model's stack: TPLA tp=2 r=2, no side file, 8 MiB KV per rank, fast
    heartbeats; `settings` (TPLA_<KEY> values) override any of it."""
    defaults = {
        "SERVED_MODEL_NAME": MODEL_NAME,
        "REPARAM": "",
        "TP": "2",
        "LATENT_GROUPS": "2",
        "TRANSPORT": transport,
        "KV_BUDGET_MB": "8",
        "HEARTBEAT_S": "0.5",
    }
    return LocalStack.start(model_dir, **{**defaults, **settings})


@dataclass(frozen=True)
class Services:
    decode: str  # the decode leader's gRPC address
    prefill: dict[str, str]  # KV transport -> that prefill worker's gRPC address


def wait_for_prefill(address: str, token: str | None = None, timeout_s: float = 60.0) -> None:
    """Until the worker answers GetLoad (it loads its model first)."""
    metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        while time.monotonic() < deadline:
            try:
                stub.GetLoad(common_pb2.Empty(), metadata=metadata, timeout=1)
                return
            except grpc.RpcError:
                time.sleep(0.1)
    raise AssertionError(f"prefill worker {address} did not start")


def one_rank_group(model_dir: Path, **overrides: object) -> EngineConfig:
    """A tp=1 decode group on `model_dir` for `services_in_threads`: a small pool, its KV
    receiver on a free port."""
    cfg = EngineConfig(
        model=str(model_dir),
        parallel=ParallelConfig(tp=1, latent_groups=1),
        master_port=free_port(),
        kv_budget_mb=2,
        block_size=8,
        kv_port_base=free_port(kv_port_offsets(1)),
    )
    return dataclasses.replace(cfg, **overrides)  # type: ignore[arg-type]


@contextmanager
def services_in_threads(
    cfg: EngineConfig,
    redis_url: str | None,
    transports: Sequence[str] = ("grpc",),
    *,
    token: str | None = None,
    heartbeat_s: float | None = None,
    start_timeout_s: float = 300,
    prefix_cache_mb: float = 0.0,
    chunk_tokens: int | None = None,
) -> Iterator[Services]:
    """The decode group of `cfg` and one prefill worker per KV transport on `cfg.model`, each
    serving from a thread; all stop when the block ends, also when start-up failed.
    `prefix_cache_mb`: each prefill worker's latent prefix cache (0: none); `chunk_tokens`:
    their prefill chunk (None: the device's default)."""
    stop, ready = threading.Event(), threading.Event()
    life = Lifetime(redis_url) if heartbeat_s is None else Lifetime(redis_url, heartbeat_s)
    decode_port = free_port(SERVICE_PORT_OFFSETS)
    threads = [
        threading.Thread(
            target=serve_decode,
            args=(cfg, decode_port, life),
            kwargs={"ready": ready, "stop": stop},
            daemon=True,
        )
    ]
    prefill = {}
    for transport in transports:
        port = free_port(SERVICE_PORT_OFFSETS)
        threads.append(
            threading.Thread(
                target=serve_prefill,
                args=(
                    PrefillConfig(
                        PrefillGroupConfig(
                            cfg.model,
                            transport=transport,
                            token=token,
                            prefix_cache_mb=prefix_cache_mb,
                        ),
                        chunk_tokens=chunk_tokens,
                    ),
                    port,
                    life,
                ),
                kwargs={"stop": stop},
                daemon=True,
            )
        )
        prefill[transport] = f"127.0.0.1:{port}"
    for thread in threads:
        thread.start()
    try:
        assert ready.wait(start_timeout_s), "decode group did not start"
        for address in prefill.values():
            wait_for_prefill(address, token)
        yield Services(f"127.0.0.1:{decode_port}", prefill)
    finally:
        stop.set()  # nothing may outlive the test
        for thread in threads:
            thread.join(timeout=30)


async def reserve_prefill_generate(
    decode_addr: str,
    prefill_addr: str,
    rid: str,
    prompt: list[int],
    params: SamplingParams,
    transport: str,
) -> tuple[list[int], int, PrefillResult]:
    """One request through the services as the router sends it (Reserve, Prefill,
    Generate): its tokens, the decode group's cached tokens and the prefill's result."""
    decode, prefill = DecodeClient(decode_addr), PrefillClient(prefill_addr)
    try:
        res = await decode.reserve(rid, len(prompt), params.max_tokens, prompt_ids=prompt)
        out = await prefill.prefill(rid, prompt, params, res, transport=transport)
        tokens = [out.first_token.token_id]
        async for event in decode.generate(rid, out.first_token, params):
            if event.token is not None:
                tokens.append(event.token.token_id)
        return tokens, res.cached_tokens, out
    finally:
        await decode.close()
        await prefill.close()

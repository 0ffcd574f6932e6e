"""A decode group whose ranks are started as separate `tpla decode --rank K` processes (what a
LeaderWorkerSet's pods run): it serves the greedy tokens of a spawned group, through a real
prefill worker pushing each rank's shard to that rank's own KV receiver; it ends with its
leader; and it fails start-up with a clear error, within a bounded wait, when a rank never
comes or differs from the leader.

Every process runs on 127.0.0.1 with ports of its own (the follower's KV receiver on its own
base, as on another host), and writes to a log file, never a pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.parallel import ParallelConfig, ParallelMode
from common.rpc.clients import DecodeClient, PrefillClient
from common.rpc.server import Lifetime
from common.runtime.group_files import files_of
from common.runtime.ports import SERVICE_PORT_OFFSETS, free_port, kv_port_offsets
from common.runtime.settings import load_settings
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig, Launch, engine_config
from services.decode.service import serve_decode
from services.prefill.config import PrefillConfig, PrefillGroupConfig
from services.prefill.service import serve_prefill
from tests.joined_ranks import Rank, rank_starter
from tests.tiny import save_hf

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(3, 40)), [5, 9, 2, 7, 11, 4, 8, 30, 31, 6, 12], list(range(50, 71))]
START_S = 180.0  # a cold start on a busy 2-core machine: imports, model, rendezvous
EXIT_S = 20.0
# name -> (spawned group's layout, the same as settings of `tpla decode`)
LAYOUTS = {
    "tpla-r2": (
        ParallelConfig(tp=2, latent_groups=2),
        {"PARALLEL": "tpla", "LATENT_GROUPS": "2"},
    ),
    "sp": (
        ParallelConfig(tp=2, latent_groups=1, mode=ParallelMode.SP, chunk_size=8),
        {"PARALLEL": "sp", "LATENT_GROUPS": "1", "CHUNK_SIZE": "8"},
    ),
}
BASE = {"REPARAM": "", "KV_BUDGET_MB": "4", "BLOCK_SIZE": "8"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("joined-model")
    save_hf("v2-group-yarn", path, std=0.08)
    return path


@pytest.fixture(scope="module")
def prefill_addr(model_dir: Path) -> Iterator[str]:
    """A real prefill worker (gRPC KV transport), serving both groups."""
    port, stop = free_port(SERVICE_PORT_OFFSETS), threading.Event()
    worker = threading.Thread(
        target=serve_prefill,
        args=(PrefillConfig(PrefillGroupConfig(str(model_dir))), port, Lifetime()),
        kwargs={"stop": stop},
        daemon=True,
    )
    worker.start()
    yield f"127.0.0.1:{port}"
    stop.set()
    worker.join(timeout=30)


@pytest.fixture
def start_rank(model_dir: Path, tmp_path: Path) -> Iterator:
    """`tpla decode --rank K` of a group of two (tests/joined_ranks.py)."""
    yield from rank_starter("decode", model_dir, tmp_path, BASE)


def group_ports() -> dict[str, int]:
    return {
        "decode": free_port(SERVICE_PORT_OFFSETS),
        "leader_kv": free_port(kv_port_offsets(1)),
        "follower_kv": free_port(kv_port_offsets(1)),
        "rendezvous": free_port(),
    }


async def serve_prompts(decode_addr: str, prefill_addr: str, tag: str) -> tuple[list, list]:
    """Greedy tokens of PROMPTS through Reserve -> Prefill (KV pushed to each rank's
    receiver) -> Generate, and the KV targets the group handed out."""
    decode, prefill = DecodeClient(decode_addr), PrefillClient(prefill_addr)
    outputs, targets = [], []
    try:
        for i, prompt in enumerate(PROMPTS):
            rid = f"{tag}-{i}"
            res = await decode.reserve(rid, len(prompt), GREEDY.max_tokens)
            out = await prefill.prefill(rid, prompt, GREEDY, res, transport="grpc")
            tokens = [out.first_token.token_id]
            async for event in decode.generate(rid, out.first_token, GREEDY):
                if event.token is not None:
                    tokens.append(event.token.token_id)
            outputs.append(tokens)
            targets.append([(t.rank, t.grpc_address) for t in res.targets])
    finally:
        await decode.close()
        await prefill.close()
    return outputs, targets


async def wait_serving(addr: str, ranks: list[Rank]) -> None:
    deadline = time.monotonic() + START_S
    while True:
        for rank in ranks:
            assert rank.proc.poll() is None, rank.text()
        client = DecodeClient(addr)
        try:
            await client.load(timeout=1.0)
            return
        except Exception:  # not serving yet
            assert time.monotonic() < deadline, "\n".join(r.text() for r in ranks)
            await asyncio.sleep(0.2)
        finally:
            await client.close()


@contextlib.contextmanager
def spawned_group(model_dir: Path, parallel: ParallelConfig) -> Iterator[str]:
    """The existing path: `serve_decode` in this process, its follower spawned."""
    port, stop, ready = free_port(SERVICE_PORT_OFFSETS), threading.Event(), threading.Event()
    cfg = EngineConfig(
        model=str(model_dir),
        parallel=parallel,
        master_port=free_port(),
        kv_budget_mb=4,
        block_size=8,
        kv_port_base=free_port(kv_port_offsets(parallel.tp)),
    )
    leader = threading.Thread(
        target=serve_decode,
        args=(cfg, port, Lifetime()),
        kwargs={"ready": ready, "stop": stop},
        daemon=True,
    )
    leader.start()
    try:
        assert ready.wait(START_S), "the spawned group did not start"
        yield f"127.0.0.1:{port}"
    finally:
        stop.set()
        leader.join(timeout=30)


@pytest.mark.parametrize(("layout", "end"), [("tpla-r2", "stop"), ("sp", "kill")])
def test_a_joined_group_serves_the_tokens_of_a_spawned_group(
    model_dir: Path, prefill_addr: str, start_rank, layout: str, end: str
) -> None:
    parallel, settings = LAYOUTS[layout]
    ports = group_ports()
    leader = start_rank(
        0,
        ports["rendezvous"],
        DECODE_PORT=str(ports["decode"]),
        KV_PORT_BASE=str(ports["leader_kv"]),
        **settings,
    )
    follower = start_rank(
        1, ports["rendezvous"], KV_PORT_BASE=str(ports["follower_kv"]), **settings
    )
    with spawned_group(model_dir, parallel) as spawned:
        expected, _ = asyncio.run(serve_prompts(spawned, prefill_addr, "spawned"))
    joined = f"127.0.0.1:{ports['decode']}"
    asyncio.run(wait_serving(joined, [leader, follower]))
    got, targets = asyncio.run(serve_prompts(joined, prefill_addr, "joined"))
    assert got == expected
    # Each rank's shard went to that rank's own receiver, on its own port base.
    own = [(0, f"127.0.0.1:{ports['leader_kv']}"), (1, f"127.0.0.1:{ports['follower_kv']}")]
    assert targets == [own] * len(PROMPTS)
    assert f"joined the group at 127.0.0.1:{ports['rendezvous']}" in follower.text()
    # The image's HEALTHCHECK: the leader's gRPC port, a follower's own KV receiver.
    env = {
        **os.environ,
        "TPLA_DECODE_PORT": str(ports["decode"]),
        "TPLA_KV_PORT_BASE": str(ports["follower_kv"]),
    }
    for rank in ("0", "1"):
        check = [sys.executable, str(ROOT / "docker" / "healthcheck.py"), "decode", "--rank", rank]
        assert subprocess.run(check, env=env, timeout=30).returncode == 0, rank

    if end == "stop":  # a pod's stop: the leader ends the group in order, both exit 0
        os.kill(leader.proc.pid, signal.SIGTERM)
        assert leader.wait(EXIT_S) == 0, leader.text()
        assert follower.wait(EXIT_S) == 0, follower.text()
    else:  # the leader dies: its follower sees the group gone and exits 1
        os.kill(leader.proc.pid, signal.SIGKILL)
        started = time.monotonic()
        assert follower.wait(EXIT_S) == 1, follower.text()
        assert time.monotonic() - started < EXIT_S
        gone = f"decode rank 1: the group's leader at 127.0.0.1:{ports['rendezvous']} is gone"
        assert gone in follower.text() and "Traceback" not in follower.text()
    assert not files_of(leader.proc.pid) and not files_of(follower.proc.pid)


def test_a_rank_that_never_comes_fails_start_up_in_bounded_time(start_rank) -> None:
    """A leader whose follower never joins, and a follower whose leader never answers: each
    exits 2 after the join timeout, naming what is missing and the setting."""
    lonely = group_ports()
    started = time.monotonic()
    leader = start_rank(
        0,
        lonely["rendezvous"],
        DECODE_PORT=str(lonely["decode"]),
        KV_PORT_BASE=str(lonely["leader_kv"]),
        GROUP_JOIN_TIMEOUT_S="2",
    )
    nobody = free_port()
    follower = start_rank(
        1, nobody, KV_PORT_BASE=str(lonely["follower_kv"]), GROUP_JOIN_TIMEOUT_S="2"
    )
    assert leader.wait(60) == 2, leader.text()
    assert follower.wait(60) == 2, follower.text()
    assert time.monotonic() - started < 60
    assert (
        f"tpla decode: error: decode rank(s) 1 of 2 did not join the group at "
        f"127.0.0.1:{lonely['rendezvous']} within 2 s (TPLA_GROUP_JOIN_TIMEOUT_S)"
    ) in leader.text()
    assert (
        f"decode rank 1: error: no decode leader answered at 127.0.0.1:{nobody} within 2 s"
    ) in follower.text()
    assert "Traceback" not in leader.text() + follower.text()


def test_a_rank_whose_config_differs_fails_both_with_the_difference(start_rank) -> None:
    ports = group_ports()
    leader = start_rank(
        0,
        ports["rendezvous"],
        DECODE_PORT=str(ports["decode"]),
        KV_PORT_BASE=str(ports["leader_kv"]),
        GROUP_JOIN_TIMEOUT_S="60",
    )
    follower = start_rank(
        1,
        ports["rendezvous"],
        KV_PORT_BASE=str(ports["follower_kv"]),
        PARALLEL="mla-tp",
        BLOCK_SIZE="16",
    )
    difference = (
        "its config differs from the leader's: TPLA_BLOCK_SIZE: 16 here, 8 on the leader; "
        "TPLA_LATENT_GROUPS: 1 here, 2 on the leader; TPLA_PARALLEL: mla-tp here, tpla on "
        "the leader"
    )
    assert follower.wait(60) == 2, follower.text()
    assert leader.wait(EXIT_S) == 2, leader.text()
    assert f"decode rank 1: error: {difference}" in follower.text()
    assert f"tpla decode: error: decode rank 1 could not start: {difference}" in leader.text()


def test_joined_group_settings() -> None:
    """`--rank/--group-size/--group-addr` map onto the engine config once; what cannot work
    is a clear error before anything starts."""
    cfg = engine_config(
        load_settings(rank=1, group_size=4, group_addr="leader.example:29500", tp=None)
    )
    assert (cfg.launch, cfg.parallel.tp, cfg.master_addr, cfg.master_port) == (
        Launch.JOIN,
        4,
        "leader.example",
        29500,
    )
    assert cfg.collectives == "dist" and cfg.local_index(1) == 0
    assert engine_config(load_settings()).collectives == "shm"  # a spawned group: one host
    bad = {
        "shared memory cannot reach ranks": {"collectives": "shm"},
        "--rank 2 is outside a group of 2": {"rank": 2},
        "is not HOST:PORT": {"group_addr": "leader"},
        "--group-size 2 but TPLA_TP=4": {"tp": 4},
    }
    for message, override in bad.items():
        joined = {"rank": 1, "group_size": 2, "group_addr": "127.0.0.1:29500", **override}
        with pytest.raises(ValueError, match=message):
            engine_config(load_settings(**joined))
    with pytest.raises(ValueError, match="need --group-size"):
        engine_config(load_settings(rank=1))

"""A group over two "hosts" of two ranks each, the first rank of each spawning the other (one
pod per node in Kubernetes: `tpla decode --node K --nodes 2`), serves what a spawned group of
four does: the same greedy tokens and the same logits at every step, over gloo alike. The
leader's host runs in this process (its rank 1 spawned beside it); the other host is a `tpla
decode --node 1 --nodes 2` process whose rank 3 it spawns; each host's ranks take their GPU
and ports by their index on it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.loading.serving_model import load_prefill_model
from common.parallel import ParallelConfig
from common.runtime.kernel_choice import KernelConfig
from common.runtime.ports import free_port, kv_port_offsets
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig, Launch
from services.decode.engine import DecodeEngine
from services.decode.group.spec import group_spec
from tests.joined_ranks import rank_starter
from tests.tiny import save_hf
from tools.local_driver import collect, submit

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(3, 40)), [5, 9, 2, 7, 11, 4, 8, 30, 31, 6, 12]]
# The engine's settings, as a host started on its own reads them.
SETTINGS = {
    "TP": "4",
    "LATENT_GROUPS": "2",
    "KV_BUDGET_MB": "2",
    "BLOCK_SIZE": "4",
    "REPARAM": "",
    "DECODE_KERNEL": "torch",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hosts-model")
    save_hf("v2-group-yarn", path, std=0.08)
    return path


@pytest.fixture
def start_host(model_dir: Path, tmp_path: Path) -> Iterator:
    """`tpla decode --node K --nodes 2` (tests/joined_ranks.py)."""
    yield from rank_starter("decode", model_dir, tmp_path, SETTINGS, nodes=2)


def _config(model_dir: Path, **kw: object) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        parallel=ParallelConfig(tp=4, latent_groups=2),
        kv_budget_mb=2,
        block_size=4,
        record_logits=True,
        collectives="dist",
        kernels=KernelConfig(decode_attention="torch"),
        **kw,
    )


def _serve(engine: DecodeEngine, model_dir: Path) -> list[tuple[list[int], list[torch.Tensor]]]:
    prefill = load_prefill_model(model_dir, None)
    out = []
    for first, stream in submit(engine, prefill, PROMPTS, [GREEDY] * len(PROMPTS)):
        result = collect(first, stream)
        logits = [e.logits for e in result.events if e.logits is not None]
        out.append((result.token_ids, logits))
    return out


def test_two_hosts_of_two_serve_what_a_spawned_group_of_four_does(
    model_dir: Path, start_host
) -> None:
    with DecodeEngine(_config(model_dir, master_port=0)) as spawned:
        expected = _serve(spawned, model_dir)
    rendezvous = free_port()
    cfg = _config(
        model_dir, launch=Launch.JOIN, local_ranks=2, master_port=rendezvous, join_timeout_s=180
    )
    spec = group_spec(cfg)
    assert (spec.per_host, spec.hosts, spec.local_index(3), list(spec.host_ranks(2))) == (
        2,
        2,
        1,
        [3],
    )
    kv_base = free_port(kv_port_offsets(2))
    other = start_host(1, rendezvous, KV_PORT_BASE=str(kv_base))
    with DecodeEngine(cfg) as engine:
        got = _serve(engine, model_dir)
        other.wait_for("decode rank 2 of 4 joined the group")
        # The pod's Docker HEALTHCHECK: a host of the group is a follower, its KV receiver up.
        check = [sys.executable, str(ROOT / "docker" / "healthcheck.py"), "decode", "--node", "1"]
        env = {**os.environ, "TPLA_KV_PORT_BASE": str(kv_base)}
        assert subprocess.run(check, env=env, timeout=30).returncode == 0
    assert other.wait(30) == 0, other.text()
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, want), (_, have) in zip(expected, got, strict=True):
        assert len(have) == len(want) > 0
        for a, b in zip(want, have, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)

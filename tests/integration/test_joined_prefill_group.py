"""A prefill group whose ranks are started as separate `tpla prefill --rank K` processes (a
LeaderWorkerSet's pods): it prefills and ships as one process does; and it fails start-up
with a clear error, within a bounded wait, when a rank never comes or differs from the
leader (the decode groups' join, common/group/join.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.group.join import mismatch
from common.kv.transfer import make_sender
from common.loading.serving_model import load_prefill_model
from common.messages import Reservation
from common.rpc.clients import PrefillClient
from common.runtime.ports import SERVICE_PORT_OFFSETS, free_port
from common.runtime.settings import load_settings
from common.sampling.params import SamplingParams
from services.prefill.batch.job import PrefillJob
from services.prefill.config import prefill_group_config
from services.prefill.group.spec import group_spec, identity
from services.prefill.runner import LocalRunner
from services.prefill.worker import PrefillWorker
from tests.joined_ranks import rank_starter
from tests.recording_kv import Receivers, targets
from tests.tiny import save_hf

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PROMPTS = [list(range(3, 40)), [5, 9, 2, 7, 11, 4, 8, 30, 31, 6, 12]]
BASE = {"REPARAM": "", "PREFIX_CACHE_MB": "16", "PREFILL_TP": "2"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("joined-prefill")
    save_hf("v2-greedy", path, vocab_size=321)
    return path


@pytest.fixture
def start_rank(model_dir: Path, tmp_path: Path) -> Iterator:
    """`tpla prefill --rank K` of a group of two (tests/joined_ranks.py)."""
    yield from rank_starter("prefill", model_dir, tmp_path, BASE)


def _reservation(rid: str, prompt: list[int], d_c: int, address: str) -> Reservation:
    kv = targets("tpla", 2, d_c, len(prompt), 0, address)
    return Reservation(rid, 16, 0, 0, "float32", 30.0, kv)


def test_a_joined_prefill_group_ships_what_one_process_does(model_dir: Path, start_rank) -> None:
    receivers = Receivers()
    model = load_prefill_model(model_dir, None)
    d_c = model.config.kv_lora_rank
    alone = PrefillWorker(LocalRunner(model, make_sender("grpc", "alone")))
    try:
        want = [
            alone.submit(
                PrefillJob(
                    f"one-{i}", p, GREEDY, _reservation(f"one-{i}", p, d_c, receivers.address), 30.0
                )
            ).result(timeout=60)
            for i, p in enumerate(PROMPTS)
        ]
        port, rendezvous = free_port(SERVICE_PORT_OFFSETS), free_port()
        leader = start_rank(0, rendezvous, PREFILL_PORT=str(port))
        follower = start_rank(1, rendezvous)
        follower.wait_for("prefill rank 1 of 2 joined the group")
        leader.wait_for("a group of 2 ranks")

        async def run() -> list:
            client = PrefillClient(f"127.0.0.1:{port}")
            return [
                await client.prefill(
                    f"two-{i}", p, GREEDY, _reservation(f"two-{i}", p, d_c, receivers.address)
                )
                for i, p in enumerate(PROMPTS)
            ]

        got = asyncio.run(run())
        for one, two in zip(want, got, strict=True):
            assert two.first_token.token_id == one.first_token.token_id
            assert two.transfer_bytes == one.transfer_bytes
        for i in range(len(PROMPTS)):
            for rank in range(2):
                torch.testing.assert_close(
                    receivers.caches[(f"two-{i}", rank)].kv, receivers.caches[(f"one-{i}", rank)].kv
                )
        os.killpg(leader.proc.pid, signal.SIGINT)
        assert leader.wait(30) == 0, leader.text()
        assert follower.wait(30) in (0, 1), follower.text()  # its leader's end, or gone
    finally:
        alone.close()
        receivers.close()


def test_a_missing_or_differing_rank_fails_start_up_naming_why(start_rank) -> None:
    lonely = free_port()
    started = time.monotonic()
    leader = start_rank(
        0, lonely, PREFILL_PORT=str(free_port(SERVICE_PORT_OFFSETS)), GROUP_JOIN_TIMEOUT_S="2"
    )
    assert leader.wait(60) == 2, leader.text()
    assert time.monotonic() - started < 60
    assert (
        f"prefill rank(s) 1 of 2 did not join the group at 127.0.0.1:{lonely} within 2 s "
        f"(TPLA_GROUP_JOIN_TIMEOUT_S); start each as `tpla prefill --rank K --group-size 2 "
        f"--group-addr 127.0.0.1:{lonely}`"
    ) in leader.text()
    rendezvous = free_port()
    leader = start_rank(0, rendezvous, PREFILL_PORT=str(free_port(SERVICE_PORT_OFFSETS)))
    follower = start_rank(1, rendezvous, PREFIX_CACHE_MB="8")
    difference = (
        "its config differs from the leader's: TPLA_PREFIX_CACHE / TPLA_PREFIX_CACHE_MB: "
        "8 here, 16 on the leader"
    )
    assert follower.wait(60) == 2, follower.text()
    assert leader.wait(30) == 2, leader.text()
    assert f"prefill rank 1: error: {difference}" in follower.text()
    assert f"prefill rank 1 could not start: {difference}" in leader.text()
    assert "Traceback" not in leader.text() + follower.text()


def test_joined_prefill_group_settings(tmp_path: Path) -> None:
    cfg = prefill_group_config(load_settings(rank=1, group_size=4, group_addr="leader:29700"))
    assert (cfg.spawned, cfg.tp, cfg.master_addr, cfg.master_port, cfg.collectives) == (
        False,
        4,
        "leader",
        29700,
        "dist",
    )
    spawned = prefill_group_config(load_settings(prefill_tp=2, prefill_dist_port=29800))
    assert (spawned.spawned, spawned.tp, spawned.master_port) == (True, 2, 29800)
    # Every rank runs the MTP layer or none does: a follower started without it is named.
    drafting = prefill_group_config(load_settings(prefill_tp=2, speculative="mtp"))
    assert drafting.mtp and not spawned.mtp
    (tmp_path / "config.json").write_text("{}")
    mine, leader = (
        identity(replace(c, model=str(tmp_path), device="cpu")) for c in (spawned, drafting)
    )
    assert mismatch(group_spec(drafting), mine, leader) == [
        "TPLA_SPECULATIVE: none or ngram here, mtp on the leader"
    ]
    with pytest.raises(ValueError, match="--group-addr"):
        prefill_group_config(load_settings(rank=1, group_size=2))
    with pytest.raises(ValueError, match="TPLA_PREFILL_TP=3"):
        prefill_group_config(load_settings(group_size=2, group_addr="h:1", prefill_tp=3))

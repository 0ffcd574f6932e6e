"""A reservation's lease is renewed by progress: a real decode group with a 2 s lease gets a
prompt's chunks over each KV transport (the prefill worker's own `Shipper`), each within the
lease of the one before but all of them together slower than it, and still decodes what a
single process generates; a prompt whose chunks stop coming loses its blocks one lease after
its last chunk landed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.kv.transfer import make_sender
from common.loading.loader import load_model
from common.loading.serving_model import load_prefill_model
from common.model.causal_lm import PrefillOutput
from common.model.generate import generate
from common.parallel import ParallelConfig
from common.runtime.ports import free_port, kv_port_offsets
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from services.prefill.shipping import ShipOrder, Shipper
from tests.tiny import save_hf

LEASE_S = 2.0
GAP_S = 0.8  # between one chunk's landing and the next one's send
CHUNK = 10  # rows per chunk: chunks begin and end inside the KV blocks of 8
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lease-model")
    save_hf("v3-noaux-yarn", path, std=0.08)
    return path


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[DecodeEngine]:
    cfg = EngineConfig(
        model=str(model_dir),
        parallel=ParallelConfig(tp=2, latent_groups=1),
        master_port=free_port(),
        kv_budget_mb=2,
        block_size=8,
        lease_seconds=LEASE_S,
        kv_port_base=free_port(kv_port_offsets(2)),
    )
    with DecodeEngine(cfg) as engine:
        yield engine


def _prefill(model_dir: Path, prompt: list[int]) -> PrefillOutput:
    model = load_prefill_model(model_dir, None)
    return model.prefill(torch.tensor(prompt), [len(prompt)])


def _ship(shipper: Shipper, order: ShipOrder, out: PrefillOutput, lo: int, hi: int) -> None:
    """Rows [lo, hi) to every decode rank, waiting until each acknowledged them."""
    for send in shipper.ship(order, out.n, out.k_pe, rows=(lo, hi)):
        assert send.result(timeout=60) > 0


def _order(engine: DecodeEngine, rid: str, prompt: list[int]) -> ShipOrder:
    res = engine.reserve(rid, len(prompt), GREEDY.max_tokens)
    return ShipOrder(rid, len(prompt), 0, res.block_size, res.targets, 30.0)


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_chunks_slower_than_the_lease_still_decode(
    engine: DecodeEngine, model_dir: Path, transport: str
) -> None:
    prompt = [5 + (11 * i + len(transport)) % 90 for i in range(4 * CHUNK)]
    out = _prefill(model_dir, prompt)
    shipper = Shipper(make_sender(transport, f"lease-{transport}"), torch.device("cpu"))
    try:
        started = time.monotonic()
        order = _order(engine, f"slow-{transport}", prompt)
        for lo in range(0, len(prompt), CHUNK):
            if lo:
                time.sleep(GAP_S)
            _ship(shipper, order, out, lo, lo + CHUNK)
        assert time.monotonic() - started > LEASE_S  # the lease alone would have expired
        assert engine.load().reserved == 1
        stream = engine.generate(order.request_id, int(out.logits[0].argmax()), GREEDY)
        tokens = [int(out.logits[0].argmax())]
        tokens += [e.token.token_id for e in stream if e.token is not None]
    finally:
        shipper.close()
    assert tokens == generate(load_model(model_dir), prompt, GREEDY).token_ids


def test_a_prompt_whose_chunks_stop_loses_its_blocks_after_the_lease(
    engine: DecodeEngine, model_dir: Path
) -> None:
    prompt = [7 + (13 * i) % 90 for i in range(4 * CHUNK)]
    out = _prefill(model_dir, prompt)
    shipper = Shipper(make_sender("grpc", "lease-stuck"), torch.device("cpu"))
    try:
        order = _order(engine, "stuck", prompt)
        time.sleep(GAP_S)
        sent = time.monotonic()  # the chunk lands, and renews the lease, after this
        _ship(shipper, order, out, 0, CHUNK)
    finally:
        shipper.close()
    assert engine.load().reserved == 1
    while engine.load().reserved:
        assert time.monotonic() - sent < LEASE_S + 10, "the stuck reservation was never freed"
        time.sleep(0.05)
    assert time.monotonic() - sent >= LEASE_S  # renewed by its chunk, then let go
    load = engine.load()
    assert (load.running, load.waiting, load.blocks_used) == (0, 0, 0)

"""A 32K-token prompt end to end on a random V3-architecture model with YaRN scaling (hidden
64, 2 layers, 4 heads): prefilled in chunks of 4096 by a real prefill worker, each chunk
shipped over gRPC as it is computed, decoded by real decode groups. TPLA at r = 2 decodes
what the TPLA-PD oracle (common/tpla/reference.py) decodes and SP what exact MLA decodes;
the references' prompt is prefilled in chunks too (common/model/chunked.py), so nothing
holds 32K x 32K scores. The SP group gets the prompt from the worker's prefix cache, filled
by the TPLA request's chunks."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from common.loading.loader import load_model
from common.model.chunked import prefill_in_chunks
from common.model.contiguous_cache import ContiguousLatentCache
from common.parallel import ParallelConfig, ParallelMode
from common.rpc.clients import DecodeClient, PrefillClient
from common.rpc.server import Lifetime
from common.runtime.ports import SERVICE_PORT_OFFSETS, free_port, kv_port_offsets
from common.sampling.params import SamplingParams
from common.tpla.reference import AttentionSpec, ReferenceModel, SequenceState, Variant
from services.decode.config import EngineConfig
from services.decode.service import serve_decode
from tests.stack import services_in_threads
from tests.tiny import YARN, save_hf

pytestmark = pytest.mark.slow

PROMPT = 32_000
CHUNK = 4096
STEPS = 4
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


def _config(model_dir: Path, parallel: ParallelConfig) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        parallel=parallel,
        master_port=free_port(),
        kv_budget_mb=16,
        block_size=16,
        kv_port_base=free_port(kv_port_offsets(parallel.tp)),
    )


@contextlib.contextmanager
def _decode_group(cfg: EngineConfig):  # type: ignore[no-untyped-def]
    """A second decode group, in a process of its own: a leader per process (its default
    torch.distributed group is the process's)."""
    spawn = multiprocessing.get_context("spawn")
    ready, stop, port = spawn.Event(), spawn.Event(), free_port(SERVICE_PORT_OFFSETS)
    proc = spawn.Process(
        target=serve_decode, args=(cfg, port, Lifetime()), kwargs={"ready": ready, "stop": stop}
    )
    proc.start()
    try:
        deadline = time.monotonic() + 300
        while not ready.wait(1):  # a group that died is reported now, not after the wait
            assert proc.is_alive(), f"the SP decode group exited ({proc.exitcode})"
            assert time.monotonic() < deadline, "the SP decode group did not start"
        yield f"127.0.0.1:{port}"
    finally:
        stop.set()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


async def _serve(decode_addr: str, prefill_addr: str, rid: str, prompt: list[int]):  # type: ignore[no-untyped-def]
    decode, prefill = DecodeClient(decode_addr), PrefillClient(prefill_addr)
    try:
        res = await decode.reserve(rid, len(prompt), STEPS, timeout=60)
        out = await prefill.prefill(rid, prompt, GREEDY, res, transport="grpc", timeout=600)
        tokens = [out.first_token.token_id]
        async for event in decode.generate(rid, out.first_token, GREEDY):
            if event.token is not None:
                tokens.append(event.token.token_id)
        return tokens, out
    finally:
        await decode.close()
        await prefill.close()


def test_a_32k_prompt_chunked_shipped_and_decoded(tmp_path: Path) -> None:
    yarn = {**YARN, "factor": 8.0, "original_max_position_embeddings": 4096}
    save_hf(
        "v3-noaux-yarn",
        tmp_path,
        std=0.08,
        num_hidden_layers=2,
        max_position_embeddings=32768,
        rope_parameters=yarn,
    )
    prompt = torch.randint(2, 160, (PROMPT,), generator=torch.Generator().manual_seed(5))
    tpla = _config(tmp_path, ParallelConfig(tp=2, latent_groups=2))
    sp = _config(
        tmp_path, ParallelConfig(tp=2, latent_groups=1, mode=ParallelMode.SP, chunk_size=256)
    )
    with (
        services_in_threads(tpla, None, ("grpc",), prefix_cache_mb=32.0, chunk_tokens=CHUNK) as svc,
        _decode_group(sp) as sp_addr,
    ):
        ids = prompt.tolist()
        got_tpla, out = asyncio.run(_serve(svc.decode, svc.prefill["grpc"], "long-tpla", ids))
        got_sp, again = asyncio.run(_serve(sp_addr, svc.prefill["grpc"], "long-sp", ids))
    assert again.cached_tokens == (PROMPT - 1) // 16 * 16  # all but the last block
    assert out.exposed_transfer_seconds < out.transfer_seconds  # 7 of 8 chunks shipped early

    model = load_model(tmp_path)
    ref = prefill_in_chunks(model.prefill, prompt, CHUNK)
    first = int(ref.logits[-1].argmax())
    # SP is exact: greedy MLA decode over the prompt's exact latents.
    cache = ContiguousLatentCache(model.config, 1, PROMPT + STEPS)
    cache.load_prefill(0, ref, 0, PROMPT)
    mla = [first]
    for pos in range(PROMPT, PROMPT + STEPS - 1):
        logits = model.decode(torch.tensor([mla[-1]]), torch.tensor([pos]), cache)[0]
        mla.append(int(logits.argmax()))
    # TPLA-PD: the same exact prompt latents, each new token sliced over r = 2 latent groups.
    oracle = ReferenceModel(model, AttentionSpec(Variant.TPLA_PD, groups=2))
    state = SequenceState(list(ref.n), list(ref.k_pe))
    pd = [first]
    for _ in range(STEPS - 1):
        pd.append(int(oracle.decode(state, pd[-1]).argmax()))
    assert got_sp == mla
    assert got_tpla == pd

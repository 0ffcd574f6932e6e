"""A decode group with MTP drafts that prefills prompts itself (TPLA r = 2, prompts in chunks
of 7): the MTP layer's latents come with the prompt's, the first step drafts from the
prefill's last hidden state, and tokens, drafts fed and kept are the remote path's."""

from __future__ import annotations

import pytest
import torch

from common.loading.serving_model import load_prefill_model, load_prefill_mtp
from common.model.mtp import prompt_own_next_ids, whole_prefill_with_mtp
from common.sampling.params import SamplingParams
from services.decode.config import SpecConfig
from services.decode.engine import DecodeEngine
from tests.integration.test_local_prefill import CHUNK, rank0_rows
from tests.shard_checkpoints import MTP_CONFIG, mtp_state, random_state, save_checkpoint
from tests.tiny_engines import TINY_LAYOUTS, tiny_engine
from tools.local_driver import collect, submit


@pytest.fixture(scope="module")
def mtp_engine(tmp_path_factory: pytest.TempPathFactory):
    main = random_state()
    path = save_checkpoint(
        {**main, **mtp_state(main, "equal")}, tmp_path_factory.mktemp("mtp"), **MTP_CONFIG
    )
    spec = SpecConfig("mtp", tokens=2, max_batch=4)
    with tiny_engine(
        path,
        TINY_LAYOUTS["tpla"],
        (1,),
        kv_budget_mb=4,
        speculative=spec,
        local_prefill_chunk_tokens=CHUNK,
    ) as eng:
        yield eng


def test_mtp_latents_and_first_drafts(mtp_engine: DecodeEngine) -> None:
    """The MTP layer's latents come with the prompt's (its chunks' last rows read the next
    prompt token), and the first step drafts from the prefill's last hidden state: tokens,
    drafts fed and kept are the remote path's."""
    engine = mtp_engine
    prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
    mtp = load_prefill_mtp(engine.cfg.model, engine.cfg.reparam, prefill)
    prompt = list(range(40, 60))
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    [(first, stream)] = submit(engine, prefill, [prompt], [p], mtp)
    remote = collect(first, stream)
    engine.reserve("mtp", len(prompt), p.max_tokens, prompt_ids=prompt)
    result = engine.prefill("mtp", prompt, p).result(60)
    ids = torch.tensor(prompt)
    out = whole_prefill_with_mtp(prefill, mtp, ids, [len(prompt)], prompt_own_next_ids(ids, [20]))
    positions, rows = rank0_rows(engine, "mtp", 0, len(prompt))
    cols = engine.cfg.parallel.latent_columns(0, prefill.config.kv_lora_rank)
    expected = torch.cat((torch.stack(out.n)[..., cols], torch.stack(out.k_pe)), dim=-1)
    torch.testing.assert_close(rows, expected[:, positions], atol=2e-5, rtol=0)
    assert len(result.hidden) == prefill.config.hidden_size
    stream = engine.generate("mtp", result.first_token.token_id, p, hidden=result.hidden)
    local = collect(result.first_token, stream)
    assert local.token_ids == remote.token_ids
    drafts = [(e.drafted, e.accepted) for e in local.events]
    assert drafts == [(e.drafted, e.accepted) for e in remote.events]
    assert sum(d for d, _ in drafts) > 0

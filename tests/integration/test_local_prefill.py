"""A decode group that prefills prompts itself (services/decode/leader/local_prefill.py), in
real multi-process rank groups in every layout (TPLA r = 2, MLA-TP, SP), prompts in chunks
of 7 tokens: the latents it writes are the prefill worker's (rank 0's cache against the
whole model's prefill, within fp32 rounding), with and without a prefix-cache hit, and every
request (greedy, seeded n > 1, structured, speculative, scored) samples the tokens the
remote path samples: the prefill model's prompt KV written in process, its first tokens
by the same rule. With MTP drafts: test_local_prefill_mtp.py."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from torch import Tensor

from common.loading.serving_model import load_prefill_model
from common.model.causal_lm import DeepseekForCausalLM
from common.sampling.first_token import sample_first
from common.sampling.grammar import GrammarSpec
from common.sampling.params import SamplingParams
from common.sampling.prompt_logprobs import prompt_logprobs
from services.decode.config import SpecConfig
from services.decode.engine import DecodeEngine
from tests.tiny import save_tiny_chat_model
from tests.tiny_engines import TINY_LAYOUTS, tiny_engine
from tools.local_driver import write_prompt

CHUNK = 7
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("local-prefill"), std=0.08)


@pytest.fixture(scope="module", params=list(TINY_LAYOUTS))
def engine(request: pytest.FixtureRequest, model_dir: Path):
    parallel = TINY_LAYOUTS[request.param]
    with tiny_engine(
        model_dir, parallel, record_logits=True, local_prefill_chunk_tokens=CHUNK
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def prefill(engine: DecodeEngine) -> DeepseekForCausalLM:
    return load_prefill_model(engine.cfg.model, engine.cfg.reparam)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _stream(
    engine: DecodeEngine, rid: str, firsts: list[int], p: SamplingParams
) -> list[list[int]]:
    """Every choice's tokens, its first included."""
    tokens = [[t] for t in firsts]
    for event in engine.generate(rid, firsts, p):
        if event.token is not None:
            tokens[event.index].append(event.token.token_id)
    return tokens


def _remote(
    engine: DecodeEngine,
    prefill: DeepseekForCausalLM,
    prompt: list[int],
    p: SamplingParams,
    n: int = 1,
) -> list[list[int]]:
    """The remote path in process: the prefill model's KV written into the reservation, the
    first tokens sampled by the prefill worker's rule."""
    rid = uuid.uuid4().hex
    reservation = engine.reserve(rid, len(prompt), p.max_tokens, n=n)
    out = prefill.prefill(torch.tensor(prompt), [len(prompt)])
    write_prompt(engine, reservation, out, 0, len(prompt))
    matcher = engine.controls.matcher(p, [])
    firsts = sample_first(out.logits[0], p, prompt, 0, matcher, n, engine.eos_token_ids)
    return _stream(engine, rid, [t.token_id for t in firsts], p)


def _local(
    engine: DecodeEngine, prompt: list[int], p: SamplingParams, n: int = 1
) -> list[list[int]]:
    rid = uuid.uuid4().hex
    engine.reserve(rid, len(prompt), p.max_tokens, prompt_ids=prompt, n=n)
    result = engine.prefill(rid, prompt, p, n=n).result(60)
    return _stream(engine, rid, [t.token_id for t in result.first_tokens], p)


def rank0_rows(engine: DecodeEngine, rid: str, start: int, end: int) -> tuple[Tensor, Tensor]:
    """The positions in [start, end) that rank 0 caches, and their rows there [L, N, w + d_r]."""
    runtime, bs = engine.runtime, engine.cfg.block_size
    table = torch.tensor(engine.pool.tables(rid)[0])
    positions = torch.arange(start, end)
    trash = runtime.cache.trash_slot
    slots = runtime.model.split.write_slots(positions, table.expand(end - start, -1), bs, trash)
    kept = slots != trash
    return positions[kept], runtime.cache.kv[:, slots[kept]]


def _assert_prefill_workers_latents(
    engine: DecodeEngine, prefill: DeepseekForCausalLM, rid: str, prompt: list[int], cached: int
) -> None:
    out = prefill.prefill(torch.tensor(prompt), [len(prompt)])
    positions, rows = rank0_rows(engine, rid, cached, len(prompt))
    assert len(positions) > 0
    cols = engine.cfg.parallel.latent_columns(0, prefill.config.kv_lora_rank)
    n = torch.stack(out.n)[:, positions][..., cols]
    k_pe = torch.stack(out.k_pe)[:, positions]
    torch.testing.assert_close(rows, torch.cat((n, k_pe), dim=-1), atol=2e-5, rtol=0)


def test_latents_and_tokens_equal_the_prefill_workers(
    engine: DecodeEngine, prefill: DeepseekForCausalLM
) -> None:
    prompt = _prompt(23, 0)  # four chunks of 7
    rid = "whole"
    engine.reserve(rid, len(prompt), GREEDY.max_tokens, prompt_ids=prompt)
    result = engine.prefill(rid, prompt, GREEDY).result(60)
    assert result.cached_tokens == 0 and result.transfer_bytes == 0
    _assert_prefill_workers_latents(engine, prefill, rid, prompt, 0)
    local = _stream(engine, rid, [result.first_token.token_id], GREEDY)
    assert local == _remote(engine, prefill, prompt, GREEDY)

    # The finished prompt's full blocks are cached: a prompt sharing its first 16 tokens
    # prefills only after them, over the cached latents gathered from every rank.
    other = prompt[:16] + _prompt(9, 1)
    engine.reserve("hit", len(other), GREEDY.max_tokens, prompt_ids=other)
    hit = engine.prefill("hit", other, GREEDY).result(60)
    assert hit.cached_tokens == 16
    _assert_prefill_workers_latents(engine, prefill, "hit", other, 16)
    assert _stream(engine, "hit", [hit.first_token.token_id], GREEDY) == _remote(
        engine, prefill, other, GREEDY
    )
    # Held whole (16 tokens: four cached blocks): its last token is computed again for its
    # logits, and the shared blocks keep their latents.
    held = prompt[:16]
    engine.reserve("held", 16, GREEDY.max_tokens, prompt_ids=held)
    _, before = rank0_rows(engine, "held", 0, 16)
    again = engine.prefill("held", held, GREEDY).result(60)
    assert again.cached_tokens == 16 and torch.equal(rank0_rows(engine, "held", 0, 16)[1], before)
    local = _stream(engine, "held", [again.first_token.token_id], GREEDY)
    assert local == _remote(engine, prefill, held, GREEDY)
    load = engine.load()
    assert (load.running, load.reserved, load.blocks_used) == (0, 0, 0)


def test_choices_grammars_speculation_and_logprobs(
    engine: DecodeEngine, prefill: DeepseekForCausalLM
) -> None:
    prompt = _prompt(19, 2)
    seeded = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    assert _local(engine, prompt, seeded, n=3) == _remote(engine, prefill, prompt, seeded, n=3)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    structured = SamplingParams(
        max_tokens=12, temperature=0.0, grammar=GrammarSpec.json_schema(schema)
    )
    assert _local(engine, prompt, structured) == _remote(engine, prefill, prompt, structured)
    engine.speculate(SpecConfig("ngram", tokens=3, max_batch=4))
    try:
        repeating = prompt[:6] * 4
        assert _local(engine, repeating, GREEDY) == _remote(engine, prefill, repeating, GREEDY)
    finally:
        engine.speculate(SpecConfig())
    # Scored: every prompt position's logprob, its cached prefix's too (it runs whole).
    engine.reserve("scored", len(prompt), 1, prompt_ids=prompt)
    scored = engine.prefill("scored", prompt, GREEDY, prompt_logprobs=2).result(60)
    assert scored.cached_tokens == 16  # the choices' prompt, cached when they finished
    engine.abort("scored")
    out = prefill.prefill(torch.tensor(prompt), [len(prompt)], all_logits=True)
    expected = prompt_logprobs(out.logits[:-1], prompt, 2)
    assert [t.token_id for t in scored.prompt_logprobs] == [t.token_id for t in expected]
    got = torch.tensor([t.logprob for t in scored.prompt_logprobs])
    torch.testing.assert_close(got, torch.tensor([t.logprob for t in expected]), atol=1e-4, rtol=0)
    load = engine.load()
    assert (load.running, load.reserved, load.blocks_used) == (0, 0, 0)


def test_dropped_when_its_reservation_ends(engine: DecodeEngine) -> None:
    prompt = _prompt(40, 3)
    engine.reserve("gone", len(prompt), 4, prompt_ids=prompt)
    engine.abort("gone")
    with pytest.raises(ValueError, match="no open reservation"):
        engine.prefill("gone", prompt, GREEDY)
    engine.reserve("short", len(prompt), 4, prompt_ids=prompt)
    with pytest.raises(ValueError, match="reserved 40 prompt tokens"):
        engine.prefill("short", prompt[:-1], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.prefill("short", [*prompt[:-1], 10**6], GREEDY)
    engine.abort("short")
    assert engine.load().blocks_used == 0

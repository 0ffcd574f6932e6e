"""A local PD pipeline in one process tree: exact MLA prefill here, TPLA decode in a rank
group's engine.

The shape of what the services do over the network: prefill the prompts exactly, sample each
first token, cut the latent cache into per-rank shards, write them into reserved blocks, then
stream the rest from the engine. `tpla generate --tp G`, benchmarks and tests drive an engine
with it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.kv.index_shards import cut_index_chunk
from common.kv.transfer import cut_shard
from common.messages import Reservation, TokenEvent
from common.model.causal_lm import DeepseekForCausalLM, PrefillOutput
from common.model.mtp import MTPLayer, prompt_own_next_ids, whole_prefill_with_mtp
from common.sampling.first_token import sample_first
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken
from services.decode.engine import DecodeEngine
from services.decode.local_kv import write_kv
from services.decode.stream import TokenStream


@dataclass(frozen=True)
class LocalResult:
    token_ids: list[int]
    finish_reason: str
    events: list[TokenEvent]


def submit(
    engine: DecodeEngine,
    prefill: DeepseekForCausalLM,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    mtp: MTPLayer | None = None,
) -> list[tuple[SampledToken, TokenStream]]:
    """Prefill a batch of prompts and start their decode; returns (first token, stream) each.
    With `mtp` (the engine's ranks hold the MTP module), its latents over the prompts go to
    the ranks as one more layer and each prompt's last hidden state seeds the drafts."""
    device = prefill.lm_head.weight.device
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    if mtp is None:
        out = prefill.prefill(ids, lens)
    else:  # as the prefill worker does (services/prefill/runner.py)
        out = whole_prefill_with_mtp(prefill, mtp, ids, lens, prompt_own_next_ids(ids, lens))
    firsts = []
    for row, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        # The prefill worker's rule for a first token: thinking first, then the grammar.
        matcher = engine.controls.matcher(p, [])
        [first] = sample_first(out.logits[row], p, prompt, 0, matcher, 1, engine.eos_token_ids)
        firsts.append(first)
    started = []
    start = 0
    for prompt, p, first in zip(prompts, params, firsts, strict=True):
        rid = uuid.uuid4().hex
        reservation = engine.reserve(rid, len(prompt), p.max_tokens)
        write_prompt(engine, reservation, out, start, start + len(prompt))
        assert out.hidden is not None
        hidden = out.hidden[start + len(prompt) - 1] if mtp is not None else None
        stream = engine.generate(rid, first.token_id, p, prompt, hidden=hidden)
        started.append((first, stream))
        start += len(prompt)
    return started


def write_prompt(
    engine: DecodeEngine, reservation: Reservation, out: PrefillOutput, start: int, end: int
) -> None:
    """Every rank's shard of a reserved prompt, rows [start, end) of a (packed) prefill's
    latents, written in process: what a prefill worker ships to the ranks over the network."""
    rid, bs = reservation.request_id, reservation.block_size
    sparse = engine.runtime.model.sparse  # DSA: the indexer keys go with the latents
    for target in reservation.targets:
        shard = cut_shard(out.n, out.k_pe, start, end, target, rid, bs)
        keys = None
        if sparse is not None and sparse.format is not None:
            prompt = [k[start:end] for k in out.index_keys]
            keys = cut_index_chunk(prompt, 0, end - start, target, rid, bs, sparse.format).kv
        write_kv(engine, rid, target.rank, shard.n, shard.k_pe, keys)


def collect(first: SampledToken, stream: TokenStream) -> LocalResult:
    events = list(stream)
    tokens = [first.token_id] + [e.token.token_id for e in events if e.token is not None]
    return LocalResult(tokens, events[-1].finish_reason or "", events)

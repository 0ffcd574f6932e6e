"""A local PD pipeline in one process tree: exact MLA prefill here, TPLA decode in the group.

This is what `tpla generate --tp G` runs, and the shape of what the services do over the
network: prefill the prompts exactly, sample each first token, cut the latent cache into
per-rank shards, write them into reserved blocks, then stream the rest from the engine.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.generate import Generation
from common.model.model import DeepseekForCausalLM, PrefillOutput
from common.sampling import SampledToken, SamplingParams, make_generator, sample
from common.serving_model import load_serving_model, side_file_path
from services.decode.engine import DecodeEngine, TokenEvent, TokenStream
from services.decode.rank_model import rank_latent_columns
from services.decode.runtime import EngineConfig


@dataclass(frozen=True)
class LocalResult:
    token_ids: list[int]
    finish_reason: str
    events: list[TokenEvent]


def load_prefill_model(cfg: EngineConfig) -> DeepseekForCausalLM:
    """The exact prefill model, in the same (possibly rotated) latent basis as the ranks."""
    return load_serving_model(cfg.model, cfg.reparam, cfg.dtype)[0]


def shard_prefill(
    out: PrefillOutput, start: int, end: int, engine: DecodeEngine, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s layer-major shard of one prompt's latents: n[S_i] [L, N, w], k_pe."""
    cols = rank_latent_columns(engine.cfg.parallel, rank, out.n[0].shape[-1])
    n = torch.stack([layer[start:end, cols] for layer in out.n])
    k_pe = torch.stack([layer[start:end] for layer in out.k_pe])
    return n, k_pe


def submit(
    engine: DecodeEngine,
    prefill: DeepseekForCausalLM,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
) -> list[tuple[SampledToken, TokenStream]]:
    """Prefill a batch of prompts and start their decode; returns (first token, stream) each."""
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    out = prefill.prefill(ids, [len(p) for p in prompts])
    started = []
    start = 0
    for row, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        rid = uuid.uuid4().hex
        engine.reserve(rid, len(prompt), p.max_tokens)
        for rank in range(engine.cfg.parallel.tp):
            engine.write_kv(
                rid, rank, *shard_prefill(out, start, start + len(prompt), engine, rank)
            )
        first = sample(out.logits[row], p, make_generator(p, stream=0))
        started.append((first, engine.generate(rid, first.token_id, p)))
        start += len(prompt)
    return started


def collect(first: SampledToken, stream: TokenStream) -> LocalResult:
    events = list(stream)
    tokens = [first.token_id] + [e.token.token_id for e in events if e.token is not None]
    return LocalResult(tokens, events[-1].finish_reason or "", events)


def generate_distributed(
    model_dir: str,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_ids: Sequence[int],
    args: argparse.Namespace,
) -> Generation:
    """`tpla generate --tp G --latent-groups R`: exact prefill here, decode in a rank group."""
    from common.model.tpla import RmsNormMode
    from services.decode.rank_model import ParallelConfig

    r = args.latent_groups if args.mode in (None, "tpla") else 1
    reparam = None
    if r > 1 and args.method != "identity":
        side = side_file_path(model_dir, f"tpla_{args.method}")
        if side.exists():
            reparam = side.stem
        else:
            print(
                f"note: no {side.name} in {model_dir}; TPLA uses the identity basis with e_i = 1/r",
                file=sys.stderr,
            )
    cfg = EngineConfig(
        model=model_dir,
        parallel=ParallelConfig(tp=args.tp, latent_groups=r, rmsnorm=RmsNormMode(args.rmsnorm)),
        reparam=reparam,
        master_port=0,
        torch_threads=args.threads or 1,
        max_model_len=len(prompt_ids) + params.max_tokens,
    )
    with DecodeEngine(cfg, eos_token_ids=tuple(eos_ids)) as engine:
        prefill = load_prefill_model(cfg)
        [(first, stream)] = submit(engine, prefill, [prompt_ids], [params])
        result = collect(first, stream)
    tokens = [first] + [e.token for e in result.events if e.token is not None]
    return Generation(result.token_ids, tokens, result.finish_reason)

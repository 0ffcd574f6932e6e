"""The DSA demo's measurements: each layer's dense attention distribution (the indexers'
training target, tools/demo/train_dsa.py) and how the exported model's sparse attention
agrees with its own dense attention (the same weights, index_topk above the context).

- greedy agreement at 512- and 2048-token prompts from the held-out split: the share of
  continuations that are the same token for token, and the share of positions whose greedy
  token agrees when both read the dense model's continuation (teacher-forced);
- perplexity over 2048-token held-out windows, sparse and dense;
- the fp8 index keys (`TPLA_INDEX_CACHE_DTYPE=fp8`): the overlap of each query's top-k with
  the one the model-dtype keys give, and the greedy tokens of the decode engine keeping its
  keys in fp8 against keeping them in the model's dtype.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from common.model.causal_lm import DeepseekForCausalLM
from common.model.generate import generate
from common.model.index_keys import key_format
from common.model.indexer import index_scores
from common.model.mla import MLAttention
from common.model.topk import topk_mask
from common.sampling.params import SamplingParams

LENGTHS = (512, 2048)
PROMPTS = 8
NEW_TOKENS = 32

Target = tuple[
    MLAttention, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor
]


@torch.no_grad()
def layer_targets(model: DeepseekForCausalLM, ids: torch.Tensor) -> list[Target]:
    """One window [T] through the model with dense attention: per full layer its attention,
    normalized input x [T, D], q-LoRA output, (cos, sin) and the dense attention's
    distribution over each query's past [T, T] (the heads' summed, L1-normalized)."""
    t = ids.shape[0]
    cos, sin = model.rope.cos_sin(torch.arange(t))
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    h = model.embed(ids)
    out: list[Target] = []
    for layer in model.decoder_layers():
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q_latent = attn.q_latent(x)
        q_nope, q_pe = attn.queries(x, model.rope, cos, sin, q_latent)
        n, k_pe = attn.latents(x, model.rope, cos, sin)
        q_lat = attn.absorb_query(q_nope)
        s = torch.einsum("thc,sc->hts", q_lat, n) + torch.einsum("thr,sr->hts", q_pe, k_pe)
        p = (s * attn.scale).masked_fill(~causal, -torch.inf).softmax(-1)
        target = p.sum(0)
        if attn.indexer is not None:
            out.append((attn, x, q_latent, (cos, sin), target / target.sum(-1, keepdim=True)))
        o = torch.einsum("thc,hvc->thv", torch.einsum("hts,sc->thc", p, n), attn.w_uv())
        h = h + attn.output(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return out


def dense_twin(model: DeepseekForCausalLM) -> DeepseekForCausalLM:
    """The same weights with index_topk above any context: the model's dense attention."""
    dsa = model.config.dsa
    assert dsa is not None
    dense = dataclasses.replace(dsa, index_topk=model.config.max_position_embeddings)
    twin = DeepseekForCausalLM(dataclasses.replace(model.config, dsa=dense))
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def _prompts(stream: torch.Tensor, length: int, count: int = PROMPTS) -> list[list[int]]:
    step = (len(stream) - length - 1) // count
    return [stream[i * step : i * step + length].tolist() for i in range(count)]


def greedy_agreement(
    sparse: DeepseekForCausalLM, dense: DeepseekForCausalLM, stream: torch.Tensor, count: int
) -> dict[str, Any]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    for length in LENGTHS:
        same, agree, total = 0, 0, 0
        for prompt in _prompts(stream, length, count):
            want = generate(dense, prompt, params).token_ids
            got = generate(sparse, prompt, params).token_ids
            same += got == want
            ids = torch.tensor(prompt + want[:-1])
            rows = slice(length - 1, None)
            a = sparse.prefill(ids, [len(ids)], all_logits=True).logits[rows].argmax(-1)
            b = dense.prefill(ids, [len(ids)], all_logits=True).logits[rows].argmax(-1)
            agree += int((a == b).sum())
            total += len(want)
        out[str(length)] = {
            "identical_continuations": same / count,
            "token_agreement": agree / total,
        }
    return out


def perplexity(model: DeepseekForCausalLM, stream: torch.Tensor, windows: int = 4) -> float:
    nll, count = 0.0, 0
    for ids in _prompts(stream, 2049)[:windows]:
        window = torch.tensor(ids)
        logits = model.prefill(window[:-1], [2048], all_logits=True).logits
        nll += float(F.cross_entropy(logits.float(), window[1:], reduction="sum"))
        count += 2048
    return math.exp(nll / count)


def fp8_topk_overlap(model: DeepseekForCausalLM, stream: torch.Tensor) -> float:
    """The mean share of a query's top-k (k = index_topk) the fp8 keys keep, over the queries
    of a 2048-token window that have more than k tokens, every full layer."""
    dsa = model.config.dsa
    assert dsa is not None
    k = dsa.index_topk
    fmt = key_format("fp8", dsa.index_head_dim, torch.float32)
    window = torch.tensor(_prompts(stream, 2048)[0])
    shares = []
    for attn, x, q_latent, (cos, sin), _ in layer_targets(model, window):
        indexer = attn.indexer
        assert indexer is not None
        q, keys, w = (
            indexer.queries(q_latent, cos, sin),
            indexer.keys(x, cos, sin),
            indexer.head_weights(x),
        )
        valid = torch.ones(len(x), len(x), dtype=torch.bool).tril()
        exact = topk_mask(index_scores(q, w, keys, indexer.scale), valid, k)
        rows = fmt.encode(keys)
        fp8 = topk_mask(index_scores(fmt.queries(q), w, rows, indexer.scale, fmt.decode), valid, k)
        shares.append(((exact & fp8).sum(-1)[k:].float() / k).mean())
    return float(torch.stack(shares).mean())


def fp8_engine_agreement(model_dir: Path, stream: torch.Tensor, count: int) -> dict[str, float]:
    """The decode engine (tp = 1) with its keys in fp8 against the model's dtype: the share
    of identical greedy continuations per prompt length."""
    from common.loading.serving_model import load_prefill_model
    from common.parallel import ParallelConfig
    from services.decode.config import EngineConfig
    from services.decode.engine import DecodeEngine
    from tools.local_driver import collect, submit

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[list[int]]] = {}
    for fmt in ("model", "fp8"):
        cfg = EngineConfig(
            model=str(model_dir),
            parallel=ParallelConfig(),
            master_port=0,
            kv_budget_mb=256,
            index_cache_dtype=fmt,
        )
        with DecodeEngine(cfg) as engine:
            prefill = load_prefill_model(cfg.model, None)
            tokens[fmt] = [
                collect(*submit(engine, prefill, [p], [params])[0]).token_ids
                for length in LENGTHS
                for p in _prompts(stream, length, count)
            ]
    same = [a == b for a, b in zip(tokens["model"], tokens["fp8"], strict=True)]
    return {
        str(length): sum(same[i * count : (i + 1) * count]) / count
        for i, length in enumerate(LENGTHS)
    }


def agreement_report(model_dir: Path, stream: torch.Tensor, count: int = PROMPTS) -> dict[str, Any]:
    from common.loading.loader import load_model

    sparse = load_model(model_dir)
    dense = dense_twin(sparse)
    with torch.inference_mode():
        greedy = greedy_agreement(sparse, dense, stream, count)
        ppl = {"sparse": perplexity(sparse, stream), "dense": perplexity(dense, stream)}
    with torch.no_grad():
        overlap = fp8_topk_overlap(sparse, stream)
    return {
        "greedy": greedy,
        "perplexity_2048": ppl,
        "fp8_topk_overlap": overlap,
        "fp8_engine_identical_continuations": fp8_engine_agreement(model_dir, stream, count),
        "prompts_per_length": count,
    }


def write_card(out: Path, report: dict[str, Any]) -> None:
    """The model card: what the model is, how it was made and what it measured."""
    from tools.demo.dsa_card import dsa_card

    (out / "README.md").write_text(dsa_card(report, json.loads((out / "config.json").read_text())))

"""DeepSeek-V3's MTP module: the prefill and decode forms against a plain reference written
here, each other, `past`, and chained drafts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from common.model.args import ModelConfig
from common.model.causal_lm import DeepseekForCausalLM, PastLatents
from common.model.contiguous_cache import ContiguousLatentCache
from common.model.mtp import (
    MTPLayer,
    MTPStack,
    mtp_decode,
    mtp_draft,
    mtp_latents,
    mtp_layer_index,
    mtp_prefill,
)
from common.model.prefill_attention import SdpaPrefillAttention
from tests.tiny import BASE, VARIANTS

DTYPE = torch.float64
# float64 throughout but the rotary embedding and the MoE router, which run in float32.
ATOL = 2e-6


def _config(variant: str, layers: int = 1) -> ModelConfig:
    _, overrides = VARIANTS[variant]
    raw = {**BASE, **overrides, "model_type": "deepseek_v3", "num_nextn_predict_layers": layers}
    return ModelConfig.from_hf_dict(raw)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)


@pytest.fixture(scope="module", params=["v3-noaux-yarn", "v2-greedy"])
def models(request: pytest.FixtureRequest) -> tuple[DeepseekForCausalLM, list[MTPLayer]]:
    config = _config(request.param, layers=2)
    main = DeepseekForCausalLM(config).to(DTYPE).eval().requires_grad_(False)
    _randomize(main, 0)
    layers = []
    for k in range(2):
        layer = MTPLayer(config, mtp_layer_index(config, k)).to(DTYPE).eval()
        layer.requires_grad_(False)
        _randomize(layer, k + 1)
        layers.append(layer)
    return main, layers


def _reference(
    main: DeepseekForCausalLM, layer: MTPLayer, next_ids: Tensor, hidden: Tensor, start: int = 0
) -> tuple[Tensor, Tensor]:
    """One sequence, written out: fuse, plain causal softmax attention over the expanded
    heads at positions start.., the FFN, the head. -> (logits [T, V], hidden [T, D])."""
    c, attn = main.config, layer.self_attn
    rms = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)  # noqa: E731
    e = rms(layer.embed_tokens.weight[next_ids], layer.enorm.weight)
    x = torch.cat([e, rms(hidden, layer.hnorm.weight)], -1) @ layer.eh_proj.weight.T
    t = x.shape[0]
    cos, sin = main.rope.cos_sin(torch.arange(start, start + t))
    a = layer.input_layernorm(x)
    q_nope, q_pe = attn.queries(a, main.rope, cos, sin)
    n, k_pe = attn.latents(a, main.rope, cos, sin)
    kv = (n @ attn.kv_b_proj.weight.T).view(t, c.num_attention_heads, -1)
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], -1)
    scores = torch.einsum("thd,shd->hts", q_nope, k_nope) + torch.einsum("thd,sd->hts", q_pe, k_pe)
    scores = scores * c.softmax_scale
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
    h = x + o.reshape(t, -1) @ attn.o_proj.weight.T
    h = h + layer.mlp(rms(h, layer.post_attention_layernorm.weight))
    return rms(h, layer.shared_head.norm.weight) @ layer.shared_head.head.weight.T, h


def _prompt(main: DeepseekForCausalLM, length: int, seed: int) -> tuple[Tensor, Tensor]:
    """Token ids [length + 1] and the main model's hidden states [length, D] at 0..length-1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, main.config.vocab_size, (length + 1,), generator=gen)
    out = main.prefill(ids[:length], [length], all_logits=True)
    assert out.hidden is not None
    return ids, out.hidden


def test_the_hidden_state_is_the_last_layer_before_the_final_norm(models) -> None:
    main, _ = models
    ids, hidden = _prompt(main, 9, 0)
    logits = main.prefill(ids[:9], [9], all_logits=True).logits
    torch.testing.assert_close(main.logits(hidden), logits, rtol=0, atol=1e-12)
    # Every row, also when only the last row's logits are asked for.
    last = main.prefill(ids[:9], [9])
    assert last.hidden is not None and last.logits.shape[0] == 1
    torch.testing.assert_close(last.hidden, hidden, rtol=0, atol=1e-12)


@pytest.mark.parametrize("absorbed", [False, True])
def test_prefill_matches_the_reference_packed(models, absorbed: bool) -> None:
    main, layers = models
    layer = layers[0]
    prompts = [_prompt(main, length, seed) for seed, length in enumerate((7, 1, 12))]
    next_ids = torch.cat([ids[1:] for ids, _ in prompts])
    hidden = torch.cat([h for _, h in prompts])
    lens = [len(h) for _, h in prompts]
    out = mtp_prefill(layer, main.rope, next_ids, hidden, lens, all_logits=True, absorbed=absorbed)
    refs = [_reference(main, layer, ids[1:], h) for ids, h in prompts]
    torch.testing.assert_close(out.logits, torch.cat([r[0] for r in refs]), rtol=0, atol=ATOL)
    torch.testing.assert_close(out.hidden, torch.cat([r[1] for r in refs]), rtol=0, atol=ATOL)
    last = mtp_prefill(layer, main.rope, next_ids, hidden, lens, absorbed=absorbed)
    ends = torch.tensor(lens).cumsum(0) - 1
    torch.testing.assert_close(last.logits, out.logits[ends], rtol=0, atol=1e-12)
    torch.testing.assert_close(last.hidden, out.hidden[ends], rtol=0, atol=1e-12)
    assert out.n.shape == (sum(lens), main.config.kv_lora_rank)


def test_the_latents_alone_equal_the_whole_layer_pass_bit_for_bit(models) -> None:
    """What a serving prefill computes of the MTP layer (its latents, from its input alone)
    against the whole layer's pass: packed prompts, then prompts continuing a cached prefix."""
    main, layers = models
    layer = layers[0]
    (a, ha), (b, hb) = _prompt(main, 11, 4), _prompt(main, 6, 5)
    next_ids, hidden, lens = torch.cat([a[1:], b[1:]]), torch.cat([ha, hb]), [11, 6]
    stack = MTPStack(layer, hidden, main.rope, SdpaPrefillAttention())
    whole = mtp_prefill(layer, main.rope, next_ids, hidden, lens)
    n, k_pe, _ = mtp_latents(stack, next_ids, lens)
    assert torch.equal(n, whole.n) and torch.equal(k_pe, whole.k_pe)
    # Continuing cached prefixes of 5 and 2 positions: the rows' positions start after them.
    pasts = [
        PastLatents([whole.n[:5]], [whole.k_pe[:5]]),
        None,
        PastLatents([n[11:13]], [k_pe[11:13]]),
    ]
    rows = torch.cat([torch.arange(5, 11), torch.arange(11, 17), torch.arange(13, 17)])
    tail = MTPStack(layer, hidden[rows], main.rope, SdpaPrefillAttention())
    want = mtp_prefill(layer, main.rope, next_ids[rows], hidden[rows], [6, 6, 4], past=pasts)
    n, k_pe, _ = mtp_latents(tail, next_ids[rows], [6, 6, 4], pasts)
    assert torch.equal(n, want.n) and torch.equal(k_pe, want.k_pe)
    torch.testing.assert_close(k_pe, whole.k_pe[rows], rtol=0, atol=1e-12)


def test_decode_over_the_prefill_latents_matches_prefill(models) -> None:
    main, layers = models
    layer = layers[0]
    ids, hidden = _prompt(main, 10, 3)
    whole = mtp_prefill(layer, main.rope, ids[1:], hidden, [10], all_logits=True)
    one_layer = dataclasses.replace(main.config, num_hidden_layers=1)
    cache = ContiguousLatentCache(one_layer, 1, 16, DTYPE)
    # The first 6 positions by prefill, the rest one token at a time.
    head = mtp_prefill(layer, main.rope, ids[1:7], hidden[:6], [6])
    cache.n[0, 0, :6], cache.k_pe[0, 0, :6] = head.n, head.k_pe
    for t in range(6, 10):
        step = mtp_decode(
            layer, main.rope, ids[t + 1 : t + 2], hidden[t : t + 1], torch.tensor([t]), cache
        )
        torch.testing.assert_close(step.logits[0], whole.logits[t], rtol=0, atol=ATOL)
        torch.testing.assert_close(step.hidden[0], whole.hidden[t], rtol=0, atol=ATOL)
        torch.testing.assert_close(step.n[0], whole.n[t], rtol=0, atol=1e-12)
    # With a past: the last 4 positions continue the cached 6.
    past = PastLatents([head.n], [head.k_pe])
    tail = mtp_prefill(layer, main.rope, ids[7:11], hidden[6:], [4], all_logits=True, past=[past])
    torch.testing.assert_close(tail.logits, whole.logits[6:], rtol=0, atol=ATOL)


def _caches(main: DeepseekForCausalLM, prefixes: list) -> list[ContiguousLatentCache]:
    one_layer = dataclasses.replace(main.config, num_hidden_layers=1)
    caches = []
    for out in prefixes:
        cache = ContiguousLatentCache(one_layer, 1, 16, DTYPE)
        cache.n[0, 0, : len(out.n)], cache.k_pe[0, 0, : len(out.n)] = out.n, out.k_pe
        caches.append(cache)
    return caches


def test_one_module_chains_at_the_next_positions(models) -> None:
    main, layers = models
    layer = layers[0]
    ids, hidden = _prompt(main, 8, 5)
    caches = _caches(main, [mtp_prefill(layer, main.rope, ids[1:8], hidden[:7], [7])])
    drafts = mtp_draft([layer], main.rope, ids[8:9], hidden[7:8], torch.tensor([7]), caches, 2)
    logits, h = _reference(main, layer, ids[1:9], hidden)
    first = logits[7].argmax()
    # Position 8 reads the module's own hidden state at 7 and its draft.
    logits, _ = _reference(
        main, layer, torch.cat([ids[1:9], first[None]]), torch.cat([hidden, h[7:8]])
    )
    assert drafts.tolist() == [[int(first), int(logits[8].argmax())]]


def test_two_modules_chain_at_the_same_position_then_the_last_repeats(models) -> None:
    main, layers = models
    ids, hidden = _prompt(main, 8, 6)
    logits0, h0 = _reference(main, layers[0], ids[1:9], hidden)
    # Module 1's cache over the prompt: (module 0's hidden at i, token i+2).
    prefixes = [
        mtp_prefill(layers[0], main.rope, ids[1:8], hidden[:7], [7]),
        mtp_prefill(layers[1], main.rope, ids[2:9], h0[:7], [7]),
    ]
    caches = _caches(main, prefixes)
    drafts = mtp_draft(layers, main.rope, ids[8:9], hidden[7:8], torch.tensor([7]), caches, 3)
    first = logits0[7].argmax()
    next_1 = torch.cat([ids[2:9], first[None]])
    logits1, h1 = _reference(main, layers[1], next_1, h0)
    second = logits1[7].argmax()
    logits2, _ = _reference(
        main, layers[1], torch.cat([next_1, second[None]]), torch.cat([h0, h1[7:8]])
    )
    assert drafts.tolist() == [[int(first), int(second), int(logits2[8].argmax())]]


def test_fuse_puts_the_embedding_half_first(models) -> None:
    main, layers = models
    layer = layers[0]
    d = main.config.hidden_size
    ids, hidden = _prompt(main, 3, 9)
    with torch.no_grad():
        saved = layer.eh_proj.weight.clone()
        layer.eh_proj.weight[:, d:] = 0  # keep only the embedding half
        only_embedding = layer.fuse(ids[1:], hidden)
        layer.eh_proj.weight.copy_(saved)
    e = layer.enorm(layer.embed_tokens(ids[1:]))
    torch.testing.assert_close(only_embedding, F.linear(e, saved[:, :d]), rtol=0, atol=1e-12)


def test_module_index_is_checked() -> None:
    config = _config("v2-greedy", layers=1)
    assert mtp_layer_index(config, 0) == config.num_hidden_layers
    with pytest.raises(ValueError, match="MTP module 1"):
        mtp_layer_index(config, 1)

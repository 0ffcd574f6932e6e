"""A prefill rank's share runs the whole model's prefill: at tp=1 bit for bit, and a tp=2
pair (threads, in-process collectives) gives the whole model's latents within fp32 rounding,
equal on both ranks, its logits once gathered and its greedy first tokens, for the demo-like
V2, a V2 with query LoRA and YaRN, and a V3 with noaux_tc routing and an uneven vocabulary
split; under both MoE splits; with cached prefixes, prompt logprobs and the absorbed path."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from common.group.comm import Comm
from common.group.vocab import gather_vocab
from common.loading.loader import load_model
from common.model.causal_lm import DeepseekForCausalLM, PastLatents, PrefillOutput
from common.model.moe import MoE
from common.parallel import MoeParallel, ParallelConfig, ParallelError, ParallelMode
from services.prefill.rank.prefill_rank_model import PrefillRankModel
from tests.shard_checkpoints import run_group
from tests.tiny import save_hf

# The demo-like model (V2, no query LoRA, greedy routing), query LoRA with YaRN and grouped
# routing, V3's noaux_tc with a vocabulary tp=2 splits unevenly (79 + 78).
VARIANTS = {"v2-greedy": {}, "v2-group-yarn": {}, "v3-noaux-yarn": {"vocab_size": 157}}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DeepseekForCausalLM]:
    out = {}
    for variant, config in VARIANTS.items():
        path = tmp_path_factory.mktemp(variant)
        save_hf(variant, path, std=0.08, **config)
        out[variant] = load_model(path)
    return out


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor
    lens: list[int]
    past: list[PastLatents | None] | None = None


def _batch(model: DeepseekForCausalLM, with_past: bool) -> Batch:
    """Three prompts; with a past, the first two continue cached prefixes (as the prefix
    cache keeps them: the whole model's latents) and the last has none."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(2, vocab, (n,), generator=g) for n in (29, 18, 11)]
    if not with_past:
        return Batch(torch.cat(prompts), [len(p) for p in prompts])
    pasts: list[PastLatents | None] = []
    for prompt, cut in zip(prompts, (13, 7), strict=False):
        alone = model.prefill(prompt[:cut], [cut])
        pasts.append(PastLatents(alone.n, alone.k_pe))
    pasts.append(None)
    new = [prompts[0][13:], prompts[1][7:], prompts[2]]
    return Batch(torch.cat(new), [len(p) for p in new], pasts)


def _group_prefill(
    model: DeepseekForCausalLM, parallel: ParallelConfig, batch: Batch, **kwargs: bool
) -> list[tuple[PrefillOutput, torch.Tensor | None]]:
    """Every rank's output and its `gather_vocab` (the whole logits on rank 0)."""

    def rank(r: int, comm: Comm) -> tuple[PrefillOutput, torch.Tensor | None]:
        share = PrefillRankModel(model, parallel, r, comm)
        out = share.prefill(batch.ids, batch.lens, past=batch.past, **kwargs)
        return out, gather_vocab(comm, out.logits, model.config.vocab_size)

    return run_group(parallel.tp, rank)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", ["plain", "past-all-logits", "past-absorbed"])
def test_a_rank_of_one_is_the_whole_model_bit_for_bit(models, variant: str, case: str) -> None:
    model = models[variant]
    batch = _batch(model, with_past=case != "plain")
    kwargs = {"all_logits": case == "past-all-logits", "absorbed": case == "past-absorbed"}
    want = model.prefill(batch.ids, batch.lens, past=batch.past, **kwargs)
    ((got, whole),) = _group_prefill(model, ParallelConfig(), batch, **kwargs)
    assert torch.equal(got.logits, want.logits) and whole is not None
    assert torch.equal(whole, want.logits)
    for a, b in ((got.n, want.n), (got.k_pe, want.k_pe)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("moe", [MoeParallel.TP, MoeParallel.EP])
@pytest.mark.parametrize("case", ["plain", "past-all-logits", "past-absorbed"])
def test_a_tp2_pair_equals_the_whole_model(
    models, variant: str, moe: MoeParallel, case: str
) -> None:
    model = models[variant]
    batch = _batch(model, with_past=case != "plain")
    kwargs = {"all_logits": case == "past-all-logits", "absorbed": case == "past-absorbed"}
    want = model.prefill(batch.ids, batch.lens, past=batch.past, **kwargs)
    (first, whole), (second, nothing) = _group_prefill(
        model, ParallelConfig(tp=2, moe=moe), batch, **kwargs
    )
    assert nothing is None and whole is not None
    # The vocabulary shards: this rank's rows of the LM head, uneven where tp does not divide V.
    v = model.config.vocab_size
    assert first.logits.shape[1] + second.logits.shape[1] == v
    assert first.logits.shape[1] == -(-v // 2)
    torch.testing.assert_close(whole, want.logits, atol=2e-5, rtol=1e-4)
    rows = torch.tensor(batch.lens).cumsum(0) - 1 if kwargs["all_logits"] else slice(None)
    assert torch.equal(whole[rows].argmax(-1), want.logits[rows].argmax(-1))  # first tokens
    for layer in range(model.config.num_hidden_layers):
        # Every rank holds the whole latent, the same on each: any rank can ship any shard.
        assert torch.equal(first.n[layer], second.n[layer])
        assert torch.equal(first.k_pe[layer], second.k_pe[layer])
        torch.testing.assert_close(first.n[layer], want.n[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(first.k_pe[layer], want.k_pe[layer], atol=1e-5, rtol=1e-5)


def test_a_rank_holds_its_share(models) -> None:
    model = models["v3-noaux-yarn"]
    parallel = ParallelConfig(tp=2, moe=MoeParallel.EP)
    shares = run_group(2, lambda r, comm: PrefillRankModel(model, parallel, r, comm))
    c = model.config
    for rank, share in enumerate(shares):
        assert share.vocab == parallel.vocab_rows(rank, c.vocab_size)
        attn, whole = share.layers[0].self_attn, model.model.layers[0].self_attn
        assert attn.num_heads == c.num_attention_heads // 2
        assert torch.equal(attn.kv_a_proj_with_mqa.weight, whole.kv_a_proj_with_mqa.weight)
        assert share.layers[1].mlp.experts.gate_up_proj.shape[0] == c.n_routed_experts // 2
        assert share.layers[1].mlp.sized  # its routed rows: the slots its experts take
        assert torch.equal(share.embed_rows, model.model.embed_tokens.weight[share.vocab])
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert shares[0].parameter_bytes() < 0.7 * whole_bytes


def test_ep_ranks_sized_to_their_slots_answer_as_with_every_slot(models) -> None:
    """Under ep a rank's routed rows are only the slots its experts take; its answers are
    those of the same rank giving every slot a row (the decode step's static way)."""
    model = models["v3-noaux-yarn"]
    batch = _batch(model, with_past=False)
    parallel = ParallelConfig(tp=2, moe=MoeParallel.EP)

    def rank(r: int, comm: Comm, sized: bool) -> PrefillOutput:
        share = PrefillRankModel(model, parallel, r, comm)
        for module in share.modules():
            if isinstance(module, MoE):
                assert module.sized
                module.sized = sized
        return share.prefill(batch.ids, batch.lens, all_logits=True)

    sized = run_group(2, lambda r, comm: rank(r, comm, True))
    every = run_group(2, lambda r, comm: rank(r, comm, False))
    for a, b in zip(sized, every, strict=True):
        torch.testing.assert_close(a.logits, b.logits, atol=1e-6, rtol=1e-6)
        for x, y in zip(a.n, b.n, strict=True):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def test_a_prefill_group_splits_by_heads_only(models) -> None:
    model = models["v2-greedy"]
    for parallel in (
        ParallelConfig(tp=2, latent_groups=2),
        ParallelConfig(tp=2, mode=ParallelMode.SP),
    ):
        with pytest.raises(ParallelError, match="splits by heads"):
            PrefillRankModel(model, parallel, 0, Comm(1))
    with pytest.raises(ParallelError, match="rank 0 of a group of 1 for tp=2"):
        PrefillRankModel(model, ParallelConfig(tp=2), 0, Comm(1))

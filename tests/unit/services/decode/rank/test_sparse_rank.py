"""A decode group's DeepSeek Sparse Attention, its ranks run side by side as threads of one
process (tests/shard_checkpoints.py `run_group`): MLA-TP and SP give the single-process
model's logits (which HF's hold: common/model tests) over a context far past index_topk;
every MLA-TP and TPLA rank selects the same tokens; SP ranks' selections together are the
single model's."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from common.group.comm import Comm
from common.kv.paged_cache import CacheReads, PagedLatentCache
from common.kv.slots import token_slots
from common.loading.loader import load_model
from common.loading.mtp_weights import load_mtp_layers
from common.loading.weights import CheckpointWeights
from common.model.causal_lm import PrefillOutput
from common.model.contiguous_cache import ContiguousLatentCache
from common.model.mtp import mtp_prefill
from common.parallel import ParallelConfig, ParallelMode
from services.decode.rank.cache_split import Selection
from services.decode.rank.rank_model import RankModel
from tests.shard_checkpoints import run_group
from tests.tiny import DSA_VARIANTS, add_mtp_layer, save_hf

PROMPT, STEPS, BS, BLOCKS = 37, 5, 4, 24
MLA_TP = ParallelConfig(tp=2)
SP = ParallelConfig(tp=2, mode=ParallelMode.SP, chunk_size=4)
TPLA = ParallelConfig(tp=2, latent_groups=2)


@pytest.fixture(scope="module", params=sorted(DSA_VARIANTS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    HF[path] = save_hf(request.param, path)
    return path


HF: dict[Path, torch.nn.Module] = {}  # each checkpoint's HF transformers model


class Rank:
    """One rank's model and pools, the prompt's latents and keys written where it keeps them."""

    def __init__(
        self,
        src: CheckpointWeights,
        par: ParallelConfig,
        rank: int,
        out: PrefillOutput,
        length: int = PROMPT,
    ) -> None:
        self.model = RankModel(src, par, rank)
        self.cache = PagedLatentCache(self.model.cache_layout(BS, torch.float32), BLOCKS)
        keys = self.model.index_layout(BS, "model", torch.float32)
        assert keys is not None
        self.keys = PagedLatentCache(keys, BLOCKS)
        self.model.bind_index_pool(self.keys)
        self.table = torch.arange(BLOCKS - 1)[None]
        self.picked: list[Selection | None] = []
        owned = par.owned_ranges(rank, length)
        positions = torch.tensor([p for a, b in owned for p in range(a, b)])
        slots = token_slots(self.table, par.local_position(positions)[None], BS)[0]
        cols = par.latent_columns(rank, src.config.kv_lora_rank)
        for layer, (n, k_pe) in enumerate(zip(out.n, out.k_pe, strict=True)):
            self.cache.write(layer, slots, n[positions][:, cols], k_pe[positions])
        for layer, k in enumerate(out.index_keys):
            self.keys.write(layer, slots, k[positions], k[positions][:, :0])
        sparse = self.model.sparse
        assert sparse is not None
        select = sparse.select

        def recording(*args: object) -> Selection | None:
            got = select(*args)  # type: ignore[arg-type]
            self.picked.append(got)
            return got

        sparse.select = recording  # type: ignore[method-assign]

    def step(self, token: torch.Tensor, pos: torch.Tensor, width: int, comm: Comm) -> torch.Tensor:
        split = self.model.split
        writes, reads = split.address(pos, self.table[:, :width], BS, self.cache.trash_slot)
        return self.model.decode_step(token, pos, writes, reads, self.cache, comm)


def _step(
    ranks: list[Rank], token: torch.Tensor, pos: torch.Tensor, width: int, r: int, comm: Comm
) -> torch.Tensor:
    return ranks[r].step(token, pos, width, comm)


def _run(
    model_dir: Path, par: ParallelConfig
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[Rank]]:
    """Each step's logits from the group and from the single-process model (greedy from the
    model's), and the ranks."""
    model = load_model(model_dir)
    prompt = torch.randint(2, 160, (PROMPT,), generator=torch.Generator().manual_seed(4))
    out = model.prefill(prompt, [PROMPT])
    ref = ContiguousLatentCache(model.config, 1, PROMPT + STEPS)
    ref.load_prefill(0, out, 0, PROMPT)
    src = CheckpointWeights(model_dir, torch.float32)
    ranks = [Rank(src, par, r, out) for r in range(par.tp)]
    columns = par.vocab_columns(model.config.vocab_size)
    token = out.logits[0].argmax()[None]
    got, want = [], []
    width = BLOCKS - 1
    for s in range(STEPS):
        pos = torch.tensor([PROMPT + s])
        expected = model.decode(token, pos, ref)[0]
        parts = run_group(par.tp, partial(_step, ranks, token, pos, width))
        got.append(torch.cat(parts, dim=1)[0, columns])
        want.append(expected)
        token = expected.argmax()[None]
    return list(zip(got, want, strict=True)), ranks


@pytest.mark.parametrize("par", [MLA_TP, SP], ids=["mla-tp", "sp"])
def test_the_group_gives_hfs_logits(model_dir: Path, par: ParallelConfig) -> None:
    """Each decode step's logits: the group's equal the single-process model's and HF
    transformers' over the same sequence (its full forward at that position)."""
    steps, ranks = _run(model_dir, par)
    assert all(p is not None for r in ranks for p in r.picked)  # past index_topk: sparse
    prompt = torch.randint(2, 160, (PROMPT,), generator=torch.Generator().manual_seed(4))
    fed = [int(want.argmax()) for _, want in steps[:-1]]
    first = load_model(model_dir).prefill(prompt, [PROMPT]).logits[0].argmax()
    sequence = torch.cat([prompt, torch.tensor([int(first), *fed])])
    with torch.no_grad():
        hf = HF[model_dir](sequence[None]).logits[0, PROMPT:]
    for step, (got, want) in enumerate(steps):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(got, hf[step], atol=1e-4, rtol=0)


@pytest.mark.parametrize("par", [MLA_TP, TPLA], ids=["mla-tp", "tpla"])
def test_every_rank_selects_the_same_tokens(model_dir: Path, par: ParallelConfig) -> None:
    """The indexer is replicated and its inputs are bit-identical on every rank (the
    all-reduced hidden state): each rank's own selection is the same, layer by layer."""
    _, ranks = _run(model_dir, par)
    first, *others = ranks
    assert len(first.picked) == STEPS * len(first.model.layers)
    for other in others:
        for a, b in zip(first.picked, other.picked, strict=True):
            assert a is not None and b is not None
            assert torch.equal(a.count, b.count) and torch.equal(a.slots, b.slots)


def test_sp_ranks_select_the_single_models_tokens_between_them(model_dir: Path) -> None:
    """Each SP rank's count of selected tokens, summed, is what one rank holding every
    token selects (index_topk a row, or every token below it)."""
    _, ranks = _run(model_dir, SP)
    for picks in zip(*(r.picked for r in ranks), strict=True):
        total = sum(int(p.count[0]) for p in picks if p is not None)
        assert total == ranks[0].model.config.dsa.index_topk  # type: ignore[union-attr]


def test_a_step_whose_tables_hold_at_most_index_topk_tokens_attends_densely(
    model_dir: Path,
) -> None:
    src = CheckpointWeights(model_dir, torch.float32)
    model = load_model(model_dir)
    out = model.prefill(torch.arange(2, 7), [5])
    rank = Rank(src, ParallelConfig(), 0, out, 5)
    rank.step(torch.tensor([9]), torch.tensor([5]), 2, Comm(1))  # 2 blocks of 4: 8 = index_topk
    assert rank.picked and all(p is None for p in rank.picked)


def test_the_mtp_pass_over_a_prompt_is_the_whole_layers_prefill(tmp_path: Path) -> None:
    """The MTP layer's own indexer: every row of the draft pass selects over its causal past
    (a verify step's rows do the same), as the layer's sparse prefill does."""
    save_hf("v32-sparse", tmp_path)
    add_mtp_layer(tmp_path)
    main = load_model(tmp_path)
    (layer,) = load_mtp_layers(tmp_path, main=main)
    ids = torch.randint(2, 160, (30,), generator=torch.Generator().manual_seed(6))
    hidden = main.prefill(ids, [30]).hidden
    assert hidden is not None
    next_ids = torch.cat((ids[1:], torch.tensor([7])))
    want = mtp_prefill(layer, main.rope, next_ids, hidden, [30], all_logits=True)
    src = CheckpointWeights(tmp_path, torch.float32, mtp=True)
    rank = RankModel(src, ParallelConfig(), 0, [None] * (main.config.num_hidden_layers + 1))
    cache = PagedLatentCache(rank.cache_layout(BS, torch.float32), 16)
    keys = rank.index_layout(BS, "model", torch.float32)
    assert keys is not None
    rank.bind_index_pool(PagedLatentCache(keys, 16))
    positions = torch.arange(30)
    tables = torch.arange(8).expand(30, 8)
    slots = token_slots(tables, positions[:, None], BS)[:, 0]
    reads = CacheReads.blocks(tables, positions + 1, BS)
    h, drafts = rank.mtp_rows(next_ids, hidden, positions, slots, reads, cache, Comm(1))
    torch.testing.assert_close(h, want.hidden, atol=1e-4, rtol=1e-4)
    assert torch.equal(drafts, want.logits.argmax(-1))

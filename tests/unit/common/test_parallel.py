"""The parallel layout: every rank's slices tile the model, the vocabulary is split exactly as
`torch.tensor_split` (how checkpoints were sharded), and the module needs no torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.model.args import ModelConfig
from common.model.tpla import latent_shards
from common.parallel import (
    COMPARED,
    LAYOUT_NAMES,
    MoeParallel,
    ParallelConfig,
    ParallelError,
    ParallelMode,
    RmsNormMode,
    parse_mode,
    parse_moe,
    span,
    split_range,
)

ROOT = Path(__file__).resolve().parents[2]
# (tp, r): MLA-TP, TPLA at r < tp and r = tp.
LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 8)]

V3_LIKE = ModelConfig(
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    num_hidden_layers=4,
    num_attention_heads=128,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    q_lora_rank=1536,
    n_routed_experts=8,
    n_shared_experts=1,
    moe_intermediate_size=2048,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)


def _tiles(slices: list[slice], total: int) -> bool:
    """The slices, in order, cover 0..total contiguously."""
    return [s.start for s in slices] == [0, *(s.stop for s in slices[:-1])] and (
        slices[-1].stop == total
    )


@pytest.mark.parametrize("tp", range(1, 10))
def test_vocab_rows_are_torch_tensor_split(tp: int) -> None:
    for vocab in [*range(1, 70), 163, 320, 32000, 102400, 129280]:
        par = ParallelConfig(tp=tp)
        chunks = torch.tensor_split(torch.arange(vocab), tp)
        for rank, chunk in enumerate(chunks):
            assert list(range(vocab)[par.vocab_rows(rank, vocab)]) == chunk.tolist(), (vocab, tp)
        assert par.padded_vocab(vocab) == max(len(c) for c in chunks)
        # What the engine computed with torch: the real columns of the padded gathered row.
        padded = max(len(c) for c in chunks)
        expected = torch.cat([k * padded + torch.arange(len(c)) for k, c in enumerate(chunks)])
        assert par.vocab_columns(vocab) == expected.tolist()


def test_vocab_rows_ignore_the_latent_split() -> None:
    """Every rank takes its own vocabulary rows, whatever its latent group."""
    for tp, r in LAYOUTS:
        rows = [ParallelConfig(tp, r).vocab_rows(k, 163) for k in range(tp)]
        assert rows == [ParallelConfig(tp).vocab_rows(k, 163) for k in range(tp)]
        assert _tiles(rows, 163)


@pytest.mark.parametrize(("tp", "r"), LAYOUTS)
def test_heads_and_latent_columns_follow_the_coordinates(tp: int, r: int) -> None:
    par = ParallelConfig(tp, r)
    m = par.head_groups
    assert m * r == tp
    coords = [par.coords(k) for k in range(tp)]
    assert sorted(coords) == [(i, j) for i in range(r) for j in range(m)]  # one rank each
    heads = [par.heads(k, 128) for k in range(tp)]
    cols = [par.latent_columns(k, 512) for k in range(tp)]
    for k, (i, j) in enumerate(coords):
        assert span(heads[k]) == 128 // m and heads[k] == heads[j]  # rank j of group 0
        assert span(cols[k]) == 512 // r and cols[k] == cols[i * m]
    assert _tiles([heads[j] for j in range(m)], 128)
    assert _tiles([cols[i * m] for i in range(r)], 512)
    # The math's latent shards (what a rank's attention reads) are the same columns.
    shards = latent_shards(par.latent_slices(512))
    assert [slice(shards[i].start, shards[i].end) for i, _ in coords] == cols


@pytest.mark.parametrize(("tp", "r"), LAYOUTS)
def test_every_ffn_is_cut_tp_ways(tp: int, r: int) -> None:
    par = ParallelConfig(tp, r)
    ranks = range(tp)
    assert _tiles([par.ffn_columns(k, 18432) for k in ranks], 18432)
    assert _tiles([par.expert_columns(k, 2048) for k in ranks], 2048)
    assert _tiles([par.shared_expert_columns(k, 2048, 2) for k in ranks], 4096)


@pytest.mark.parametrize(("tp", "experts"), [(1, 8), (2, 8), (4, 8), (3, 8), (4, 6), (8, 256)])
def test_expert_parallel_ranks_hold_whole_experts_split_as_evenly_as_it_goes(
    tp: int, experts: int
) -> None:
    ep = ParallelConfig(tp, moe=MoeParallel.EP)
    held = [ep.owned_experts(k, experts) for k in range(tp)]
    assert _tiles(held, experts)
    assert max(map(span, held)) - min(map(span, held)) <= 1
    assert span(held[0]) == max(map(span, held))  # rank 0 is the planner's largest
    assert all(ep.expert_columns(k, 2048) == slice(0, 2048) for k in range(tp))
    assert _tiles([ep.shared_expert_columns(k, 2040, 3) for k in range(tp)], 6120)
    tp_mode = ParallelConfig(tp)
    assert all(tp_mode.owned_experts(k, experts) == slice(0, experts) for k in range(tp))


def test_expert_parallelism_needs_an_expert_per_rank() -> None:
    c = dataclasses.replace(V3_LIKE, n_routed_experts=2)
    with pytest.raises(ParallelError, match="the model has 2"):
        ParallelConfig(tp=4, moe=MoeParallel.EP).check(c)


def test_an_uneven_split_names_what_does_not_divide() -> None:
    par = ParallelConfig(tp=4, latent_groups=2)
    with pytest.raises(ParallelError, match=r"num_attention_heads \(3\) is not divisible by 2"):
        par.heads(0, 3)
    with pytest.raises(ParallelError, match=r"kv_lora_rank \(5\) is not divisible by 2"):
        par.latent_columns(0, 5)
    with pytest.raises(ParallelError, match=r"intermediate_size \(6\) is not divisible by 4"):
        par.ffn_columns(0, 6)
    with pytest.raises(ParallelError, match=r"moe_intermediate_size \(6\) is not divisible"):
        par.expert_columns(0, 6)
    with pytest.raises(ParallelError, match="shared experts' intermediate size"):
        par.shared_expert_columns(0, 3, 2)
    assert split_range(12, 3, 2, "x") == slice(8, 12)


@pytest.mark.parametrize("chunk", [1, 3, 4])
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_sp_ranks_own_their_round_robin_chunks(tp: int, chunk: int) -> None:
    par = ParallelConfig(tp=tp, mode=ParallelMode.SP, chunk_size=chunk)
    for total in range(0, 30):
        for rank in range(tp):
            owned = [p for lo, hi in par.owned_ranges(rank, total) for p in range(lo, hi)]
            assert owned == [p for p in range(total) if par.token_owner(p) == rank]
    # Outside SP every rank caches every token.
    assert ParallelConfig(tp=2).owned_ranges(1, 7) == [(0, 7)]
    assert ParallelConfig(tp=2).owned_ranges(1, 0) == []


@settings(max_examples=60, deadline=None)
@given(total=st.integers(0, 200), chunk=st.integers(1, 9), ranks=st.integers(1, 4))
def test_round_robin_bookkeeping(total: int, chunk: int, ranks: int) -> None:
    par = ParallelConfig(tp=ranks, mode=ParallelMode.SP, chunk_size=chunk)
    seen: dict[int, list[int]] = {r: [] for r in range(ranks)}
    for pos in range(total):
        owner = par.token_owner(pos)
        assert par.local_position(pos) == len(seen[owner])  # contiguous local order
        seen[owner].append(pos)
    lengths = [par.local_length(total, r) for r in range(ranks)]
    # A growing sequence stays balanced: no rank holds more than one chunk more than another.
    assert max(lengths) - min(lengths) <= chunk
    for r in range(ranks):
        assert lengths[r] == len(seen[r])
        flat = [p for lo, hi in par.owned_ranges(r, total) for p in range(lo, hi)]
        assert flat == seen[r]


def test_token_arithmetic_runs_on_tensors_as_on_ints() -> None:
    par = ParallelConfig(tp=3, mode=ParallelMode.SP, chunk_size=4)
    positions = torch.arange(50)
    for rank in range(3):
        lengths = par.local_length(positions + 1, rank)
        assert lengths.tolist() == [par.local_length(p + 1, rank) for p in range(50)]
    assert par.local_position(positions).tolist() == [par.local_position(p) for p in range(50)]
    assert par.token_owner(positions).tolist() == [par.token_owner(p) for p in range(50)]


@pytest.mark.parametrize(("tp", "r"), LAYOUTS)
def test_where_every_rank_caches_every_token_one_pool_holds_it(tp: int, r: int) -> None:
    par = ParallelConfig(tp, r)
    assert par.caches_every_token and par.token_ranks == 1
    assert par.keeps_whole_blocks(block_size=7)
    for rank in range(tp):
        assert [par.local_length(t, rank) for t in range(20)] == list(range(20))
        assert par.token_ranges(rank, 3, 20) == ()
    assert [(par.token_owner(p), par.local_position(p)) for p in range(20)] == [
        (0, p) for p in range(20)
    ]


def test_sp_token_ranges_name_the_positions_a_rank_caches() -> None:
    sp = ParallelConfig(2, mode=ParallelMode.SP, chunk_size=4)
    assert sp.token_ranks == 2
    assert sp.token_ranges(0, 0, 10) == (0, 4, 8, 10)
    assert sp.token_ranges(1, 0, 10) == (4, 8)
    assert sp.token_ranges(0, 5, 10) == (8, 10)  # after a cached prefix
    assert sp.token_ranges(1, 8, 10) == (0, 0)  # none of what is left
    assert sp.keeps_whole_blocks(4) and sp.keeps_whole_blocks(2)
    assert not sp.keeps_whole_blocks(3)


def test_names_labels_and_validation() -> None:
    assert (ParallelConfig().name, ParallelConfig().label) == ("mla-tp", "mla-tp")
    assert ParallelConfig(4, 2).name == "tpla" and ParallelConfig(4, 2).label == "tpla r=2"
    sp = ParallelConfig(4, 1, RmsNormMode.SLICED, ParallelMode.SP, 8)
    assert not sp.caches_every_token and (sp.name, sp.label) == ("sp", "sp")
    with pytest.raises(ParallelError, match="tp=6 is not a multiple of latent_groups=4"):
        ParallelConfig(6, 4)
    with pytest.raises(ParallelError, match="latent_groups=1"):
        ParallelConfig(4, 2, mode=ParallelMode.SP)
    with pytest.raises(ParallelError, match="chunk_size"):
        ParallelConfig(chunk_size=0)
    # TPLA with one latent group is MLA-TP: one value, one name.
    assert ParallelConfig(4, 1, mode=ParallelMode.TPLA) == ParallelConfig(
        4, 1, mode=ParallelMode.MLA_TP
    )
    with pytest.raises(ParallelError, match="latent_groups=1"):
        ParallelConfig(4, 2, mode=ParallelMode.MLA_TP)


def test_one_parser_for_every_name() -> None:
    assert LAYOUT_NAMES == ("tpla", "mla-tp", "sp")
    assert [m.value for m in COMPARED] == ["mla-tp", "tpla", "sp"]
    assert ParallelConfig.parse("tpla", 4, 2) == ParallelConfig(4, 2)
    # r is taken by TPLA only; r = 1 TPLA is MLA-TP.
    assert ParallelConfig.parse("mla-tp", 4, 2) == ParallelConfig(4, 1)
    assert ParallelConfig.parse("tpla", 4, 1).name == "mla-tp"
    sp = ParallelConfig.parse("sp", 4, 2, "sliced", 8, "ep")
    assert sp == ParallelConfig(4, 1, RmsNormMode.SLICED, ParallelMode.SP, 8, MoeParallel.EP)
    assert ParallelConfig.parse(**sp.to_dict()) == sp
    with pytest.raises(ValueError, match="parallel mode 'gla' is not tpla, mla-tp or sp"):
        parse_mode("gla")
    with pytest.raises(ValueError, match="MoE parallel mode 'dp' is not tp or ep"):
        parse_moe("dp")


def test_a_plan_compares_the_baseline_first() -> None:
    rows = ParallelConfig.compared(4, (2, 1, 4))
    assert [(mode.value, par.label) for mode, par in rows] == [
        ("mla-tp", "mla-tp"),
        ("tpla", "tpla r=2"),
        ("tpla", "mla-tp"),
        ("tpla", "tpla r=4"),
        ("sp", "sp"),
    ]


def test_check_refuses_what_a_rank_could_not_slice() -> None:
    for tp, r in LAYOUTS:
        ParallelConfig(tp, r).check(V3_LIKE)
    with pytest.raises(ParallelError, match=r"mla-tp: num_attention_heads \(128\) .* by 256"):
        ParallelConfig(256).check(V3_LIKE)
    odd = dataclasses.replace(V3_LIKE, kv_lora_rank=500)
    with pytest.raises(ParallelError, match=r"tpla r=8: kv_lora_rank \(500\) is not divisible"):
        ParallelConfig(8, 8).check(odd)
    dense = dataclasses.replace(V3_LIKE, intermediate_size=100)
    with pytest.raises(ParallelError, match=r"sp: intermediate_size \(100\) is not divisible"):
        ParallelConfig(8, mode=ParallelMode.SP).check(dense)
    # Only the FFNs the model has are checked: no dense layer, no dense split.
    all_moe = dataclasses.replace(dense, first_k_dense_replace=0)
    ParallelConfig(8).check(all_moe)
    with pytest.raises(ParallelError, match=r"mla-tp: moe_intermediate_size \(2052\)"):
        ParallelConfig(8).check(dataclasses.replace(all_moe, moe_intermediate_size=2048 + 4))


def test_the_layout_and_the_planner_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import common.parallel, common.tpla.capacity_plan, common.tpla.rank_memory\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("tp", "r"), LAYOUTS)
def test_prefill_heads_cut_each_head_group_by_latent_group(tp: int, r: int) -> None:
    """A local prefill's heads: part i of rank (i, j)'s head group, so every head is one
    rank's and the rank holds its query rows and o_proj columns already."""
    par = ParallelConfig(tp, r)
    parts = [par.prefill_heads(k, 128) for k in range(tp)]
    assert _tiles(sorted(parts, key=lambda s: s.start), 128)
    for k in range(tp):
        group = par.heads(k, 128)
        assert group.start <= parts[k].start and parts[k].stop <= group.stop
        assert span(parts[k]) == 128 // tp
    with pytest.raises(ParallelError, match="do not split"):
        ParallelConfig(4, 4).prefill_heads(0, 6)

"""A prefill rank's share of the MTP layer: a tp=2 pair (threads, in-process collectives)
gives what the tp = 1 worker computes (the whole model, then `mtp_prefill` over the whole
MTP layer): the MTP latents as one more layer within fp32 rounding and equal on both ranks,
the same hidden state and first tokens, under both MoE splits, with the layer's embedding and
head equal to the main model's (held once) or its own; a prompt prefilled in chunks, each over
the latents before it (the MTP layer's too), gets what the tp = 1 worker's chunks get (on
the absorbed path too); FP8 weights kept FP8 on the ranks give the latents of the weights
dequantized at load; a rank holds the bytes `tpla plan --prefill-gpus` counts for it; a
model without an MTP layer is refused by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.group.comm import Comm
from common.group.vocab import gather_vocab
from common.loading.serving_model import (
    load_prefill_model,
    load_prefill_mtp,
    open_serving_weights,
)
from common.model.causal_lm import PastLatents, PrefillOutput
from common.model.fp8 import Fp8Weight
from common.model.mtp import mtp_prefill, prompt_own_next_ids
from common.parallel import MoeParallel, ParallelConfig
from common.tpla.rank_memory import prefill_rank_tensors, weight_bytes
from services.prefill.rank.prefill_rank_model import PrefillRankModel, load_prefill_rank
from tests.shard_checkpoints import (
    CONFIG,
    FP8_CONFIG,
    MTP_CONFIG,
    ThreadCollectives,
    ThreadGroup,
    mtp_state,
    quantize,
    random_state,
    run_group,
    save_checkpoint,
)

LAYERS, VOCAB = CONFIG["num_hidden_layers"], CONFIG["vocab_size"]
LENS = [21, 13, 8]
IDS = torch.randint(2, VOCAB, (sum(LENS),), generator=torch.Generator().manual_seed(3))
WHOLE = [(0, sum(LENS))]  # the batch in one piece
CHUNKS = [(0, 6), (6, 12), (12, 18), (18, 21)]  # the first prompt in pieces of 6

# A piece's prefill: (ids, lens, every layer's past or None) -> its output.
Prefill = Callable[[torch.Tensor, list[int], PastLatents | None], PrefillOutput]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    main = random_state()
    root = tmp_path_factory.mktemp("prefill-rank-mtp")
    out = {
        shared: save_checkpoint({**main, **mtp_state(main, shared)}, root / shared, **MTP_CONFIG)
        for shared in ("equal", "different")
    }
    out["plain"] = save_checkpoint(main, root / "plain")
    fp8, _ = quantize({**main, **mtp_state(main, "equal")})
    out["fp8"] = save_checkpoint(fp8, root / "fp8", quantization_config=FP8_CONFIG, **MTP_CONFIG)
    return out


def _pieces(prefill: Prefill, pieces: list[tuple[int, int]]) -> list[PrefillOutput]:
    """Each piece [start, end) of IDS: the batch (LENS) when it is the only one, else one
    prompt's piece over every piece before it."""
    outs: list[PrefillOutput] = []
    for start, end in pieces:
        past = None
        if outs:
            past = PastLatents(
                [torch.cat(layer) for layer in zip(*(o.n for o in outs), strict=True)],
                [torch.cat(layer) for layer in zip(*(o.k_pe for o in outs), strict=True)],
            )
        outs.append(prefill(IDS[start:end], LENS if pieces == WHOLE else [end - start], past))
    return outs


def _tp1(path: Path, pieces: list[tuple[int, int]], weights: str = "auto") -> list[PrefillOutput]:
    """The tp = 1 worker's outputs (services/prefill/runner.py `LocalRunner.prefill`)."""
    model = load_prefill_model(path, None, weight_dtype=weights)
    layer = load_prefill_mtp(path, None, model, weight_dtype=weights)

    def prefill(ids: torch.Tensor, lens: list[int], past: PastLatents | None) -> PrefillOutput:
        # Composed here from the parts (not `prefill_with_mtp`, which both sides run).
        main = own = None
        if past is not None:
            main = [PastLatents(past.n[:LAYERS], past.k_pe[:LAYERS])]
            own = [PastLatents(past.n[LAYERS:], past.k_pe[LAYERS:])]
        out = model.prefill(ids, lens, past=main)
        assert out.hidden is not None
        next_ids = prompt_own_next_ids(ids, lens)
        mtp = mtp_prefill(layer, model.rope, next_ids, out.hidden, lens, past=own)
        return PrefillOutput(out.logits, [*out.n, mtp.n], [*out.k_pe, mtp.k_pe], out.hidden)

    return _pieces(prefill, pieces)


def _pair(
    path: Path,
    parallel: ParallelConfig,
    pieces: list[tuple[int, int]],
    weight_dtype: str = "auto",
    absorbed: bool = False,
) -> list[tuple[PrefillRankModel, list[PrefillOutput], list[torch.Tensor | None]]]:
    """Per rank: its share, its outputs and each output's gathered logits (rank 0's)."""
    weights, _ = open_serving_weights(path, None, weight_dtype=weight_dtype, mtp=True)

    def rank(
        r: int, comm: Comm
    ) -> tuple[PrefillRankModel, list[PrefillOutput], list[torch.Tensor | None]]:
        share = PrefillRankModel(weights, parallel, r, comm, mtp=True)
        outs = _pieces(
            lambda i, n, p: share.prefill(i, n, absorbed=absorbed, past=None if p is None else [p]),
            pieces,
        )
        return share, outs, [gather_vocab(comm, o.logits, VOCAB) for o in outs]

    return run_group(parallel.tp, rank)


def _assert_close(got: PrefillOutput, other: PrefillOutput, want: PrefillOutput) -> None:
    """`got` (rank 0's) within fp32 rounding of `want` (tp = 1) and equal to `other`'s."""
    assert len(got.n) == len(got.k_pe) == LAYERS + 1  # the MTP layer last
    for a, b, w in zip(got.n + got.k_pe, other.n + other.k_pe, want.n + want.k_pe, strict=True):
        assert torch.equal(a, b)  # every rank holds the whole latents
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)
    assert got.hidden is not None and want.hidden is not None
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shared", ["equal", "different"])
@pytest.mark.parametrize("moe", [MoeParallel.TP, MoeParallel.EP])
def test_a_tp2_pair_computes_the_tp1_workers_mtp_latents(
    dirs: dict[str, Path], shared: str, moe: MoeParallel
) -> None:
    (want,) = _tp1(dirs[shared], WHOLE)
    (first, (got,), (logits,)), (second, (other,), _) = _pair(
        dirs[shared], ParallelConfig(tp=2, moe=moe), WHOLE
    )
    _assert_close(got, other, want)
    assert logits is not None
    torch.testing.assert_close(logits, want.logits, atol=2e-5, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), want.logits.argmax(-1))  # the first tokens
    # The MTP layer's embedding and head rows: the rank's own when the checkpoint's are equal.
    for share in (first, second):
        assert share.mtp is not None
        held = share.mtp.parts.embed.weight is share.embed_rows
        assert held == (shared == "equal")
        assert (share.mtp.parts.lm_head is share.lm_head) == (shared == "equal")
        assert share.mtp.parts.embed.weight.shape[0] == share.vocab.stop - share.vocab.start


@pytest.mark.parametrize("absorbed", [False, True])
def test_a_tp2_pair_in_chunks_computes_the_tp1_workers_chunks(
    dirs: dict[str, Path], absorbed: bool
) -> None:
    want = _tp1(dirs["equal"], CHUNKS)
    (_, got, _), (_, other, _) = _pair(
        dirs["equal"], ParallelConfig(tp=2), CHUNKS, absorbed=absorbed
    )
    for g, o, w in zip(got, other, want, strict=True):
        _assert_close(g, o, w)


def test_fp8_kept_ranks_compute_the_latents_of_dequantized_weights(
    dirs: dict[str, Path],
) -> None:
    (want,) = _tp1(dirs["fp8"], WHOLE, "dequantize")
    (first, (got,), _), (_, (other,), _) = _pair(dirs["fp8"], ParallelConfig(tp=2), WHOLE, "float8")
    assert first.mtp is not None
    assert isinstance(first.mtp.layer.self_attn.kv_b_proj, Fp8Weight)
    assert isinstance(first.mtp.parts.eh_proj, Fp8Weight)
    _assert_close(got, other, want)


@pytest.mark.parametrize("moe", [MoeParallel.TP, MoeParallel.EP])
def test_a_rank_holds_the_planned_bytes(dirs: dict[str, Path], moe: MoeParallel) -> None:
    weights, _ = open_serving_weights(dirs["equal"], None, mtp=True)
    parallel = ParallelConfig(tp=2, moe=moe)
    for rank in range(2):
        coll = ThreadCollectives(ThreadGroup(2), rank)  # building runs no collective
        share = PrefillRankModel(weights, parallel, rank, Comm(2, coll, coll), mtp=True)
        planned = prefill_rank_tensors(weights.config, parallel, rank, mtp_layers=1)
        assert share.parameter_bytes() == weight_bytes(planned, "float32"), rank


def test_a_model_without_an_mtp_layer_is_refused_by_name(dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=f"model at {dirs['plain']} has no MTP layer"):
        load_prefill_rank(dirs["plain"], None, ParallelConfig(), 0, Comm(1), mtp=True)

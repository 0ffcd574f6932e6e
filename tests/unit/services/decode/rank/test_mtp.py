"""A decode rank's MTP module: its pass over a prompt's positions (rows written, then each
attending causally) is the whole layer's `mtp_prefill` (latents, hidden states, greedy
drafts), the vocabulary-sharded argmax is torch's, and a rank with the module holds the
weights and cache layer `tpla plan --speculative mtp` counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.group.comm import Comm
from common.kv.paged_cache import CacheReads, PagedLatentCache
from common.kv.slots import token_slots
from common.loading.loader import load_model
from common.loading.mtp_weights import load_mtp_layers
from common.loading.weights import CheckpointWeights
from common.model.mtp import mtp_prefill
from common.parallel import ParallelConfig
from common.tpla.rank_memory import kv_bytes_per_stored_token, mtp_tensors, weight_bytes
from services.decode.rank.mtp import global_argmax
from services.decode.rank.rank_model import RankModel
from tests.shard_checkpoints import MTP_CONFIG, mtp_state, random_state, save_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    main = random_state()
    state = {**main, **mtp_state(main, "equal")}
    return save_checkpoint(state, tmp_path_factory.mktemp("rank-mtp"), **MTP_CONFIG)


def _rank(model_dir: Path, mtp: bool) -> RankModel:
    src = CheckpointWeights(model_dir, torch.float32, mtp=mtp)
    c = src.config
    layers = c.num_hidden_layers + mtp
    return RankModel(src, ParallelConfig(), 0, [None] * layers)


def test_the_pass_is_the_whole_layers_prefill(model_dir: Path) -> None:
    main = load_model(model_dir)
    (layer,) = load_mtp_layers(model_dir, main=main)
    ids = torch.arange(3, 30)
    hidden = main.prefill(ids, [len(ids)]).hidden
    assert hidden is not None
    next_ids = torch.cat((ids[1:], torch.tensor([7])))
    want = mtp_prefill(layer, main.rope, next_ids, hidden, [len(ids)], all_logits=True)

    rank = _rank(model_dir, mtp=True)
    layout = rank.cache_layout(4, torch.float32)
    assert layout.num_layers == main.config.num_hidden_layers + 1
    cache = PagedLatentCache(layout, 16)
    positions = torch.arange(len(ids))
    tables = torch.arange(8).expand(len(ids), 8)
    slots = token_slots(tables, positions[:, None], 4)[:, 0]
    reads = CacheReads.blocks(tables, positions + 1, 4)
    h, drafts = rank.mtp_rows(next_ids, hidden, positions, slots, reads, cache, Comm(1))
    torch.testing.assert_close(h, want.hidden, atol=1e-4, rtol=1e-4)
    assert torch.equal(drafts, want.logits.argmax(-1))


def test_sharded_argmax_is_torchs() -> None:
    class Gathered(Comm):
        def __init__(self, parts: list[torch.Tensor]) -> None:
            super().__init__(1)
            self.parts = parts

        def all_gather(self, t: torch.Tensor) -> torch.Tensor:
            return torch.stack(self.parts)

    logits = torch.randn(5, 23)
    logits[2, 4] = logits[2, 17] = 9.0  # a tie across two ranks: the lower id wins
    par = ParallelConfig(tp=3, latent_groups=1)
    rows = [par.vocab_rows(k, 23) for k in range(3)]
    mine = []
    for r in rows:
        local = logits[:, r]
        idx = local.argmax(-1)
        best = local.gather(-1, idx[:, None])[:, 0]
        mine.append(torch.stack((best, (idx + r.start).float()), dim=-1))
    got = global_argmax(logits[:, rows[0]], rows[0].start, Gathered(mine))
    assert torch.equal(got, logits.argmax(-1))


def test_a_rank_with_the_module_holds_what_the_plan_counts(model_dir: Path) -> None:
    plain, with_mtp = _rank(model_dir, mtp=False), _rank(model_dir, mtp=True)
    c = with_mtp.config
    extra = weight_bytes(mtp_tensors(c, ParallelConfig(), 0, 1), "float32")
    assert with_mtp.parameter_bytes() - plain.parameter_bytes() == extra
    layout = with_mtp.cache_layout(4, torch.float32)
    per_token = layout.bytes_per_token_per_layer * layout.num_layers
    assert per_token == kv_bytes_per_stored_token(c, ParallelConfig(), "float32", 1)

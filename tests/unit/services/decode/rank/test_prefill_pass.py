"""A decode rank's local prefill in a group of one (the layouts' collectives: tests/
integration/test_local_prefill.py): its stack is the whole model's prefill bit for bit,
sharing the rank's weights rather than holding them again, and a prompt in pieces (each over
the latents the earlier ones stored in the paged cache) stores the whole prefill's latents
and ends on its logits, the MTP layer's latents and last hidden state included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.group.comm import Comm
from common.kv.paged_cache import PagedLatentCache
from common.loading.loader import load_model
from common.loading.mtp_weights import load_mtp_layers
from common.loading.weights import CheckpointWeights
from common.model.causal_lm import packed_prefill
from common.model.mtp import prompt_own_next_ids, whole_prefill_with_mtp
from common.model.prefill_attention import SdpaPrefillAttention
from common.parallel import ParallelConfig
from services.decode.rank.prefill_pass import PrefillPass
from services.decode.rank.prefill_stack import RankPrefillStack
from services.decode.rank.rank_model import RankModel
from services.decode.step_plan import PrefillPlan
from tests.shard_checkpoints import MTP_CONFIG, mtp_state, random_state, save_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    main = random_state()
    state = {**main, **mtp_state(main, "equal")}
    return save_checkpoint(state, tmp_path_factory.mktemp("prefill-pass"), **MTP_CONFIG)


def _pass(model_dir: Path, mtp: bool) -> tuple[PrefillPass, CheckpointWeights]:
    src = CheckpointWeights(model_dir, torch.float32, mtp=mtp)
    layers = src.config.num_hidden_layers + mtp
    model = RankModel(src, ParallelConfig(), 0, [None] * layers)
    stack = RankPrefillStack(src, model, ParallelConfig(), Comm(1), SdpaPrefillAttention())
    cache = PagedLatentCache(model.cache_layout(4, torch.float32), 32)
    return PrefillPass(stack, model.split, cache, Comm(1), ParallelConfig()), src


def test_the_stack_is_the_whole_models_prefill(model_dir: Path) -> None:
    whole = load_model(model_dir)
    prefill, _ = _pass(model_dir, mtp=False)
    ids = torch.arange(3, 40)
    want = whole.prefill(ids, [20, 17])
    got = packed_prefill(prefill.stack, ids, [20, 17])
    assert torch.equal(got.logits[:, : whole.config.vocab_size], want.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.n, want.n, strict=True))
    # The attention's weights are the rank's own, joined or viewed, not copies.
    rank = prefill.stack.model.layers[0].attn
    attn = prefill.stack.layers[0].self_attn
    assert attn.q_b_proj.weight.data_ptr() == rank.q_b.data_ptr()
    assert attn.o_proj.weight.data_ptr() == rank.w_o.data_ptr()


@pytest.mark.parametrize("mtp", [False, True])
def test_a_prompt_in_pieces_stores_the_whole_prefills_latents(model_dir: Path, mtp: bool) -> None:
    prefill, _ = _pass(model_dir, mtp)
    whole = load_model(model_dir)
    ids = torch.arange(5, 28)
    if mtp:
        (layer,) = load_mtp_layers(model_dir, main=whole)
        want = whole_prefill_with_mtp(whole, layer, ids, [23], prompt_own_next_ids(ids, [23]))
    else:
        want = whole.prefill(ids, [23])
    table = torch.arange(8)[None, None]
    logits = None
    for start in range(0, 23, 7):
        end = min(start + 7, 23)
        after = ids[end] if end < 23 else -1
        plan = PrefillPlan(
            torch.tensor([end - start]),
            torch.tensor([start]),
            torch.tensor([0]),
            torch.tensor([after]),
            ids[start:end],
            table,
            logits=end == 23,
        )
        logits = prefill.run(plan)
        assert (logits is None) == (end < 23)
    assert logits is not None
    torch.testing.assert_close(logits[:, : whole.config.vocab_size], want.logits, atol=1e-5, rtol=0)
    stored = prefill.cache.kv[:, :23]
    expected = torch.cat((torch.stack(want.n), torch.stack(want.k_pe)), dim=-1)
    torch.testing.assert_close(stored, expected, atol=1e-5, rtol=0)
    if mtp:
        assert want.hidden is not None and prefill.last_hidden is not None
        torch.testing.assert_close(prefill.last_hidden[0], want.hidden[-1], atol=1e-5, rtol=0)

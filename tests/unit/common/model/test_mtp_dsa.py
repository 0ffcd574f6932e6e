"""The MTP module of a DSA model (V3.2 and GLM-5 hold an indexer in their MTP layer): its
prefill runs sparse attention over a prompt past index_topk, and the serving prefill's cheap
pass (`mtp_latents`) gives the layer's indexer keys, one more key layer after the main
model's, bit-equal to the layer's own prefill, whole or over a cached past."""

from __future__ import annotations

import pytest
import torch

from common.loading.loader import load_model
from common.loading.mtp_weights import load_mtp_layers
from common.model.causal_lm import PastLatents
from common.model.mtp import mtp_prefill, prompt_own_next_ids, whole_prefill_with_mtp
from tests.tiny import DSA_VARIANTS, add_mtp_layer, save_hf

LENGTH = 30


@pytest.fixture(scope="module", params=sorted(DSA_VARIANTS))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp(request.param)
    save_hf(request.param, path)
    add_mtp_layer(path)
    main = load_model(path)
    (layer,) = load_mtp_layers(path, main=main)
    return main, layer


def test_the_serving_prefill_gives_the_layers_own_keys(models) -> None:  # type: ignore[no-untyped-def]
    main, layer = models
    assert layer.self_attn.indexer is not None
    ids = torch.randint(2, 160, (LENGTH,), generator=torch.Generator().manual_seed(3))
    next_ids = prompt_own_next_ids(ids, [LENGTH])
    out = whole_prefill_with_mtp(main, layer, ids, [LENGTH], next_ids)
    dsa = main.config.dsa
    assert dsa is not None
    assert len(out.index_keys) == dsa.key_layers(main.config.num_hidden_layers) + 1
    assert out.hidden is not None
    own = mtp_prefill(layer, main.rope, next_ids, out.hidden, [LENGTH], all_logits=True)
    assert torch.equal(out.index_keys[-1], own.index_keys[0])
    assert torch.equal(out.n[-1], own.n)


def test_a_prompt_over_its_cached_past_equals_it_whole(models) -> None:  # type: ignore[no-untyped-def]
    main, layer = models
    ids = torch.randint(2, 160, (LENGTH,), generator=torch.Generator().manual_seed(4))
    next_ids = prompt_own_next_ids(ids, [LENGTH])
    whole = whole_prefill_with_mtp(main, layer, ids, [LENGTH], next_ids)
    cut = 16
    past = PastLatents(
        [n[:cut] for n in whole.n],
        [k[:cut] for k in whole.k_pe],
        [k[:cut] for k in whole.index_keys],
    )
    rest = whole_prefill_with_mtp(
        main, layer, ids[cut:], [LENGTH - cut], next_ids[cut:], past=[past]
    )
    torch.testing.assert_close(rest.logits, whole.logits, atol=1e-5, rtol=0)
    for a, b in zip(rest.index_keys, whole.index_keys, strict=True):
        torch.testing.assert_close(a, b[cut:], atol=1e-5, rtol=0)

"""The local runner with the MTP layer: its output holds the MTP latents as one more layer,
the whole layer's prefill over the prompt shifted by one (the last row fed its own token);
a prompt run after a cached prefix of every layer (the MTP one too) gets the same latents
for its new rows; nothing it returns carries an autograd graph; a model without an MTP layer
is refused by name."""

from __future__ import annotations

import pytest
import torch

from common.kv.transfer import make_sender
from common.loading.serving_model import load_prefill_model, load_prefill_mtp
from common.model.causal_lm import PastLatents
from common.model.mtp import mtp_prefill
from services.prefill.batch.batch_plan import BatchPlan, JobPlan
from services.prefill.runner import LocalRunner
from services.prefill.shipping import ShipOrder
from tests.shard_checkpoints import MTP_CONFIG, mtp_state, random_state, save_checkpoint


def _plan(prompt: list[int], hit: int) -> BatchPlan:
    order = ShipOrder("r", len(prompt), 0, 4, (), 1.0)
    return BatchPlan((JobPlan(0, tuple(prompt), hit > 0, hit, order),), False)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory):
    main = random_state()
    path = save_checkpoint(
        {**main, **mtp_state(main, "equal")}, tmp_path_factory.mktemp("runner"), **MTP_CONFIG
    )
    model = load_prefill_model(path, None)
    r = LocalRunner(model, make_sender("grpc", "test"), load_prefill_mtp(path, None, model))
    yield r
    r.close()


def test_the_mtp_latents_are_one_more_layer(runner: LocalRunner) -> None:
    prompt = list(range(5, 26))
    out = runner.prefill(_plan(prompt, 0), None)
    layers = runner.config.num_hidden_layers
    assert runner.sends_hidden and len(out.n) == len(out.k_pe) == layers + 1
    ids = torch.tensor(prompt)
    shifted = torch.cat((ids[1:], ids[-1:]))
    assert runner.mtp is not None and out.hidden is not None
    want = mtp_prefill(runner.mtp, runner.model.rope, shifted, out.hidden, [len(prompt)])
    assert torch.equal(out.n[layers], want.n) and torch.equal(out.k_pe[layers], want.k_pe)
    # A serving prefill keeps no autograd graph, the MTP layer's pass included.
    assert not any(t.requires_grad for t in [*out.n, *out.k_pe, out.logits, out.hidden])

    hit = 8  # a cached prefix of every layer's latents, the MTP layer's too
    past = PastLatents([n[:hit] for n in out.n], [k[:hit] for k in out.k_pe])
    rest = runner.prefill(_plan(prompt, hit), [past])
    for whole, part in zip(out.n, rest.n, strict=True):
        torch.testing.assert_close(part, whole[hit:], atol=1e-5, rtol=1e-5)


def test_a_model_without_an_mtp_layer_is_refused_by_name(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = save_checkpoint(random_state(), tmp_path_factory.mktemp("plain"))
    model = load_prefill_model(path, None)
    with pytest.raises(ValueError, match=f"model at {path} has no MTP layer"):
        load_prefill_mtp(path, None, model)

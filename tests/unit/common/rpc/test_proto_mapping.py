"""SamplingParams over the wire (common/rpc/proto_mapping.py): every field comes back as it went,
the thinking fields (think-end tokens, an optional budget, 0 included) among them."""

from __future__ import annotations

import pytest

from common.rpc.proto_mapping import params_from_pb, params_to_pb
from common.sampling.grammar import GrammarKind, GrammarSpec
from common.sampling.params import SamplingParams


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(
            max_tokens=9,
            temperature=0.5,
            top_p=0.75,  # floats a float32 holds exactly
            top_k=4,
            seed=-3,
            stop_token_ids=(1, 2),
            logprobs=2,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.25,
            logit_bias=((3, 1.5),),
            min_tokens=2,
            min_p=0.25,
            grammar=GrammarSpec(GrammarKind.REGEX, "[a-c]+"),
            think_end_ids=(128799,),
            thinking_budget=0,
        ),
        SamplingParams(think_end_ids=(7, 8), thinking_budget=None),
    ],
)
def test_params_round_trip(params: SamplingParams) -> None:
    assert params_from_pb(params_to_pb(params)) == params

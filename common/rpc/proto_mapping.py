"""Conversions of the in-process messages (common/messages.py) to and from protobuf, one
pair per message.

A `Reservation` is the decode service's `ReserveResponse` on the wire (the prefill request
carries it as it came); a `PrefillResult` is a `PrefillResponse`.
"""

from __future__ import annotations

import dataclasses

from common.messages import (
    DecodeLoad,
    FailureScope,
    KvTargetInfo,
    PrefillResult,
    Reservation,
    ResumedChoice,
    TokenEvent,
)
from common.rpc.gen import common_pb2, decode_pb2
from common.sampling.grammar import GrammarKind, GrammarSpec
from common.sampling.params import SamplingError, SamplingParams
from common.sampling.sampler import SampledToken


def params_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
        min_p=p.min_p,
        think_end_ids=list(p.think_end_ids),
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.grammar is not None:
        msg.grammar.CopyFrom(common_pb2.Grammar(kind=p.grammar.kind.value, spec=p.grammar.spec))
    if p.thinking_budget is not None:
        msg.thinking_budget = p.thinking_budget
    return msg


def params_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises SamplingError (a ValueError) for out-of-range values."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        min_tokens=msg.min_tokens,
        min_p=msg.min_p,
        grammar=_grammar_from_pb(msg.grammar) if msg.HasField("grammar") else None,
        think_end_ids=tuple(msg.think_end_ids),
        thinking_budget=msg.thinking_budget if msg.HasField("thinking_budget") else None,
    )


def _grammar_from_pb(msg: common_pb2.Grammar) -> GrammarSpec:
    try:
        return GrammarSpec(GrammarKind(msg.kind), msg.spec)
    except ValueError:
        raise SamplingError(f"unknown grammar kind {msg.kind!r}") from None


def token_to_pb(t: SampledToken) -> common_pb2.TokenInfo:
    return common_pb2.TokenInfo(
        token_id=t.token_id,
        logprob=t.logprob,
        top_logprobs=[common_pb2.TopLogprob(token_id=i, logprob=lp) for i, lp in t.top_logprobs],
    )


def token_from_pb(msg: common_pb2.TokenInfo) -> SampledToken:
    return SampledToken(
        msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top_logprobs)
    )


_SCOPE_TO_PB = {
    None: decode_pb2.FAILURE_SCOPE_UNSPECIFIED,
    FailureScope.REQUEST: decode_pb2.FAILURE_SCOPE_REQUEST,
    FailureScope.GROUP: decode_pb2.FAILURE_SCOPE_GROUP,
}
_SCOPE_FROM_PB = {v: k for k, v in _SCOPE_TO_PB.items()}


def event_to_pb(e: TokenEvent) -> decode_pb2.GenerateEvent:
    msg = decode_pb2.GenerateEvent(
        finish_reason=e.finish_reason or "",
        index=e.index,
        spec_drafted=e.drafted,
        spec_accepted=e.accepted,
        failure=_SCOPE_TO_PB[e.failure],
    )
    if e.token is not None:
        msg.token.CopyFrom(token_to_pb(e.token))
    return msg


def event_from_pb(msg: decode_pb2.GenerateEvent) -> TokenEvent:
    token = token_from_pb(msg.token) if msg.HasField("token") else None
    return TokenEvent(
        token,
        msg.finish_reason or None,
        index=msg.index,
        drafted=msg.spec_drafted,
        accepted=msg.spec_accepted,
        failure=_SCOPE_FROM_PB.get(msg.failure),
    )


def resumed_to_pb(c: ResumedChoice) -> decode_pb2.ResumedChoice:
    return decode_pb2.ResumedChoice(index=c.index, replay=list(c.replay))


def resumed_from_pb(msg: decode_pb2.ResumedChoice) -> ResumedChoice:
    return ResumedChoice(msg.index, tuple(msg.replay))


def target_to_pb(t: KvTargetInfo) -> common_pb2.KvTarget:
    return common_pb2.KvTarget(
        rank=t.rank,
        grpc_address=t.grpc_address,
        torch_address=t.torch_address,
        latent_start=t.latent_start,
        latent_width=t.latent_width,
        block_ids=list(t.block_ids),
        token_ranges=list(t.token_ranges),
        epoch=t.epoch,
    )


def target_from_pb(msg: common_pb2.KvTarget) -> KvTargetInfo:
    return KvTargetInfo(
        msg.rank,
        msg.grpc_address,
        msg.torch_address,
        msg.latent_start,
        msg.latent_width,
        tuple(msg.block_ids),
        tuple(msg.token_ranges),
        msg.epoch,
    )


def reservation_from_pb(msg: decode_pb2.ReserveResponse) -> Reservation:
    return Reservation(
        msg.request_id,
        msg.block_size,
        msg.num_layers,
        msg.rope_width,
        msg.dtype,
        msg.lease_seconds,
        tuple(target_from_pb(t) for t in msg.targets),
        msg.cached_tokens,
    )


def reservation_to_pb(r: Reservation) -> decode_pb2.ReserveResponse:
    return decode_pb2.ReserveResponse(
        request_id=r.request_id,
        block_size=r.block_size,
        num_layers=r.num_layers,
        rope_width=r.rope_width,
        dtype=r.dtype,
        lease_seconds=r.lease_seconds,
        targets=[target_to_pb(t) for t in r.targets],
        cached_tokens=r.cached_tokens,
    )


def result_to_pb(r: PrefillResult) -> common_pb2.PrefillResponse:
    return common_pb2.PrefillResponse(
        first_token=token_to_pb(r.first_token),
        prefill_seconds=r.prefill_seconds,
        transfer_seconds=r.transfer_seconds,
        transfer_bytes=r.transfer_bytes,
        cached_tokens=r.cached_tokens,
        first_tokens=[token_to_pb(t) for t in r.choice_tokens],
        prompt_logprobs=[token_to_pb(t) for t in r.prompt_logprobs],
        exposed_transfer_seconds=r.exposed_transfer_seconds,
        hidden=r.hidden,
    )


def result_from_pb(msg: common_pb2.PrefillResponse) -> PrefillResult:
    return PrefillResult(
        token_from_pb(msg.first_token),
        msg.prefill_seconds,
        msg.transfer_seconds,
        msg.transfer_bytes,
        msg.cached_tokens,
        tuple(token_from_pb(t) for t in msg.first_tokens),
        tuple(token_from_pb(t) for t in msg.prompt_logprobs),
        msg.exposed_transfer_seconds,
        tuple(msg.hidden),
    )


def load_to_pb(load: DecodeLoad) -> decode_pb2.DecodeLoad:
    return decode_pb2.DecodeLoad(**dataclasses.asdict(load))


def load_from_pb(msg: decode_pb2.DecodeLoad) -> DecodeLoad:
    return DecodeLoad(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(DecodeLoad)})

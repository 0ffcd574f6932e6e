"""Conversions between wire messages and in-process dataclasses, defined once."""

from __future__ import annotations

from dataclasses import dataclass

from common.rpc.gen import common_pb2, decode_pb2
from common.sampling import SampledToken, SamplingParams


@dataclass(frozen=True)
class KvTargetInfo:
    rank: int
    grpc_address: str
    torch_address: str
    latent_start: int
    latent_width: int
    block_ids: tuple[int, ...]
    token_ranges: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReservationInfo:
    request_id: str
    block_size: int
    num_layers: int
    rope_width: int
    dtype: str
    lease_seconds: float
    targets: tuple[KvTargetInfo, ...]
    cached_tokens: int = 0  # leading prompt tokens the group holds already: not shipped


def params_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
    )
    if p.seed is not None:
        msg.seed = p.seed
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
    )


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


def target_to_pb(t: KvTargetInfo) -> common_pb2.KvTarget:
    return common_pb2.KvTarget(
        rank=t.rank,
        grpc_address=t.grpc_address,
        torch_address=t.torch_address,
        latent_start=t.latent_start,
        latent_width=t.latent_width,
        block_ids=list(t.block_ids),
        token_ranges=list(t.token_ranges),
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
    )


def reservation_from_pb(msg: decode_pb2.ReserveResponse) -> ReservationInfo:
    return ReservationInfo(
        msg.request_id,
        msg.block_size,
        msg.num_layers,
        msg.rope_width,
        msg.dtype,
        msg.lease_seconds,
        tuple(target_from_pb(t) for t in msg.targets),
        msg.cached_tokens,
    )

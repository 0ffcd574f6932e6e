"""Typed asyncio clients for the prefill and decode services (used by the router).

They speak dataclasses to callers and protos to the wire, and turn gRPC failures into the
typed errors of common.runtime.errors. Message-size limits are set deliberately on every channel.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from common.messages import DecodeLoad, PrefillResult, Reservation, ResumedChoice, TokenEvent
from common.rpc.gen import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from common.rpc.proto_mapping import (
    event_from_pb,
    load_from_pb,
    params_to_pb,
    reservation_from_pb,
    reservation_to_pb,
    result_from_pb,
    resumed_to_pb,
    token_to_pb,
)
from common.runtime.errors import from_grpc
from common.runtime.spans import Metadata
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken

MAX_MESSAGE_BYTES = 64 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A worker restarted on the same address must be reachable at once. After failed
    # connects a channel waits an exponential backoff (by default up to 2 minutes) and fails
    # every call meanwhile with the old "connection refused": a decode leader back after a
    # restart stayed unreachable from the router for the rest of a fault test.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
TOKEN_METADATA_KEY = "x-tpla-token"


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_METADATA_KEY, token),) if token else ()


class DecodeClient:
    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = decode_pb2_grpc.DecodeStub(self._channel)
        self._md = _metadata(token)

    async def reserve(
        self,
        request_id: str,
        prompt_len: int,
        max_tokens: int,
        timeout: float = 10.0,
        n: int = 1,
        prompt_ids: Sequence[int] = (),
        trace: Metadata = (),
    ) -> Reservation:
        """Reserve blocks; with `prompt_ids` the group reuses its cached prefix of them.
        `trace`: the caller's span as metadata (common.runtime.spans), here and below."""
        try:
            msg = await self._stub.Reserve(
                decode_pb2.ReserveRequest(
                    request_id=request_id,
                    prompt_len=prompt_len,
                    max_tokens=max_tokens,
                    prompt_ids=list(prompt_ids),
                    n=n,
                ),
                timeout=timeout,
                metadata=self._md + trace,
            )
        except grpc.RpcError as exc:
            raise from_grpc(exc) from exc
        return reservation_from_pb(msg)

    async def prefill(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        timeout: float = 60.0,
        num_output_tokens: int = 0,
        n: int = 1,
        prompt_logprobs: int | None = None,
        trace: Metadata = (),
    ) -> PrefillResult:
        """Prefill the reserved prompt on this group itself and sample its n first tokens, as
        `PrefillClient.prefill` does on a prefill worker (its KV lands in the reservation)."""
        req = decode_pb2.LocalPrefillRequest(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params_to_pb(params),
            deadline_seconds=timeout,
            num_output_tokens=num_output_tokens,
            n=n,
            prompt_logprobs=prompt_logprobs,
        )
        try:
            m = await self._stub.Prefill(req, timeout=timeout, metadata=self._md + trace)
        except grpc.RpcError as exc:
            raise from_grpc(exc) from exc
        return result_from_pb(m)

    async def generate(
        self,
        request_id: str,
        first_token: SampledToken | tuple[SampledToken, ...],
        params: SamplingParams,
        idle_timeout: float = 60.0,
        *,
        prompt_ids: Sequence[int] = (),
        output_ids: Sequence[int] = (),
        resumed: Sequence[ResumedChoice] = (),
        hidden: Sequence[float] = (),
        trace: Metadata = (),
    ) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens, every choice's (one first token each); ends when
        every choice has ended. `idle_timeout` bounds the wait for each event.
        `output_ids`: tokens generated before `first_token` elsewhere (a migrated n = 1
        request); `resumed`: a migrated n > 1 request's live choices, one per first token;
        `prompt_ids`: only for a repetition penalty; `hidden`: the prefill's last hidden
        state (MTP drafts)."""
        firsts = first_token if isinstance(first_token, tuple) else (first_token,)
        call = self._stub.Generate(
            decode_pb2.GenerateRequest(
                request_id=request_id,
                first_token=token_to_pb(firsts[0]),
                first_tokens=[token_to_pb(t) for t in firsts] if len(firsts) > 1 else [],
                params=params_to_pb(params),
                prompt_ids=list(prompt_ids),
                output_ids=list(output_ids),
                resumed=[resumed_to_pb(c) for c in resumed],
                hidden=list(hidden),
            ),
            metadata=self._md + trace,
        )
        left = len(firsts)
        try:
            while True:
                # Scoped to the read alone (the caller's work between events must not
                # count); cheaper than wait_for, which wraps every read in a new task.
                async with asyncio.timeout(idle_timeout):
                    msg = await call.read()
                if msg is grpc.aio.EOF:
                    return
                for event in msg.events:
                    yield event_from_pb(event)
                    if event.finish_reason:
                        left -= 1
                        if not left:
                            return
        except grpc.RpcError as exc:
            raise from_grpc(exc) from exc
        finally:
            call.cancel()

    async def abort(
        self, request_id: str, timeout: float = 5.0, choices: tuple[int, ...] = ()
    ) -> bool:
        """End the request (only `choices` of it when given); whether the leader had it."""
        try:
            resp = await self._stub.Abort(
                decode_pb2.AbortRequest(request_id=request_id, choices=list(choices)),
                timeout=timeout,
                metadata=self._md,
            )
        except grpc.RpcError as exc:
            raise from_grpc(exc) from exc
        return resp.found

    async def load(self, timeout: float = 5.0) -> DecodeLoad:
        try:
            m = await self._stub.GetLoad(common_pb2.Empty(), timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            raise from_grpc(exc) from exc
        return load_from_pb(m)

    async def close(self) -> None:
        await self._channel.close()


class PrefillClient:
    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = prefill_pb2_grpc.PrefillStub(self._channel)
        self._md = _metadata(token)

    async def prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        reservation: Reservation,
        transport: str = "grpc",
        timeout: float = 60.0,
        num_output_tokens: int = 0,
        n: int = 1,
        prompt_logprobs: int | None = None,
        trace: Metadata = (),
    ) -> PrefillResult:
        """Prefill into the reservation; sample n first tokens (one per choice) and, when
        `prompt_logprobs` is set, the prompt's logprobs with that many alternatives.
        `num_output_tokens`: the last prompt ids are the request's own earlier output."""
        req = prefill_pb2.PrefillRequest(
            n=n,
            prompt_logprobs=prompt_logprobs,
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params_to_pb(params),
            reservation=reservation_to_pb(reservation),
            transport=transport,
            deadline_seconds=timeout,
            num_output_tokens=num_output_tokens,
        )
        try:
            m = await self._stub.Prefill(req, timeout=timeout, metadata=self._md + trace)
        except grpc.RpcError as exc:
            raise from_grpc(exc) from exc
        return result_from_pb(m)

    async def load(self, timeout: float = 5.0) -> tuple[int, int]:
        try:
            m = await self._stub.GetLoad(common_pb2.Empty(), timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            raise from_grpc(exc) from exc
        return m.queued_requests, m.queued_tokens

    async def close(self) -> None:
        await self._channel.close()

"""The internal token on every internal gRPC server: real decode leader (with its rank's KV
receiver) and prefill worker, started in threads of the test (tests/stack.py).

Every method of Decode, Prefill and KvReceiver answers UNAUTHENTICATED without the token or
with a wrong one, before doing any work; with the token a whole disaggregated request runs
(which also proves the prefill worker presents the token to the KV receiver).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.rpc.clients import CHANNEL_OPTIONS, TOKEN_METADATA_KEY, DecodeClient, PrefillClient
from common.rpc.gen import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kv_pb2,
    kv_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from common.runtime.errors import Unauthorized
from common.sampling.params import SamplingParams
from tests.stack import one_rank_group, services_in_threads
from tests.tiny import save_hf

TOKEN = "s3cret-internal-token"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A tp=1 decode leader (+ its KV receiver) and a prefill worker, both with TOKEN."""
    model_dir: Path = tmp_path_factory.mktemp("auth-model")
    save_hf("v2-group-yarn", model_dir, std=0.08)
    cfg = one_rank_group(model_dir, internal_token=TOKEN)
    with services_in_threads(cfg, None, token=TOKEN, start_timeout_s=120) as svc:
        yield {"decode": svc.decode, "prefill": svc.prefill["grpc"], "kv": cfg.kv_addresses(0)[0]}


Call = Callable[[grpc.Channel, tuple[tuple[str, str], ...]], Any]

DECODE_CALLS: dict[str, Call] = {
    "Reserve": lambda ch, md: decode_pb2_grpc.DecodeStub(ch).Reserve(
        decode_pb2.ReserveRequest(request_id="intruder", prompt_len=4, max_tokens=4),
        metadata=md,
        timeout=5,
    ),
    "Generate": lambda ch, md: list(
        decode_pb2_grpc.DecodeStub(ch).Generate(
            decode_pb2.GenerateRequest(request_id="intruder"), metadata=md, timeout=5
        )
    ),
    "Abort": lambda ch, md: decode_pb2_grpc.DecodeStub(ch).Abort(
        decode_pb2.AbortRequest(request_id="intruder"), metadata=md, timeout=5
    ),
    "GetLoad": lambda ch, md: decode_pb2_grpc.DecodeStub(ch).GetLoad(
        common_pb2.Empty(), metadata=md, timeout=5
    ),
}
PREFILL_CALLS: dict[str, Call] = {
    "Prefill": lambda ch, md: prefill_pb2_grpc.PrefillStub(ch).Prefill(
        prefill_pb2.PrefillRequest(request_id="intruder", prompt_ids=[1, 2, 3]),
        metadata=md,
        timeout=5,
    ),
    "GetLoad": lambda ch, md: prefill_pb2_grpc.PrefillStub(ch).GetLoad(
        common_pb2.Empty(), metadata=md, timeout=5
    ),
}
KV_CALLS: dict[str, Call] = {
    "Push": lambda ch, md: kv_pb2_grpc.KvReceiverStub(ch).Push(
        iter([kv_pb2.KvChunk(header=kv_pb2.KvHeader(request_id="intruder"), rows=b"\0" * 64)]),
        metadata=md,
        timeout=5,
    ),
    # With the token these would join a torch group and block: the check must come first.
    "ConnectTorch": lambda ch, md: kv_pb2_grpc.KvReceiverStub(ch).ConnectTorch(
        kv_pb2.TorchPeer(peer="intruder"), metadata=md, timeout=5
    ),
    "ExpectTorch": lambda ch, md: kv_pb2_grpc.KvReceiverStub(ch).ExpectTorch(
        kv_pb2.KvHeader(request_id="intruder", peer="intruder"), metadata=md, timeout=5
    ),
}
CASES = [
    (server, name, call)
    for server, calls in (("decode", DECODE_CALLS), ("prefill", PREFILL_CALLS), ("kv", KV_CALLS))
    for name, call in calls.items()
]
BAD_METADATA = {
    "no token": (),
    "empty token": ((TOKEN_METADATA_KEY, ""),),
    "wrong token": ((TOKEN_METADATA_KEY, "s3cret-internal-tokeX"),),
    "token prefix": ((TOKEN_METADATA_KEY, TOKEN[:-1]),),
    "token plus suffix": ((TOKEN_METADATA_KEY, TOKEN + "x"),),
    "token under another key": (("authorization", f"Bearer {TOKEN}"),),
}


@pytest.mark.parametrize(("server", "method", "call"), CASES, ids=[f"{s}.{m}" for s, m, _ in CASES])
def test_calls_without_the_token_are_unauthenticated(
    servers: dict[str, str], server: str, method: str, call: Call
) -> None:
    with grpc.insecure_channel(servers[server], options=CHANNEL_OPTIONS) as channel:
        for label, metadata in BAD_METADATA.items():
            with pytest.raises(grpc.RpcError) as info:
                call(channel, metadata)
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED, (label, info.value)
            assert "internal token" in (info.value.details() or ""), label


def test_rejected_calls_did_nothing(servers: dict[str, str]) -> None:
    """The intruder's Reserve above allocated no blocks (the check precedes the work)."""

    async def check() -> None:
        client = DecodeClient(servers["decode"], TOKEN)
        try:
            load = await client.load()
            assert (load.reserved, load.blocks_used, load.running) == (0, 0, 0)
        finally:
            await client.close()

    asyncio.run(check())


def test_typed_clients_map_a_wrong_token_to_unauthorized(servers: dict[str, str]) -> None:
    async def check() -> None:
        decode, prefill = (
            DecodeClient(servers["decode"], "wrong"),
            PrefillClient(servers["prefill"], None),
        )
        try:
            with pytest.raises(Unauthorized, match="internal token"):
                await decode.load()
            with pytest.raises(Unauthorized, match="internal token"):
                await prefill.load()
        finally:
            await decode.close()
            await prefill.close()

    asyncio.run(check())


def test_with_the_token_a_request_runs_end_to_end(servers: dict[str, str]) -> None:
    """Router -> decode and prefill, and prefill -> the rank's KV receiver, all with TOKEN."""

    async def run() -> list[int]:
        decode = DecodeClient(servers["decode"], TOKEN)
        prefill = PrefillClient(servers["prefill"], TOKEN)
        try:
            prompt = list(range(3, 20))
            res = await decode.reserve("authorized", len(prompt), GREEDY.max_tokens)
            out = await prefill.prefill("authorized", prompt, GREEDY, res, transport="grpc")
            assert out.transfer_bytes > 0  # the KV receiver accepted the prefill's token
            tokens = [out.first_token.token_id]
            async for event in decode.generate("authorized", out.first_token, GREEDY):
                if event.token is not None:
                    tokens.append(event.token.token_id)
            assert (await decode.load()).blocks_used == 0
            return tokens
        finally:
            await decode.close()
            await prefill.close()

    assert len(asyncio.run(run())) == GREEDY.max_tokens

"""The gRPC sender's hand-built chunks are the protobuf messages they claim to be."""

from __future__ import annotations

import pytest
import torch

from common.kv.transfer import Shard, encode_chunks
from common.rpc.gen import kv_pb2


@pytest.mark.parametrize("chunk_bytes", [7, 1000, 1 << 20])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_encode_chunks_is_wire_identical_to_kvchunk(chunk_bytes: int, tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    shard = Shard(
        "req-1",
        1,
        torch.randn(3, tokens, 24, generator=g),
        torch.randn(3, tokens, 8, generator=g),
        16,
        (4, 9, 2),
        tuple(range(100, 100 + tokens)),
    )
    chunks = [kv_pb2.KvChunk.FromString(raw) for raw in encode_chunks(shard, chunk_bytes)]
    assert chunks[0].HasField("header") and chunks[0].header == shard.header()
    assert not any(c.HasField("header") for c in chunks[1:])
    payload = b"".join(c.data for c in chunks)
    expected = shard.n.numpy().tobytes() + shard.k_pe.numpy().tobytes()
    assert payload == expected
    assert all(len(c.data) <= chunk_bytes for c in chunks)
    # And byte for byte what protobuf itself would have sent for the first chunk.
    first = kv_pb2.KvChunk(header=shard.header(), data=chunks[0].data).SerializeToString()
    assert next(iter(encode_chunks(shard, chunk_bytes))) == first

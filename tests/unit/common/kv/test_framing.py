"""KvChunk framing without protobuf: what `encode_chunks` frames, `parse_chunk` reads back,
and both agree with protobuf byte for byte."""

from __future__ import annotations

import math

import pytest
import torch

from common.kv.framing import ROWS_FIELD, encode_chunks, parse_chunk
from common.kv.wire import TransferError
from common.rpc.gen import kv_pb2


def _header(blocks: int) -> bytes:
    """A serialized KvHeader; its length needs a 1-byte varint below 128 bytes, 2 above."""
    return kv_pb2.KvHeader(
        request_id="req", num_tokens=5, block_ids=list(range(1000, 1000 + blocks))
    ).SerializeToString()


@pytest.mark.parametrize("blocks", [1, 80])
@pytest.mark.parametrize("chunk_bytes", [1, 7, 127, 128, 20_000])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 20_000])
def test_parse_chunk_reads_back_what_encode_chunks_frames(
    blocks: int, chunk_bytes: int, size: int
) -> None:
    header = _header(blocks)
    payload = torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(size))
    data = payload.to(torch.uint8).numpy().tobytes()
    raws = list(encode_chunks(header, memoryview(data), chunk_bytes))
    assert len(raws) == max(1, math.ceil(size / chunk_bytes))
    parsed = [parse_chunk(raw) for raw in raws]
    assert parsed[0][0] == header and all(head is None for head, _, _ in parsed[1:])
    assert b"".join(bytes(rows) for _, _, rows in parsed) == data
    assert all(field == (ROWS_FIELD if len(rows) else 0) for _, field, rows in parsed)
    assert all(len(rows) <= chunk_bytes for _, _, rows in parsed)
    # Byte for byte what protobuf writes, and reads back.
    for raw, (_, _, rows) in zip(raws, parsed, strict=True):
        msg = kv_pb2.KvChunk.FromString(raw)
        assert msg.rows == bytes(rows)
        kept = kv_pb2.KvChunk(rows=msg.rows)
        if msg.HasField("header"):
            kept.header.CopyFrom(msg.header)
        assert kept.SerializeToString() == raw


def test_truncated_or_malformed_chunks_are_transfer_errors() -> None:
    [raw] = encode_chunks(_header(80), memoryview(b"x" * 300))
    for cut in (1, 2, len(raw) - 1):
        with pytest.raises(TransferError, match="truncated"):
            parse_chunk(raw[:cut])
    with pytest.raises(TransferError, match="malformed varint"):
        parse_chunk(b"\x80" * 11)
    with pytest.raises(TransferError, match="wire type"):
        parse_chunk(b"\x0b")  # field 1, wire type 3 (a group start)

"""The gRPC push's `KvChunk` framing, built and read without protobuf.

`KvReceiver.Push` streams a shard as serialized `KvChunk` messages: the first carries the
`KvHeader` (field 1), each a slice of the packed payload (`rows`, field 3). Protobuf would copy
the payload twice on each end (into the message, then into its serialization), and in a sender
whose GIL drives every rank's stream those copies are the cost. Here a chunk is framed around a
view of the payload (`encode_chunks`: one copy) and read back as a view of the received bytes
(`parse_chunk`: none), byte for byte what protobuf writes.
"""

from __future__ import annotations

from collections.abc import Iterator

from common.kv.wire import TransferError

CHUNK_BYTES = 2**20
HEADER_FIELD = 1  # KvChunk.header
ROWS_FIELD = 3  # KvChunk.rows
# KvChunk's retired `data` field (reserved): senders that predate packed rows put their
# payload there, and `Push` rejects it by number instead of mistaking it for rows.
_RETIRED_DATA_FIELD = 2
_LENGTH_DELIMITED = 2  # protobuf wire type of bytes and messages


def _tag(field_no: int) -> bytes:
    return _varint(field_no << 3 | _LENGTH_DELIMITED)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):  # a varint has at most 10 bytes
        if pos >= len(view):
            raise TransferError("truncated KvChunk")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise TransferError("malformed varint in KvChunk")


def encode_chunks(
    header: bytes, payload: memoryview, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes]:
    """Serialized `KvChunk`s: the first with `header` (a serialized `KvHeader`), each with
    the next `chunk_bytes` of `payload`. An empty payload still sends its header."""
    head = _tag(HEADER_FIELD) + _varint(len(header)) + header
    rows_tag = _tag(ROWS_FIELD)
    for start in range(0, len(payload), chunk_bytes):
        data = payload[start : start + chunk_bytes]
        prefix = rows_tag + _varint(len(data))
        yield b"".join((head, prefix, data) if start == 0 else (prefix, data))
    if not len(payload):
        yield head


def parse_chunk(raw: bytes) -> tuple[bytes | None, int, memoryview]:
    """A serialized `KvChunk` read without protobuf: (serialized header or None, payload field
    number (0: none), payload as a view of `raw`). Protobuf would copy the payload twice."""
    view = memoryview(raw)
    header: list[bytes] = []
    field_no, payload = 0, view[:0]
    pos = 0
    while pos < len(view):  # bounded: every field advances pos
        key, pos = _read_varint(view, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _read_varint(view, pos)
            if pos + length > len(view):
                raise TransferError("truncated KvChunk")
            if number == HEADER_FIELD:  # repeated occurrences of a message field merge
                header.append(bytes(view[pos : pos + length]))
            elif number in (_RETIRED_DATA_FIELD, ROWS_FIELD):
                field_no, payload = number, view[pos : pos + length]
            pos += length
        else:
            raise TransferError(f"unsupported wire type {wire_type} in KvChunk")
    if pos != len(view):
        raise TransferError("truncated KvChunk")
    return (b"".join(header) if header else None), field_no, payload

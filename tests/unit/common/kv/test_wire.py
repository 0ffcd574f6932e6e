"""The KV wire: hand-built chunks are the protobuf messages they claim to be, and every way a
payload lands in the paged cache (in place, staged) writes exact bytes."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from common.kv import wire
from common.kv.framing import parse_chunk
from common.kv.paged_cache import CacheLayout, PagedLatentCache
from common.kv.receiver import KvReceiverServicer, ShardTarget
from common.kv.transfer import Shard, TransferError, cut_shard
from common.kv.wire import shard_segments, shard_slots
from common.messages import KvTargetInfo
from common.rpc.gen import kv_pb2


def _shard(
    tokens: int, block_ids: tuple[int, ...], dtype: torch.dtype = torch.float32, **kw: Any
) -> Shard:
    g = torch.Generator().manual_seed(tokens)
    # Random bytes, not random numbers: every bit pattern (NaNs included) must survive.
    kv = torch.randint(0, 256, (3, tokens, 160), generator=g).to(torch.uint8).view(dtype)
    return Shard("req-1", 0, kv, 24 * 4 // dtype.itemsize, 16, block_ids, **kw)


@pytest.mark.parametrize("chunk_bytes", [7, 1000, 1 << 20])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_encode_chunks_is_wire_identical_to_kvchunk(chunk_bytes: int, tokens: int) -> None:
    shard = _shard(tokens, (4, 9, 2))
    chunks = [kv_pb2.KvChunk.FromString(raw) for raw in shard.chunks(chunk_bytes)]
    assert chunks[0].HasField("header") and chunks[0].header == shard.header()
    assert not any(c.HasField("header") for c in chunks[1:])
    assert b"".join(c.rows for c in chunks) == shard.kv.numpy().tobytes()
    assert all(len(c.rows) <= chunk_bytes for c in chunks)
    # And byte for byte what protobuf itself would have sent for the first chunk.
    first = kv_pb2.KvChunk(header=shard.header(), rows=chunks[0].rows).SerializeToString()
    assert next(iter(shard.chunks(chunk_bytes))) == first


def _retired_data_chunk(header: kv_pb2.KvHeader, data: bytes) -> bytes:
    """A chunk as senders of the retired split layout built it: payload in field 2."""
    head = header.SerializeToString()
    return b"\x0a" + bytes([len(head)]) + head + b"\x12" + bytes([len(data)]) + data


def test_parse_chunk_reads_what_protobuf_writes() -> None:
    header = kv_pb2.KvHeader(request_id="r", num_tokens=3, block_ids=[1, 2])
    for msg in (
        kv_pb2.KvChunk(header=header, rows=b"abc"),
        kv_pb2.KvChunk(rows=b"\x00" * 300),
        kv_pb2.KvChunk(header=header),
        kv_pb2.KvChunk(),
    ):
        head, field_no, payload = parse_chunk(msg.SerializeToString())
        assert (kv_pb2.KvHeader.FromString(head) if head is not None else None) == (
            msg.header if msg.HasField("header") else None
        )
        assert bytes(payload) == msg.rows
        assert field_no == (3 if msg.rows else 0)
    head, field_no, payload = parse_chunk(_retired_data_chunk(header, b"abc"))
    assert head is not None and (field_no, bytes(payload)) == (2, b"abc")
    with pytest.raises(TransferError):
        parse_chunk(kv_pb2.KvChunk(rows=b"xyz").SerializeToString()[:-1])


def test_cut_shard_packs_n_and_k_pe() -> None:
    n = [torch.randn(5, 6) for _ in range(2)]
    k_pe = [torch.randn(5, 3) for _ in range(2)]
    target = KvTargetInfo(1, "", "", 2, 4, (0,))
    shard = cut_shard(n, k_pe, 1, 4, target, "r", 16)
    assert torch.equal(shard.n, torch.stack([x[1:4, 2:6] for x in n]))
    assert torch.equal(shard.k_pe, torch.stack([x[1:4] for x in k_pe]))
    assert shard.kv.is_contiguous() and shard.ready is None  # an event only on a GPU


class _Sink:
    def __init__(self, cache: PagedLatentCache) -> None:
        self.cache = cache
        self.written: list[float] = []

    def __call__(self, header: kv_pb2.KvHeader) -> ShardTarget:
        return ShardTarget(self.cache, shard_slots(header), self.written.append)


def _cache(shard: Shard, dtype: torch.dtype | None = None, blocks: int = 300) -> PagedLatentCache:
    w = shard.latent_width
    lay = CacheLayout(3, w, shard.kv.shape[2] - w, 16, dtype or shard.kv.dtype)
    return PagedLatentCache(lay, blocks)


def _assert_landed(cache: PagedLatentCache, shard: Shard) -> None:
    slots = shard_slots(shard.header())
    expected = shard.kv.to(cache.kv.dtype)
    assert cache.kv[:, slots].view(torch.uint8).numpy().tobytes() == (
        expected.view(torch.uint8).numpy().tobytes()
    )


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segment sizes scaled to the tests' small shards, so runs go direct and get cut."""
    monkeypatch.setattr(wire, "SEGMENT_BYTES", 64 * 2**10)
    monkeypatch.setattr(wire, "DIRECT_MIN_BYTES", 16 * 2**10)


SCATTERED = tuple(range(101, 300, 2))  # every other block: no two blocks adjacent
CONTIGUOUS = tuple(range(100))  # one run: rows are received in place


@pytest.mark.parametrize(
    ("tokens", "blocks"),
    [
        (0, (3,)),
        (37, (4, 9, 2)),  # partial last block, rows move one by one (gcd(37, 16) = 1)
        (1600, SCATTERED),
        (1600, CONTIGUOUS),  # direct segments, cut at SEGMENT_BYTES
        (1000, CONTIGUOUS[:30] + SCATTERED[:40]),  # direct and staged in each layer
    ],
)
@pytest.mark.parametrize("chunk_bytes", [1000, 1 << 20])
@pytest.mark.usefixtures("small_segments")
def test_grpc_push_lands_exact_bytes(
    tokens: int, blocks: tuple[int, ...], chunk_bytes: int
) -> None:
    shard = _shard(tokens, blocks)
    cache = _cache(shard)
    sink = _Sink(cache)
    received = KvReceiverServicer(sink, None)._push(iter(shard.chunks(chunk_bytes)))
    assert received == shard.nbytes and len(sink.written) == 1
    _assert_landed(cache, shard)


@pytest.mark.usefixtures("small_segments")
def test_segments_tile_the_payload_and_direct_ones_are_runs() -> None:
    shard = _shard(1000, CONTIGUOUS[:30] + SCATTERED[:40])
    header = shard.header()
    cut = shard_segments(header)
    rows = [(s.start, s.stop) for s in cut.segments]
    assert rows[0][0] == 0 and rows[-1][1] == 3 * 1000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))
    row_bytes = shard.kv.shape[2] * 4
    direct = [s for s in cut.segments if s.direct]
    assert direct and all((s.stop - s.start) * row_bytes <= wire.SEGMENT_BYTES for s in direct)
    slots = shard_slots(header)
    for s in direct:
        layer = s.start // 1000
        local = slots[s.start - layer * 1000 : s.stop - layer * 1000]
        assert torch.equal(local, torch.arange(int(local[0]), int(local[0]) + len(local)))
    assert len(direct) == 3 * 2  # the 30-block run of each layer, cut in two segments


@pytest.mark.usefixtures("small_segments")
def test_wire_dtype_other_than_the_cache_is_converted() -> None:
    shard = _shard(1600, CONTIGUOUS, dtype=torch.bfloat16)
    shard = Shard("r", 0, shard.kv.float().bfloat16(), shard.latent_width, 16, CONTIGUOUS)
    cache = _cache(shard, torch.float32)
    KvReceiverServicer(_Sink(cache), None)._push(iter(shard.chunks()))
    _assert_landed(cache, shard)


def test_bad_pushes_are_rejected() -> None:
    shard = _shard(37, (4, 9, 2))
    chunks = list(shard.chunks(1000))
    servicer = KvReceiverServicer(_Sink(_cache(shard)), None)
    with pytest.raises(TransferError, match="bytes, header says"):
        servicer._push(iter(chunks[:-1]))
    with pytest.raises(TransferError, match="no header"):
        servicer._push(iter(chunks[1:]))
    # A sender of the retired split layout: its payload field is refused, not taken for rows.
    with pytest.raises(TransferError, match="field 2"):
        servicer._push(iter([_retired_data_chunk(shard.header(), b"\0" * 8)]))


def test_write_all_layers_matches_the_reference() -> None:
    for dtype, (w, d_r) in ((torch.bfloat16, (256, 64)), (torch.float32, (5, 3))):
        cache = PagedLatentCache(CacheLayout(2, w, d_r, 16, dtype), 20)
        ref = PagedLatentCache(CacheLayout(2, w, d_r, 16, dtype), 20)
        slots = torch.tensor([5, 17, 18, 100, 3])
        n, k_pe = torch.randn(2, 5, w).to(dtype), torch.randn(2, 5, d_r).to(dtype)
        cache.write_all_layers(slots, n, k_pe)
        ref.n[:, slots], ref.k_pe[:, slots] = n, k_pe
        assert torch.equal(cache.kv, ref.kv)

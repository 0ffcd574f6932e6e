"""The packed KV payload: its segments, and its pipelined landing in the paged cache.

A packed payload is a shard's cache rows, kv [L, N, w + d_r] (n and k_pe adjacent per token,
as `PagedLatentCache.kv` stores them), flattened over layers: row l * N + t is token t of
layer l. Both ends cut it into the same segments (`cut_segments`), so a transport that frames
messages (gloo p2p) sends one message per segment, and one that streams bytes (gRPC) fills them
in order:

* a direct segment lies in one run of consecutive cache slots of one layer: it is received
  straight into the cache, with no copy besides the transport's own (when the transport's
  buffers live where the cache does: host memory for gRPC and gloo, the GPU for NCCL);
* a staged segment (rows of scattered blocks) is received into a staging buffer and written
  by `ShardWriter` while the next segments arrive, so the cache write overlaps the transfer
  instead of following it.

The `KvHeader` that precedes a payload says what it holds (dtype, shape) and where it goes
(its block table: tokens 0..N-1 fill the blocks in order, from slot `block_offset` of the
first); the functions at the end of this module read it the same way on both ends, and
raise `TransferError` on a header the rank cannot take.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from common.kv.paged_cache import PagedLatentCache
from common.kv.slots import token_slots
from common.rpc.gen import kv_pb2

SEGMENT_BYTES = 4 * 2**20
# A run of slots shorter than this is cheaper to stage and scatter than to receive as a
# message of its own (every gloo message pays a round trip to match its receive).
DIRECT_MIN_BYTES = 256 * 2**10
# `KvHeader.dtype` names. Defined here, with TransferError, because the header checks below
# need them and `common.kv.transfer` imports this module (it re-exports both).
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "uint8": torch.uint8,  # packed rows: fp8 indexer keys with their scales
}


class TransferError(RuntimeError):
    pass


@dataclass(frozen=True)
class Segment:
    start: int  # first payload row
    stop: int
    direct: bool


@dataclass(frozen=True)
class ShardSegments:
    """How a shard's packed rows are cut into the segments that both ends of a transfer
    agree on, and which cache slots they go to: rows move in groups of `group` consecutive
    tokens (a group never straddles a block, so its rows are consecutive cache slots)."""

    num_layers: int
    num_tokens: int
    group: int
    group_slots: Tensor  # [N / group] first cache slot of each group of a layer
    segments: tuple[Segment, ...]

    def layer_slot(self, row: int) -> tuple[int, int]:
        """(layer, cache slot) of payload row `row`, which must start a group."""
        layer, token = divmod(row, self.num_tokens)
        return layer, int(self.group_slots[token // self.group])

    def dest_groups(self, slots_per_layer: int) -> Tensor:
        """Index of every payload group in the cache's kv viewed as [L * S / group, ...]."""
        layers = torch.arange(self.num_layers, dtype=torch.int64)[:, None]
        per_layer = slots_per_layer // self.group
        return (layers * per_layer + self.group_slots[None] // self.group).reshape(-1)


def cut_segments(
    num_layers: int,
    slots: Tensor,
    block_size: int,
    row_bytes: int,
    block_offset: int = 0,
) -> ShardSegments:
    """Cut a packed payload of `num_layers` x len(slots) rows into segments.

    Sender and receiver call it with the same header-derived arguments (`row_bytes` in the
    wire dtype), so they agree on every message's size.
    """
    n = len(slots)
    # Tokens 0..N-1 fill blocks in order from slot `block_offset` of the first, so groups of
    # gcd(N, block_size, block_offset) tokens sit in one block and never cross a layer.
    group = 1 if n == 0 else math.gcd(n, block_size, block_offset)
    group_slots = slots[::group].to(torch.int64).contiguous()
    if n == 0:
        return ShardSegments(num_layers, n, group, group_slots, ())
    step = max(SEGMENT_BYTES // (row_bytes * group), 1) * group
    # Runs of groups whose slots follow each other.
    breaks = torch.nonzero(group_slots[1:] != group_slots[:-1] + group).flatten() + 1
    edges = [0, *(breaks * group).tolist(), n]
    runs = list(itertools.pairwise(edges))
    long_run = max(hi - lo for lo, hi in runs) * row_bytes >= DIRECT_MIN_BYTES
    segments: list[Segment] = []
    if not long_run:
        # Everything is staged: cut the whole payload evenly, across layers.
        total = num_layers * n
        segments = [Segment(s, min(s + step, total), False) for s in range(0, total, step)]
        return ShardSegments(num_layers, n, group, group_slots, tuple(segments))
    for layer in range(num_layers):
        base = layer * n
        staged_from = base
        for lo, hi in runs:
            if (hi - lo) * row_bytes < DIRECT_MIN_BYTES:
                continue
            segments += _cut(staged_from, base + lo, step, False)
            segments += _cut(base + lo, base + hi, step, True)
            staged_from = base + hi
        segments += _cut(staged_from, base + n, step, False)
    return ShardSegments(num_layers, n, group, group_slots, tuple(segments))


def _cut(start: int, stop: int, step: int, direct: bool) -> list[Segment]:
    return [Segment(s, min(s + step, stop), direct) for s in range(start, stop, step)]


class StagingPool:
    """Reusable staging buffers shared by a receiver's transfers: a fresh multi-MB buffer per
    shard would pay its page faults (or its pinning, or its device allocation) every time,
    which costs about as much as the copy. Buffers live on one device; host buffers are
    pinned when they feed asynchronous copies into a GPU cache."""

    def __init__(self) -> None:
        self._free: dict[tuple[str, bool], list[Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device, pinned: bool = False) -> Tensor:
        """A flat uint8 buffer of at least `nbytes` bytes on `device` (give it back when
        nothing reads or writes it any more)."""
        with self._lock:
            free = self._free.setdefault((str(device), pinned), [])
            fits = [i for i, buf in enumerate(free) if buf.numel() >= nbytes]
            if fits:  # the smallest that fits, so one large shard's buffer is not taken by many
                return free.pop(min(fits, key=lambda i: free[i].numel()))
        size = max(nbytes, SEGMENT_BYTES)
        return torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pinned)

    def give(self, buf: Tensor) -> None:
        with self._lock:
            self._free.setdefault((str(buf.device), buf.is_pinned()), []).append(buf)


class ShardWriter:
    """Writes one packed payload's segments into the cache as they arrive.

    A direct segment is received in place (`cache_bytes`) when the transport's buffers live
    where the cache does and in its dtype; every other segment is received into staging and
    handed to `write`. The caller receives later segments meanwhile (gloo's IO thread, NCCL's
    stream and grpc's core keep the bytes moving while this thread writes, and torch's copy
    releases the GIL), so the write overlaps the transfer instead of following it.

    On a GPU cache every write is queued on the caller's current stream and nothing here
    waits for the device: host bytes go up by asynchronous copies (from pinned staging), and
    the scatter into the blocks follows on the same stream. The receiver waits once per shard.
    """

    def __init__(
        self,
        cache: PagedLatentCache,
        cut: ShardSegments,
        wire_dtype: torch.dtype,
        recv_device: torch.device,
    ) -> None:
        self.cache, self.cut, self.dtype = cache, cut, wire_dtype
        self.width = cache.kv.shape[-1]
        self.row_bytes = self.width * torch.empty((), dtype=wire_dtype).element_size()
        self._in_place = wire_dtype == cache.kv.dtype and recv_device == cache.kv.device
        dest = cut.dest_groups(cache.kv.shape[1])
        self._host_cache = cache.kv.is_cpu
        if not self._host_cache:
            groups = cache.kv.numel() // (cut.group * self.width)
            if len(dest) and (int(dest.min()) < 0 or int(dest.max()) >= groups):
                raise TransferError("shard addresses blocks outside this rank's pool")
            # Checked here on the host, once: the device scatter below does not check again
            # (that would wait for the device on every segment).
            dest = dest.pin_memory().to(cache.kv.device, non_blocking=True)
        self._dest = dest
        self.seconds = 0.0  # time spent writing (on a GPU: queueing) staged rows

    def nbytes(self, seg: Segment) -> int:
        return (seg.stop - seg.start) * self.row_bytes

    def in_place(self, seg: Segment) -> bool:
        return seg.direct and self._in_place

    def cache_bytes(self, seg: Segment) -> Tensor:
        """The cache rows an in-place segment is received into, as flat uint8."""
        layer, slot = self.cut.layer_slot(seg.start)
        rows = self.cache.rows_at(layer, slot, slot + seg.stop - seg.start)
        return rows.view(-1).view(torch.uint8)

    def write(self, seg: Segment, buf: Tensor) -> None:
        """Store a staged segment's bytes (flat uint8, `nbytes(seg)` long, on the host or on
        the cache's device) in the cache."""
        t0 = time.perf_counter()
        g = self.cut.group
        groups = self._dest[seg.start // g : seg.stop // g]
        if self._host_cache:
            rows = buf.view(self.dtype).view(-1, self.width)
            self.cache.write_row_groups(groups, rows, g)
        else:
            buf = buf.to(self.cache.kv.device, non_blocking=True)
            rows = buf.view(self.dtype).to(self.cache.kv.dtype).view(-1, g * self.width)
            self.cache.kv.view(-1, g * self.width).index_copy_(0, groups, rows)
        self.seconds += time.perf_counter() - t0


# -- the header ----------------------------------------------------------------------------------


def shard_slots(header: kv_pb2.KvHeader) -> Tensor:
    """Flat cache slots of the shard's tokens 0..N-1, from its block table (token 0 at slot
    `block_offset` of the first block)."""
    positions = torch.arange(header.num_tokens) + header.block_offset
    blocks = torch.tensor(list(header.block_ids), dtype=torch.int64)
    index = positions // header.block_size
    if len(positions) and int(index.max()) >= len(blocks):
        raise TransferError(
            f"shard of {header.num_tokens} tokens overflows its {len(blocks)} reserved blocks"
        )
    return token_slots(blocks, positions, header.block_size)


def check_dtype(h: kv_pb2.KvHeader) -> torch.dtype:
    if h.dtype not in DTYPES:
        raise TransferError(f"unknown dtype {h.dtype!r}")
    return DTYPES[h.dtype]


def row_bytes(h: kv_pb2.KvHeader) -> int:
    """Bytes of one token of one layer (n and k_pe) on the wire."""
    item = torch.empty((), dtype=check_dtype(h)).element_size()
    return (h.latent_width + h.rope_width) * item


def payload_bytes(h: kv_pb2.KvHeader) -> int:
    return h.num_layers * h.num_tokens * row_bytes(h)


def shard_segments(h: kv_pb2.KvHeader, slots: Tensor | None = None) -> ShardSegments:
    """The segments of a packed payload with header `h`, as both ends cut it."""
    slots = shard_slots(h) if slots is None else slots
    return cut_segments(h.num_layers, slots, h.block_size, row_bytes(h), h.block_offset)

"""Decode ranks' KV endpoints that record what arrives, and the KV targets a decode group of
each layout hands out: for tests of what prefill workers ship, without a decode group."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc
import torch.distributed as dist

from common.kv.paged_cache import CacheLayout, PagedLatentCache
from common.kv.receiver import KvReceiverServicer, ShardTarget, add_kv_receiver
from common.kv.wire import check_dtype, shard_slots
from common.messages import KvTargetInfo
from common.parallel import ParallelConfig
from common.rpc.gen import kv_pb2
from common.runtime.ports import free_port

# `targets` hands decode rank r the blocks BLOCK_SPAN * r + (0 .. BLOCKS - 1).
BLOCK_SPAN, BLOCKS = 100, 8


class Receivers:
    """Every decode rank's KV endpoint: a cache per (request, rank), made to the shard's
    shape as its first shard arrives (a prompt shipped in chunks: every chunk lands in it)."""

    def __init__(self, torch_pairs: bool = False, address: str = "") -> None:
        self.caches: dict[tuple[str, int], PagedLatentCache] = {}
        self.index_caches: dict[tuple[str, int], PagedLatentCache] = {}  # DSA: indexer keys
        self._lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(max_workers=8))
        store, self.torch_address = None, ""
        if torch_pairs:  # the torch transport's pairs meet in this store
            port = free_port()
            store = dist.TCPStore(
                "127.0.0.1", port, is_master=True, wait_for_workers=False,
                timeout=timedelta(seconds=30),
            )  # fmt: skip
            self.torch_address = f"127.0.0.1:{port}"
        self._store = store
        add_kv_receiver(KvReceiverServicer(self._sink, store, timeout_s=30), self.server)
        self.address = address or f"127.0.0.1:{free_port()}"
        self.server.add_insecure_port(self.address)
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=0)

    def _sink(self, header: kv_pb2.KvHeader) -> ShardTarget:
        layout = CacheLayout(
            header.num_layers,
            header.latent_width,
            header.rope_width,
            header.block_size,
            check_dtype(header),
        )
        key = (header.request_id, header.rank)
        caches = self.index_caches if header.index_keys else self.caches
        with self._lock:
            cache = caches.get(key)
            if cache is None:  # every block `targets` names, and the cache's trash block
                cache = PagedLatentCache(layout, BLOCK_SPAN * header.rank + BLOCKS + 1, "cpu")
                caches[key] = cache
        return ShardTarget(cache, shard_slots(header))


def targets(
    mode: str,
    tp: int,
    d_c: int,
    prompt_len: int,
    cached: int,
    address: str,
    torch_address: str = "",
) -> tuple[KvTargetInfo, ...]:
    """What a decode group of this layout names (services/decode/leader/kv_targets.py)."""
    par = ParallelConfig.parse(mode, tp, latent_groups=2, chunk_size=8)
    targets = []
    for rank in range(tp):
        cols = par.latent_columns(rank, d_c)
        ranges = par.token_ranges(rank, cached, prompt_len)
        blocks = tuple(range(BLOCK_SPAN * rank, BLOCK_SPAN * rank + BLOCKS))
        targets.append(
            KvTargetInfo(
                rank, address, torch_address, cols.start, cols.stop - cols.start, blocks, ranges
            )
        )
    return tuple(targets)

"""Prefix caching: block hashes over token runs, and the index of blocks a pool keeps cached.

Pure Python (no torch): the decode leader's pools, the router and the prefill worker share it.

A prompt's full blocks are named by a hash chain: block b's hash covers its parent's hash and
its own `block_size` token ids, and the chain's root covers the model and the latent basis
(`model_identity`), so two groups that serve different weights or side files never agree on
a hash. Only full blocks are named; a request's trailing partial block is never shared.

Cached block lifecycle, inside one `BlockPool`:
    IN_USE (live references) --last reference released, block indexed--> CACHED (evictable)
    CACHED --a new request's prefix matches--> IN_USE again (no copy, no transfer)
    CACHED --the pool needs room (least recently used first)--> FREE (unindexed)
A block with live references is never evicted: only CACHED blocks are in the LRU.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.loading.side_file_choice import resolve_reparam, side_file_path

_DIGEST_BYTES = 8  # 64-bit hashes: compact to publish, collisions negligible at cache sizes
# Block hashes a worker publishes for KV-aware routing, at most: its most recently used
# prefixes. Bounded so its registry record stays small (17 bytes of hex each, ~70 KB) while
# covering a few thousand blocks, tens of thousands of prompt tokens.
PUBLISHED_HASHES = 4096


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest(), "little")


def root_hash(*parts: str | bytes) -> int:
    """The chain's root from identity parts (model files, side file, anything that changes
    what a block's latents are)."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=b"tpla-prefix")
    for part in parts:
        raw = part.encode() if isinstance(part, str) else part
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return int.from_bytes(h.digest(), "little")


def model_identity(model_dir: str | Path, reparam: str | None) -> int:
    """The root for a model directory and its side file: config.json's bytes, each weight
    file's name and size (hashing hundreds of GB of weights at start-up would take minutes),
    and the side file's bytes (its rotation decides the latent basis)."""
    root = Path(model_dir)
    parts: list[str | bytes] = []
    config = root / "config.json"
    parts.append(config.read_bytes() if config.is_file() else str(root.resolve()).encode())
    for weights in sorted(root.glob("*.safetensors")):
        parts.append(f"{weights.name}:{weights.stat().st_size}")
    name = resolve_reparam(root, reparam)  # TPLA_REPARAM's values, as the loader reads them
    if name is not None:
        parts.append(b"side-file:" + side_file_path(root, name).read_bytes())
    else:
        parts.append(b"side-file:none")
    return root_hash(*parts)


def block_hashes(root: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hash of every full block of `token_ids` (a trailing partial block has none)."""
    out: list[int] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        run = token_ids[start : start + block_size]
        data = parent.to_bytes(_DIGEST_BYTES, "little") + b"".join(
            int(t).to_bytes(4, "little", signed=True) for t in run
        )
        parent = _digest(data)
        out.append(parent)
    return out


def format_hashes(hashes: Sequence[int]) -> str:
    """Hashes as published in a worker record: hex, comma-separated."""
    return ",".join(f"{h:x}" for h in hashes)


def parse_hashes(text: str) -> frozenset[int]:
    return frozenset(int(h, 16) for h in text.split(",") if h)


@dataclass(frozen=True)
class PublishedPrefixes:
    """What a worker published of its cache: its chain root, block size and block hashes."""

    root: int = 0
    block_size: int = 0
    hashes: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, root: str, block_size: int, hashes: str) -> PublishedPrefixes:
        return cls(int(root, 16) if root else 0, block_size, parse_hashes(hashes))

    def cached_tokens(self, prompt: Sequence[int], chains: dict[tuple[int, int], list[int]]) -> int:
        """Leading tokens of `prompt` this worker holds (whole blocks); `chains` memoizes the
        prompt's hash chain per (root, block size) across the workers of one decision."""
        if not self.hashes or self.block_size < 1:
            return 0
        key = (self.root, self.block_size)
        if key not in chains:
            chains[key] = block_hashes(self.root, prompt, self.block_size)
        count = 0
        for h in chains[key]:
            if h not in self.hashes:
                break
            count += 1
        return count * self.block_size


class PrefixIndex:
    """One pool's cached blocks: hash -> block, and the LRU of those nobody references.

    The pool owns the reference counts; it tells the index when a block's last reference
    goes (`park`) or comes back (`unpark`), and asks it for a block to reuse (`evict`).
    """

    def __init__(self) -> None:
        self._block_of: OrderedDict[int, int] = OrderedDict()  # hash -> block, oldest use first
        self._hash_of: dict[int, int] = {}  # block -> hash
        self._lru: OrderedDict[int, None] = OrderedDict()  # parked blocks, oldest first

    def __len__(self) -> int:
        return len(self._block_of)

    def __contains__(self, block: object) -> bool:
        return block in self._hash_of

    @property
    def num_parked(self) -> int:
        """Cached blocks no live request references: free to evict."""
        return len(self._lru)

    def get(self, block_hash: int) -> int | None:
        return self._block_of.get(block_hash)

    def touch(self, hashes: Sequence[int]) -> None:
        """Mark a matched chain as just used, children first so that parents always rank as
        recent as their children (a bounded `recent` then never lists a child without its
        parent)."""
        for h in reversed(hashes):
            if h in self._block_of:
                self._block_of.move_to_end(h)

    def insert(self, block_hash: int, block: int) -> bool:
        """Index a full, written block; False when the hash or the block is indexed already
        (two requests prefilled the same prefix at once: the first one's block stays)."""
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def park(self, block: int) -> None:
        """The block's last reference went: it stays cached, evictable, most recent last."""
        assert block in self._hash_of, f"block {block} is not cached"
        self._lru[block] = None

    def unpark(self, block: int) -> None:
        """A request references the parked block again: no longer evictable."""
        del self._lru[block]

    def evict(self) -> int:
        """Drop the least recently released parked block from the index and return it."""
        block, _ = self._lru.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block

    def recent(self, limit: int) -> list[int]:
        """Up to `limit` indexed hashes, most recently used first (what a group publishes)."""
        out: list[int] = []
        for h in reversed(self._block_of):
            if len(out) >= limit:
                break
            out.append(h)
        return out

    def blocks(self) -> Iterator[int]:
        return iter(self._hash_of)

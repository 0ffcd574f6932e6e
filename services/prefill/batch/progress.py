"""A prompt's progress through the prefill worker's batches, at most one chunk per batch.

Lifecycle: queued (`started` False; it counts as `piece()` tokens against a batch's budget)
-> started in its first batch, where its longest cached prefix becomes its `past` and `done`
-> each batch computes its next piece, at most `chunk` tokens, over everything before it ->
finished with the piece holding the last token, whose logits give the first token. A prompt
that fits one piece never copies its latents; a longer one appends each piece's to a buffer
of the whole prompt (the cached prefix first), which is the next piece's past, feeds the
prefix cache block by block and is what ships at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from common.model.causal_lm import PastLatents, PrefillOutput
from common.runtime.heap import trim_heap
from common.sampling.sampler import SampledToken
from services.prefill.batch.latent_cache import LatentPrefixCache
from services.prefill.shipping import PromptSends


class PromptProgress:
    def __init__(self, length: int, chunk: int) -> None:
        """`length` prompt tokens in pieces of at most `chunk` (0: one piece, however long)."""
        if chunk < 0:
            raise ValueError("chunk must be >= 0")
        self.length, self.chunk = length, chunk
        self.started = False
        self.hashes: list[int] = []  # the prompt's full blocks, for the prefix cache
        self.cached = 0  # leading tokens taken from the prefix cache
        self.done = 0  # tokens whose latents exist (cached or computed)
        self.seconds = 0.0  # the prefill time of the batches that computed its pieces
        self.counted = length  # tokens still counted in the worker's queued tokens
        self.logprobs: tuple[SampledToken, ...] = ()  # the prompt's, when asked, so far
        self.sends = PromptSends()  # its KV pushes, a round per shipped chunk
        self._past: PastLatents | None = None  # the cache hit, before any piece
        self._n: list[Tensor] = []  # per layer [length, d_c], once it takes several pieces
        self._k_pe: list[Tensor] = []
        self._keys: list[Tensor] = []  # DSA: per full layer [length, d_I]

    def start(self, hashes: list[int], past: PastLatents | None) -> None:
        """Begin after the cached prefix `past` (None: from position 0)."""
        self.started, self.hashes, self._past = True, hashes, past
        self.cached = self.done = past.length if past is not None else 0

    @property
    def left(self) -> int:
        return self.length - self.done

    def piece(self) -> int:
        """Tokens the next batch computes for this prompt."""
        return min(self.left, self.chunk) if self.chunk else self.left

    @property
    def whole(self) -> bool:
        """Whether the prompt is computed in one piece (after its cached prefix)."""
        return self.done == self.cached and self.piece() == self.left

    def past(self) -> PastLatents | None:
        """What the next piece attends over: the cache hit, then the pieces computed."""
        if not self._n:
            return self._past
        done = self.done
        return PastLatents(
            [n[:done] for n in self._n],
            [k[:done] for k in self._k_pe],
            [k[:done] for k in self._keys],
        )

    def add(
        self, n: list[Tensor], k_pe: list[Tensor], row: int, keys: Sequence[Tensor] = ()
    ) -> None:
        """Keep the piece just computed: rows row..row + piece() of each layer's n / k_pe
        (and of each full layer's indexer keys, DSA)."""
        size = self.piece()
        if not self._n:
            self._n = [_buffer(x, self.length) for x in n]
            self._k_pe = [_buffer(x, self.length) for x in k_pe]
            self._keys = [_buffer(x, self.length) for x in keys]
            if self._past is not None:
                past = self._past
                held = past.n + past.k_pe + past.index_keys
                for buf, x in zip(self._buffers, held, strict=True):
                    buf[: self.cached] = x
        for buf, x in zip(self._buffers, [*n, *k_pe, *keys], strict=True):
            buf[self.done : self.done + size] = x[row : row + size]
        self.done += size

    @property
    def _buffers(self) -> list[Tensor]:
        return self._n + self._k_pe + self._keys

    def advance(self, out: PrefillOutput, row: int, cache: LatentPrefixCache | None) -> None:
        """Take the piece just computed, rows row..row + piece() of `out`: a prompt computed
        whole stores its new blocks straight from `out`; a chunked one keeps the piece in its
        buffer and stores the blocks it filled. Every rank of a prefill group calls this in
        the same order, so their cache replicas stay identical."""
        before = self.done
        if self.whole:
            if cache is not None:
                cache.store(self.hashes, out.n, out.k_pe, before, row, out.index_keys)
            self.done += self.piece()
            return
        self.add(out.n, out.k_pe, row, out.index_keys)
        if cache is not None:
            self.store(cache, before)

    def release(self) -> None:
        """Drop the prompt's latents: it is finished or dropped (the worker calls this for
        every prompt that leaves a batch with no pieces left), while the worker's last batch
        and its sends' callbacks still reference it. A chunked prompt's pieces also left their
        temporaries free in the C heap, which glibc keeps for reuse: they go back to the OS
        here (`trim_heap`). Measured on a worker over the bench's long-context model, 1 s
        after each 16K prompt: 40-56 MiB above the baseline stayed resident without the trim,
        2-7 MiB with it."""
        held = bool(self._n)
        self._past, self._n, self._k_pe, self._keys = None, [], [], []
        if held:
            trim_heap()

    def store(self, cache: LatentPrefixCache, before: int) -> None:
        """Put the full blocks finished since position `before` into the prefix cache."""
        bs = cache.block_size
        first = before // bs * bs  # the block `before` ends inside was not full then
        hashes = self.hashes[: self.done // bs]
        cache.store(hashes, self._n, self._k_pe, first, first, self._keys)

    def unshipped(
        self, out: PrefillOutput, row: int, skip: int
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Per layer, the finished prompt's latents from position `skip` (the decode group
        holds the rest) to its end, and per full layer its indexer keys (DSA; else none). A
        prompt computed whole has them in `out` from row `row` (positions cached..length)
        and in its cached prefix; a chunked one in its buffer."""
        if self._n:
            return (
                [n[skip:] for n in self._n],
                [k[skip:] for k in self._k_pe],
                [k[skip:] for k in self._keys],
            )
        end = row + self.length - self.cached
        if skip >= self.cached:
            lo = row + skip - self.cached
            return (
                [n[lo:end] for n in out.n],
                [k[lo:end] for k in out.k_pe],
                [k[lo:end] for k in out.index_keys],
            )
        past = self._past
        assert past is not None

        def joined(before: list[Tensor], new: list[Tensor]) -> list[Tensor]:
            return [torch.cat([p[skip:], x[row:end]]) for p, x in zip(before, new, strict=True)]

        return (
            joined(past.n, out.n),
            joined(past.k_pe, out.k_pe),
            joined(past.index_keys, out.index_keys),
        )


def _buffer(like: Tensor, length: int) -> Tensor:
    return torch.empty(length, like.shape[1], dtype=like.dtype, device=like.device)


def default_chunk_tokens(device: torch.device) -> int:
    """The chunk a prompt is prefilled in when the settings leave it out: on CUDA, 8192 tokens
    keep the GEMMs large and bound the activations; the CPU computes a 1024-token piece in
    about the time a short prompt takes to prefill, so the short prompts queued behind a long
    one wait about one piece."""
    return 8192 if device.type == "cuda" else 1024

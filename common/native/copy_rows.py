"""A row scatter with streaming stores (copy_rows.cpp) behind a checked call.

`scatter_rows(dest, index, src)` is `dest[index] = src` for whole rows; natively for CPU
tensors whose rows are contiguous bytes, else by PyTorch's indexed copy. It is meant for
large writes into memory that is not read soon (a received shard landing in the paged
cache): streaming stores bypass the caches.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from common.native.library import load_optional

# Word types for moving bytes, widest first. Indexed writes copy element by element, so a
# 16-byte element moves a bf16 row with 8x fewer steps (measured: 70 MB of scattered blocks in
# ~10 ms instead of ~30 ms). A move of the bits, never arithmetic: exact.
_WORDS = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)

_p = ctypes.c_void_p
_i = ctypes.c_int64


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_optional(
        "copy_rows", {"tpla_scatter_rows": [_p, _p, _p, _i, _i, _i]}, "native row scatter"
    )


def available() -> bool:
    """True if the library is built (building it now if needed) and loads here."""
    return _library() is not None


def scatter_rows(dest: Tensor, index: Tensor, src: Tensor) -> None:
    """dest[index[i]] = src[i] for rows along dim 0 (index int64 [n], src [n, *dest.shape[1:]]).

    Raises IndexError for an index outside dest, whichever path runs (nothing is written).
    """
    if index.dim() != 1 or src.shape != (index.shape[0], *dest.shape[1:]):
        raise ValueError(
            f"scatter_rows: {tuple(src.shape)} rows at {tuple(index.shape)} indices into "
            f"{tuple(dest.shape)}"
        )
    if (
        dest.is_cpu
        and src.is_cpu
        and src.dtype == dest.dtype
        and index.dtype == torch.int64
        and dest.is_contiguous()
        and src.is_contiguous()
        and not (torch.is_grad_enabled() and (dest.requires_grad or src.requires_grad))
        and (lib := _library()) is not None
    ):
        index = index.contiguous()
        row_bytes = src[0].nbytes if len(src) else 0
        status = lib.tpla_scatter_rows(
            dest.data_ptr(), src.data_ptr(), index.data_ptr(), len(index), row_bytes, len(dest)
        )
        if status:
            raise IndexError(f"scatter_rows: an index is outside [0, {len(dest)})")
        return
    if len(index) and (int(index.min()) < 0 or int(index.max()) >= len(dest)):
        raise IndexError(f"scatter_rows: an index is outside [0, {len(dest)})")
    copy_words(dest, index, src)


def copy_words(dest: Tensor, index: Tensor, src: Tensor, dim: int = 0) -> None:
    """`dest[index] = src` along `dim` (PyTorch's indexed copy), moving whole words where
    both tensors' byte views allow it. `src` and `index` may be on another device than
    `dest` (a shard received in host memory for a GPU cache): they are copied over first."""
    src = src.to(dest.device, dest.dtype)
    at = (slice(None),) * dim + (index.to(dest.device),)
    dest_words, src_words = word_view(dest), word_view(src)
    if dest_words.shape[-1] == src_words.shape[-1]:
        dest_words[at] = src_words
    else:  # the two views disagree (another offset or stride): element by element
        dest[at] = src


def word_view(t: Tensor) -> Tensor:
    """`t`'s bytes viewed as the widest word its rows' size, strides and offset allow."""
    item = t.element_size()
    if t.dim() == 0 or t.stride(-1) != 1:
        return t
    for word in _WORDS:
        size = torch.empty((), dtype=word).element_size()
        fits = (t.shape[-1] * item) % size == 0 and (t.storage_offset() * item) % size == 0
        if fits and all((s * item) % size == 0 for s in t.stride()[:-1]):
            return t.view(word)
    return t

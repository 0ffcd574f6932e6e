"""Causal varlen attention of the expanded (prefill) MLA path, chosen once per model by
`select_prefill_attention` (TPLA_ATTENTION_BACKEND, by the rule of
common/runtime/kernel_choice.py; the decode ranks' backends are another interface).

`SdpaPrefillAttention` runs everywhere and is the reference. `NativePrefillAttention` is the
CPU fast path (common/native/causal_attention.cpp, fp32 CPU; tensors outside its domain, such
as under autograd, go to SDPA), chosen by `auto` for an fp32 CPU model when the kernel builds
here. `FlashPrefillAttention` is a thin GPU path that `auto` chooses only for an fp16 / bf16
model on CUDA where the `flash_attn` package is present; importing this module never imports
flash_attn or builds a native library.
"""

from __future__ import annotations

import abc
import importlib.util
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor

from common.runtime.kernel_choice import KernelChoice, choose_kernel


class PrefillAttention(abc.ABC):
    """Causal self-attention over packed sequences delimited by `cu_seqlens`."""

    name: str

    @abc.abstractmethod
    def causal(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: list[int], scale: float
    ) -> Tensor:
        """q, k: [T, H, d_qk]; v: [T, H, d_v] -> [T, H, d_v]."""

    def causal_mla(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        k_nope: Tensor,
        k_pe: Tensor,
        v: Tensor,
        cu_seqlens: list[int],
        scale: float,
    ) -> Tensor:
        """`causal` of MLA's parts: q = [q_nope | q_pe], k = [k_nope | k_pe] with k_pe [T, d_r]
        shared by the heads; k_nope and v may be strided views. Joined here by default; a
        backend that can read the parts in place overrides this."""
        heads = q_nope.shape[1]
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe[:, None].expand(-1, heads, -1)), dim=-1)
        return self.causal(q, k, v.contiguous(), cu_seqlens, scale)


def widened_values(v: Tensor, width: int) -> Tensor:
    """MLA's v [T, H, d_v] zero-padded to q / k's width for kernels that take one head dim:
    the padded output columns are zero, and the caller slices them off."""
    d_v = v.shape[-1]
    return F.pad(v, (0, width - d_v)) if d_v < width else v


class SdpaPrefillAttention(PrefillAttention):
    """torch SDPA, one call per sequence (no cross-sequence mask memory)."""

    name = "sdpa"

    def causal(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: list[int], scale: float
    ) -> Tensor:
        # torch's fused CPU kernel needs equal widths and otherwise falls back to the unfused
        # math path (~2x slower).
        d_v, v = v.shape[-1], widened_values(v, q.shape[-1])
        out = q.new_empty(q.shape[0], q.shape[1], d_v)
        for start, end in pairwise(cu_seqlens):
            # [1, H, T, d]: the fused CPU kernel accepts only 4-D inputs.
            qs, ks, vs = (t[None, start:end].transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            out[start:end] = o[0].transpose(0, 1)[..., :d_v]
        return out


class NativePrefillAttention(PrefillAttention):
    """The native CPU kernel for fp32 CPU tensors, SDPA (the reference) for anything else."""

    name = "native"

    def __init__(self) -> None:
        from common.native import causal_attention
        from common.native.library import NativeUnavailable

        if not causal_attention.available():
            raise NativeUnavailable("the native prefill attention kernel cannot be built here")
        self._kernel = causal_attention
        self._fallback = SdpaPrefillAttention()

    def causal(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: list[int], scale: float
    ) -> Tensor:
        if self._kernel.supports(q, k, v):
            return self._kernel.causal_attention(q, k, v, cu_seqlens, scale)
        return self._fallback.causal(q, k, v, cu_seqlens, scale)

    def causal_mla(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        k_nope: Tensor,
        k_pe: Tensor,
        v: Tensor,
        cu_seqlens: list[int],
        scale: float,
    ) -> Tensor:
        # The kernel joins the parts while packing each head: no [T, H, d_qk] copies of q and
        # k first (a demo layer at 1,536 tokens: 29.6 ms joined, 25.9 ms in place, prefill.md).
        if self._kernel.supports(q_nope, q_pe, k_nope, k_pe, v):
            return self._kernel.causal_attention_mla(
                q_nope, q_pe, k_nope, k_pe, v, cu_seqlens, scale
            )
        return super().causal_mla(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens, scale)


class FlashPrefillAttention(PrefillAttention):
    """flash-attn's varlen kernel (CUDA; fp16 / bf16 only, so never chosen for fp32).

    flash-attn 2 takes one head dim for q, k and v, while MLA's v (128) is narrower than its
    q and k (192): v is zero-padded to their width and the output sliced back, which changes
    nothing (the padded columns of the output are zero)."""

    name = "flash-attn"
    DTYPES = (torch.float16, torch.bfloat16)

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func  # GPU-only import, deferred on purpose

        self._fn = flash_attn_varlen_func

    def causal(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: list[int], scale: float
    ) -> Tensor:
        if q.dtype not in self.DTYPES:
            raise ValueError(f"flash-attn runs fp16 and bf16, not {q.dtype}: use sdpa")
        d_v, v = v.shape[-1], widened_values(v, q.shape[-1])
        cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=q.device)
        max_len = max(e - s for s, e in pairwise(cu_seqlens))
        out = self._fn(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=True)
        return out[..., :d_v]


def _flash_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash_attn package is not installed (pip install flash-attn)"
    if device.type != "cuda":
        return f"flash-attn runs on CUDA, not on {device}"
    if not torch.cuda.is_available():
        return "flash-attn runs on CUDA, and none is visible"
    if dtype not in FlashPrefillAttention.DTYPES:
        return f"flash-attn runs fp16 and bf16, not {dtype}"
    return None


def _native_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu" or dtype != torch.float32:
        return f"the native prefill kernel runs fp32 on the CPU, not {dtype} on {device}"
    from common.native import causal_attention

    if not causal_attention.available():
        return "the native prefill attention kernel cannot be built or loaded here"
    return None


def select_prefill_attention(
    asked: str, device: torch.device | str, dtype: torch.dtype
) -> KernelChoice:
    """The prefill attention of a model on `device` computing in `dtype`
    (TPLA_ATTENTION_BACKEND: auto | sdpa | native | flash-attn), by the kernel-choice rule:
    `auto` tries flash-attn, then native, then SDPA."""
    dev = torch.device(device)
    checks = {
        "flash-attn": lambda: _flash_unsupported(dev, dtype),
        "native": lambda: _native_unsupported(dev, dtype),
        "sdpa": lambda: None,
    }
    return choose_kernel("prefill_attention", asked, checks, ("flash-attn", "native", "sdpa"))


def make_prefill_attention(kernel: str) -> PrefillAttention:
    """The backend of a chosen kernel (`select_prefill_attention`): sdpa | native |
    flash-attn."""
    backends: dict[str, type[PrefillAttention]] = {
        "sdpa": SdpaPrefillAttention,
        "native": NativePrefillAttention,
        "flash-attn": FlashPrefillAttention,
    }
    return backends[kernel]()

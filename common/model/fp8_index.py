"""DeepSeek-V3.2's FP8 lightning indexer, ported to torch: the reference of the `fp8` index-key
format (common/model/index_keys.py).

DeepSeek's inference code rotates index queries and keys by a Hadamard matrix (orthonormal:
dot products are kept, outliers are spread over the dims), quantizes both to e4m3 in blocks
of 128 with a power-of-two scale per block (`act_quant`, scale format ue8m0: 2^ceil(log2(
amax / 448)), amax at least 1e-4), keeps the keys so in its cache (one 128-dim key and one
fp32 scale: 132 bytes a token a layer) and scores

    I_t = k_scale_t * sum_h (w_h q_scale_h / sqrt(d_I)) ReLU(q8_h . k8_t)

(`fp8_index`: fp8 products, fp32 sums). HF's port does neither the rotation nor the FP8.
Math only.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
QUANT_BLOCK = 128


@functools.cache
def _sylvester(dim: int) -> Tensor:
    if dim & (dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two width, not {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(dim)


def hadamard(x: Tensor) -> Tensor:
    """x [..., d] times the orthonormal Sylvester Hadamard matrix (fast_hadamard_transform
    with scale d^-1/2, as DeepSeek's `rotate_activation`), in fp32, back in x's dtype."""
    h = _sylvester(x.shape[-1]).to(device=x.device, dtype=torch.float32)
    return (x.float() @ h).to(x.dtype)


def act_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., d] -> e4m3 values [..., d] and one power-of-two fp32 scale per block of 128
    dims [..., d / 128] (DeepSeek's `act_quant` with scale_fmt ue8m0)."""
    d = x.shape[-1]
    block = min(d, QUANT_BLOCK)
    blocks = x.float().unflatten(-1, (d // block, block))
    amax = blocks.abs().amax(-1).clamp(min=AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    q = (blocks / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale


def fp8_index_scores(q: Tensor, w: Tensor, k: Tensor, softmax_scale: float) -> Tensor:
    """DeepSeek's indexer scores from unrotated, unquantized q [R, H, d], w [R, H] (fp32,
    1/sqrt(H) folded in) and keys [T, d] -> I [R, T] (fp32): rotate, quantize, `fp8_index`."""
    q8, q_scale = act_quant(hadamard(q))
    k8, k_scale = act_quant(hadamard(k))
    weights = w * q_scale[..., 0] * softmax_scale  # [R, H]: one quant block per head
    logits = torch.einsum("rhd,td->rht", q8.float(), k8.float()).relu_()
    return torch.einsum("rh,rht->rt", weights, logits) * k_scale[..., 0]

"""compressed-tensors' pack-quantized INT4 as stored (Kimi K2-Thinking, K2.5, K2.6), importable
without triton: what the W4A16 kernel (int4_grouped_gemm.py) reads, and its one dequantization.

The checkpoint stores a weight W [R, C] as `weight_packed` int32 [R, C / 8]: eight 4-bit
values a word, value j in bits 4j..4j+3, each the signed value q in [-8, 7] plus 8; and
`weight_scale` [R, C / G] in the checkpoint's float dtype, one per G columns of a row
(symmetric, no zero point): W = q * s. `dequantize_int4` is the one dequantization: the
reader's dequantize-at-load, an `Int4Weight`'s dequantize-on-use (common/model/int4.py) and
the W4A16 kernel's reference all call it, so they agree bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT4_PACK = 8  # 4-bit values per int32 word


def unpack_int4(packed: Tensor) -> Tensor:
    """int32 words [..., C / 8] -> their signed 4-bit values [..., C] as int8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[..., None] >> shifts) & 0xF
    return (nibbles.to(torch.int8) - 8).flatten(-2)


def dequantize_int4(packed: Tensor, scale: Tensor, group: int, out: Tensor) -> Tensor:
    """q * s of packed [..., R, C / 8] and scale [..., R, C / G] into `out` [..., R, C]: the
    values copied in exactly, times their group's scale in `out`'s dtype (one rounding).
    Writes one matrix at a time (the unpacked words of one matrix are the only temporary)."""
    lead = packed.shape[:-2]
    flat_p, flat_s = packed.reshape(-1, *packed.shape[-2:]), scale.reshape(-1, *scale.shape[-2:])
    flat_o = out.view(-1, *out.shape[-2:])
    for e in range(flat_p.shape[0]):  # one matrix's unpacked words at a time
        o = flat_o[e]
        o.copy_(unpack_int4(flat_p[e]))
        o.view(o.shape[0], -1, group).mul_(flat_s[e].to(out.dtype)[..., None])
    return out.view(*lead, *out.shape[-2:])

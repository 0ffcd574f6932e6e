"""The analytic work of decode attention (tools/bench/attn_work), counted by hand."""

from __future__ import annotations

from tools.bench.attn_work import DeviceWork, device_work, shapes


def test_decode_attn_counts_by_hand() -> None:
    """Demo shapes (8 heads, d_c 128, d_r 16, d_n = d_v = 32), MLA-TP at tp=2, 1K, batch 1."""
    demo = {s.name: s for s in shapes()}["demo"]
    work = device_work(demo, "mla-tp", 1, 1024)
    assert work == DeviceWork(4, 128, 16, 32, 32, 1, 1024)
    # absorb 2*4*32*128, scores 2*4*1024*144, values 2*4*1024*128, W_UV 2*4*128*32
    assert work.flops() == 32768 + 1179648 + 1048576 + 32768
    # cache 1024*144, W_UK+W_UV 4*64*128, queries 4*48, output 4*32 (fp32)
    assert work.bytes(4) == 4 * (147456 + 32768 + 192 + 128)
    tpla = device_work(demo, "tpla", 1, 1024)
    assert (tpla.heads, tpla.width) == (8, 64)
    # TPLA reads (64 + 16) / (128 + 16) of MLA-TP's cache bytes.
    assert tpla.bytes(4) - 4 * 8 * 64 * 64 - 4 * 8 * 80 < work.bytes(4)

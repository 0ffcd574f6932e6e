"""The decode engine on the Triton backend, run on the CPU by Triton's interpreter.

The interpreter executes the same kernels a GPU compiles (tests/conftest.py imports triton
in interpreter mode where there is no CUDA; the `tpla generate` processes get
TRITON_INTERPRET=1 in their environment), so the engine's Triton path is held to the native
and torch backends here, exactly as it runs on CUDA, only slower.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.kv.paged_cache import CacheLayout, CacheReads, PagedLatentCache
from common.loading.loader import load_model
from common.loading.weights import ModelWeights
from common.model.sp import merge_partials
from common.model.tpla import latent_shards
from common.parallel import ParallelConfig, RmsNormMode
from common.triton_kernels import triton_mode
from services.decode.rank.backends import TorchBackend, decode_backend, select_decode_kernel
from services.decode.rank.layers import RankAttention
from tests.cli import generate_ids
from tests.tiny import save_hf

pytestmark = pytest.mark.skipif(
    not triton_mode.triton_installed(), reason="triton is not installed"
)

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
CPU = torch.device("cpu")


def _history(lengths: list[int], width: int, d_r: int, block_size: int, seed: int):
    """A paged cache holding random histories of `lengths` tokens in shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lengths]
    cache = PagedLatentCache(CacheLayout(1, width, d_r, block_size), sum(per_seq) + 3)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g) * 0.5)
    order = torch.randperm(cache.num_blocks, generator=g).tolist()
    tables = torch.full((len(lengths), max(per_seq)), -1, dtype=torch.int64)
    for b, count in enumerate(per_seq):
        tables[b, :count] = torch.tensor([order.pop() for _ in range(count)])
    lens = torch.tensor(lengths)
    return cache, tables, lens


@pytest.mark.skipif(torch.cuda.is_available(), reason="this process runs Triton compiled")
@pytest.mark.usefixtures("triton_interpret")
def test_the_triton_backend_attends_as_the_torch_backend(tmp_path: Path) -> None:
    """TPLA (a latent slice with beta), MLA-TP (a head group, the full latent) and SP
    partials (every head; one sequence with no token on this rank) on a real tiny layer."""
    save_hf("v2-greedy", tmp_path, std=0.05)
    model = load_model(tmp_path)
    attn = model.model.layers[1].self_attn
    triton_ = decode_backend(select_decode_kernel("triton", CPU, torch.float32).kernel)
    torch_ = TorchBackend()
    assert triton_.name == "triton"
    heads = attn.num_heads
    g = torch.Generator().manual_seed(0)
    for shard, group in (
        (latent_shards(ParallelConfig(2, 2).latent_slices(attn.d_c))[1], slice(0, heads)),
        (latent_shards(ParallelConfig(1, 1).latent_slices(attn.d_c))[0], slice(heads // 2, heads)),
    ):
        rank = RankAttention(ModelWeights(model), 1, group, shard, RmsNormMode.EXACT)
        cache, tables, lens = _history([21, 4, 40], shard.width, attn.d_r, 8, seed=1)
        reads = CacheReads.blocks(tables, lens, 8)
        q = torch.randn(3, rank.num_heads, attn.d_n + attn.d_r, generator=g)
        q_nope, q_pe = q.split([attn.d_n, attn.d_r], dim=-1)
        with torch.inference_mode():
            got = triton_.attention(rank, q_nope, q_pe, cache, 0, reads)
            want = torch_.attention(rank, q_nope, q_pe, cache, 0, reads)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # SP: this rank holds 9, 0 and 17 tokens of three sequences.
    cache, tables, lens = _history([9, 1, 17], attn.d_c, attn.d_r, 4, seed=2)
    reads = CacheReads.tokens(tables, torch.tensor([9, 0, 17]), 4)
    q_lat = torch.randn(3, heads, attn.d_c, generator=g)
    q_pe = torch.randn(3, heads, attn.d_r, generator=g)
    with torch.inference_mode():
        got = triton_.partial_attention(q_lat, q_pe, cache, 0, reads, attn.scale)
        want = torch_.partial_attention(q_lat, q_pe, cache, 0, reads, attn.scale)
    # Partials are defined up to their scale: compare what the merge makes of them.
    merged = [merge_partials(u, m, l, want[1]) for u, m, l in (got, want)]
    held = torch.tensor([True, False, True])
    for (u_got, l_got), (u_want, l_want) in [tuple(merged)]:
        torch.testing.assert_close(u_got[held], u_want[held], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(l_got[held], l_want[held], rtol=1e-4, atol=1e-5)
        assert not l_got[~held].any() and not u_got[~held].any()


def _generate(latent_groups: int, kernel: str, speculative: str = "none") -> list[int]:
    env = {"TRITON_INTERPRET": "1", "TPLA_DECODE_KERNEL": kernel}
    env["TPLA_SPECULATIVE"] = speculative
    args = ["--model", str(DEMO), "--prompt", "def fibonacci(n):", "--max-tokens", "12"]
    args += ["--ignore-eos", "--tp", "2", "--latent-groups", str(latent_groups)]
    return generate_ids(*args, env=env)


@pytest.mark.parametrize("latent_groups", [2, 1], ids=["tpla", "mla-tp"])
def test_tpla_generate_on_triton_gives_the_native_greedy_tokens(latent_groups: int) -> None:
    """`TRITON_INTERPRET=1 TPLA_DECODE_KERNEL=triton tpla generate --tp 2` (both ranks on
    the Triton backend) and the native backend give the same greedy tokens on the demo."""
    assert _generate(latent_groups, "triton") == _generate(latent_groups, "native")


def test_speculative_steps_on_triton_give_the_plain_tokens() -> None:
    """A verify step is a batch of rows, one per fed token, so the kernel runs it as it
    is: n-gram drafts on the demo (whose answers repeat) change no greedy token."""
    assert _generate(2, "triton", "ngram") == _generate(2, "native")

"""Prefill ranks on GPUs, in bf16: a rank of one equals the whole model on the same GPU, and a
tp=2 pair on two GPUs over NCCL gives the whole model's latents (within bf16 rounding) and
its greedy first tokens."""

from __future__ import annotations

import multiprocessing as mp
import queue
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import pytest
import torch
import torch.distributed as dist

from common.group.comm import Comm, DistCollectives
from common.group.vocab import gather_vocab
from common.loading.serving_model import load_prefill_model
from common.parallel import ParallelConfig
from common.runtime.ports import free_port
from services.prefill.rank.prefill_rank_model import load_prefill_rank
from tests.rank_exit import leave_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
IDS = [(7 * i + 3) % 6000 + 2 for i in range(300)]
LENS = [180, 120]


def _batch(device: str) -> torch.Tensor:
    return torch.tensor(IDS, device=device)


def test_a_rank_of_one_is_the_whole_model_on_the_gpu() -> None:
    whole = load_prefill_model(DEMO, "tpla_pca", dtype="bfloat16", device="cuda")
    rank = load_prefill_rank(
        DEMO, "tpla_pca", ParallelConfig(), 0, Comm(1), dtype="bfloat16", device="cuda"
    )
    assert rank.device.type == "cuda"
    assert type(rank.prefill_attention) is type(whole.prefill_attention)
    want = whole.prefill(_batch("cuda"), LENS)
    got = rank.prefill(_batch("cuda"), LENS)
    assert torch.equal(gather_vocab(Comm(1), got.logits, rank.config.vocab_size), want.logits)
    for n, m in zip(got.n, want.n, strict=True):
        assert torch.equal(n, m)


def _rank(port: int, rank: int, out: mp.Queue) -> NoReturn:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
        device_id=torch.device("cuda", rank),
    )
    data = DistCollectives()
    model = load_prefill_rank(
        DEMO,
        "tpla_pca",
        ParallelConfig(tp=2),
        rank,
        Comm(2, data, data),
        dtype="bfloat16",
        device=f"cuda:{rank}",
    )
    got = model.prefill(_batch(f"cuda:{rank}"), LENS)
    whole = gather_vocab(Comm(2, data, data), got.logits, model.config.vocab_size)
    out.put((rank, [n.float().cpu() for n in got.n], None if whole is None else whole.cpu()))
    leave_group(out)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_tp2_pair_on_two_gpus_over_nccl_equals_the_whole_model() -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(port, r, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {r[0]: r[1:] for r in (out.get(timeout=300) for _ in procs)}
    except queue.Empty:
        pytest.fail("a prefill rank did not finish")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    whole = load_prefill_model(DEMO, "tpla_pca", dtype="bfloat16", device="cuda:0")
    want = whole.prefill(_batch("cuda:0"), LENS)
    (n0, logits), (n1, nothing) = results[0], results[1]
    assert nothing is None and logits is not None
    assert torch.equal(logits.argmax(-1), want.logits.cpu().argmax(-1))
    for layer, n in enumerate(want.n):
        assert torch.equal(n0[layer], n1[layer])  # every rank holds the same whole latent
        torch.testing.assert_close(n0[layer], n.float().cpu(), atol=3e-2, rtol=3e-2)

"""A tp=2 prefill group of two real processes over torch.distributed's gloo: each rank reads
its share of the tiny model's checkpoint and prefills the batch; the latents equal the whole
model's within fp32 rounding and each other's, and the logits gathered on rank 0 give the same
greedy first tokens."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from common.group.comm import Comm, DistCollectives
from common.group.vocab import gather_vocab
from common.loading.loader import load_model
from common.parallel import ParallelConfig
from common.runtime.kernel_choice import KernelConfig
from common.runtime.ports import free_port
from services.prefill.rank.prefill_rank_model import load_prefill_rank
from tests.rank_exit import leave_group
from tests.spawned_ranks import run_ranks
from tests.tiny import save_hf

WORLD = 2
IDS, LENS = list(range(3, 40)), [21, 16]


def _rank(model_dir: str, port: int, rank: int, out: mp.Queue) -> NoReturn:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    data = DistCollectives()
    comm = Comm(WORLD, data, data)
    model = load_prefill_rank(
        model_dir,
        None,
        ParallelConfig(tp=WORLD),
        rank,
        comm,
        kernels=KernelConfig(prefill_attention="sdpa"),
    )
    got = model.prefill(torch.tensor(IDS), LENS, all_logits=True)
    whole = gather_vocab(comm, got.logits, model.config.vocab_size)
    out.put(
        (
            rank,
            [n.numpy() for n in got.n],
            None if whole is None else whole.numpy(),
            model.parameter_bytes(),
        )
    )
    leave_group(out)


def test_a_two_process_group_equals_the_whole_model(tmp_path: Path) -> None:
    save_hf("v2-greedy", tmp_path, std=0.08)
    port = free_port()
    items, codes = run_ranks(_rank, [(str(tmp_path), port, r) for r in range(WORLD)], None, 120)
    results = {r[0]: r[1:] for r in items}
    assert codes == [0, 0]
    whole_model = load_model(tmp_path)
    want = whole_model.prefill(torch.tensor(IDS), LENS, all_logits=True)
    (n0, logits, bytes0), (n1, nothing, bytes1) = results[0], results[1]
    assert nothing is None and logits is not None
    torch.testing.assert_close(torch.from_numpy(logits), want.logits, atol=2e-5, rtol=1e-4)
    last = np.cumsum(LENS) - 1
    assert torch.equal(torch.from_numpy(logits[last]).argmax(-1), want.logits[last].argmax(-1))
    for layer, n in enumerate(want.n):
        assert np.array_equal(n0[layer], n1[layer])  # the same whole latent on each rank
        torch.testing.assert_close(torch.from_numpy(n0[layer]), n, atol=1e-5, rtol=1e-5)
    whole_bytes = sum(p.numel() * p.element_size() for p in whole_model.parameters())
    assert bytes0 == bytes1 < whole_bytes

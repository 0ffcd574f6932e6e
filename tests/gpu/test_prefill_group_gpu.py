"""A prefill group of two ranks on two GPUs (NCCL data group, bf16): the KV each decode rank
receives and the first tokens equal one prefill process's on one GPU. Skips, with its reason,
on a machine with fewer than two GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.kv.transfer import make_sender
from common.loading.serving_model import load_prefill_model
from common.messages import Reservation
from common.sampling.params import SamplingParams
from services.prefill.batch.job import PrefillJob
from services.prefill.config import PrefillGroupConfig
from services.prefill.group.leader import GroupRunner
from services.prefill.group.rank_loader import load_group_rank
from services.prefill.runner import LocalRunner
from services.prefill.worker import PrefillWorker
from tests.recording_kv import Receivers, targets
from tests.tiny import save_hf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="a prefill group of two ranks needs two GPUs"
    ),
]

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PROMPTS = [list(range(3, 90)), [5, 9, 2, 7, 11, 4, 8, 30, 31, 6, 12]]


def _jobs(tag: str, d_c: int, address: str) -> list[PrefillJob]:
    jobs = []
    for i, prompt in enumerate(PROMPTS):
        rid = f"{tag}-{i}"
        kv = targets("tpla", 4, d_c, len(prompt), 0, address)
        res = Reservation(rid, 16, 0, 0, "bfloat16", 30.0, kv)
        jobs.append(PrefillJob(rid, prompt, GREEDY, res, 30.0))
    return jobs


def test_a_two_gpu_prefill_group_ships_what_one_gpu_does(tmp_path: Path) -> None:
    save_hf("v2-greedy", tmp_path, vocab_size=321)
    receivers = Receivers()
    model = load_prefill_model(tmp_path, None, "bfloat16", device="cuda:0")
    d_c = model.config.kv_lora_rank
    one = PrefillWorker(LocalRunner(model, make_sender("grpc", "one")))
    cfg = PrefillGroupConfig(model=str(tmp_path), tp=2, dtype="bfloat16", device="cuda")
    two = PrefillWorker(GroupRunner.start(cfg, load_group_rank))
    try:
        want = [one.submit(job).result(timeout=120) for job in _jobs("one", d_c, receivers.address)]
        got = [two.submit(job).result(timeout=120) for job in _jobs("two", d_c, receivers.address)]
        for a, b in zip(want, got, strict=True):
            assert a.first_token.token_id == b.first_token.token_id
        for i in range(len(PROMPTS)):
            for rank in range(4):
                torch.testing.assert_close(
                    receivers.caches[(f"two-{i}", rank)].kv, receivers.caches[(f"one-{i}", rank)].kv
                )
    finally:
        one.close()
        two.close()
        receivers.close()

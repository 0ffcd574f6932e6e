"""KV pushes over the torch transport into a decode group's receivers while its loop runs
decode steps, against the same group undisturbed: what the CPU (gloo) and 2-GPU (NCCL)
tests of docs/design.md §5's ordering both run."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from common.kv.transfer import TorchKvSender, cut_shard
from common.loading.serving_model import load_prefill_model
from common.parallel import ParallelConfig
from common.runtime.kernel_choice import KernelConfig
from common.runtime.ports import free_port, kv_port_offsets
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from tools.local_driver import LocalResult, collect, submit

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DECODING = list(range(3, 30))
PUSHED = [5, 9, 2, 7, 11, 4, 8, 30, 31, 6, 12, 40, 41]


@dataclass
class Outcome:
    alone: LocalResult  # DECODING with nothing else going on
    meanwhile: LocalResult  # DECODING while PUSHED's shards were pushed again and again
    steps: int  # decode steps the group ran while pushes went on
    pushes: list[int]  # each push's acknowledged bytes
    written: list[int]  # PUSHED's tokens, its KV written in process
    pushed: list[int]  # PUSHED's tokens, its KV pushed over the pairs


def logits(result: LocalResult) -> list[torch.Tensor]:
    return [e.logits for e in result.events if e.logits is not None]


def pushes_during_steps(
    model_dir: Path, device: str = "cpu", dtype: str = "float32", shard_device: str = "cpu"
) -> Outcome:
    """Run the group of two on `device` (its data group gloo on the CPU, NCCL on GPUs) and
    push from `shard_device` (NCCL pairs between two GPUs)."""
    cfg = EngineConfig(
        model=str(model_dir),
        parallel=ParallelConfig(tp=2, latent_groups=2),
        master_port=0,
        kv_budget_mb=2,
        block_size=4,
        record_logits=True,
        collectives="dist",
        dtype=dtype,
        device=device,
        kernels=KernelConfig(decode_attention="torch"),
        kv_port_base=free_port(kv_port_offsets(2)),
    )
    prefill = load_prefill_model(model_dir, None, dtype, device=shard_device)
    with DecodeEngine(cfg) as engine:
        alone = collect(*submit(engine, prefill, [DECODING], [LONG])[0])
        written = collect(*submit(engine, prefill, [PUSHED], [SHORT])[0])
        out = prefill.prefill(torch.tensor(PUSHED, device=shard_device), [len(PUSHED)])
        reservation = engine.reserve("pushed", len(PUSHED), SHORT.max_tokens)
        shards = [
            cut_shard(out.n, out.k_pe, 0, len(PUSHED), t, "pushed", reservation.block_size)
            for t in reservation.targets
        ]
        sender, stop, pushes = TorchKvSender("pusher", timeout_s=60), threading.Event(), []

        def push() -> None:
            while not stop.is_set():  # the same shards again: each lands whole in its blocks
                for shard, t in zip(shards, reservation.targets, strict=True):
                    pushes.append(sender.send(shard, t.grpc_address, t.torch_address, 60.0))

        pusher = threading.Thread(target=push, daemon=True)
        steps_before = len(engine.probe.step_seconds)
        pusher.start()
        try:
            meanwhile = collect(*submit(engine, prefill, [DECODING], [LONG])[0])
        finally:
            stop.set()
            pusher.join(60)
            sender.close()
        steps = len(engine.probe.step_seconds) - steps_before
        first = written.token_ids[0]
        events = list(engine.generate("pushed", first, SHORT, PUSHED))
        pushed = [first] + [e.token.token_id for e in events if e.token is not None]
    return Outcome(alone, meanwhile, steps, pushes, written.token_ids, pushed)

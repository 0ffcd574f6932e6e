"""`tpla bench loading`'s steps row: a decode follower's peak memory after serving, not only
after loading.

A tp = 2 TPLA (r = 2) decode group on the CPU serves a random V3-shaped block-FP8 checkpoint
(`FP8_STEPS_CONFIG`: 4 layers, hidden 2048, 32 experts; ~2.9 GB) with its linear weights kept
FP8 (TPLA_WEIGHT_DTYPE=float8) and fp32 compute, every kernel `auto` (the CPU's: the native
decode backend, FP8 linears dequantized on use, FP8 experts dequantized a bounded group at a
time). The group runs in a child process (the leader, rank 0, which also holds the FP8
prefill model that writes the prompts' KV); rank 1 is its spawned follower. The row is the
follower's VmHWM after loading and again after two requests, served together, have decoded
their tokens: the steps' dequantization buffers and activations included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tools.bench.proc_memory import vm_bytes
from tools.bench.v3_shapes import v3_shaped

FP8_STEPS_CONFIG = v3_shaped(
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=4096,
    num_hidden_layers=4,
    num_attention_heads=16,
    n_routed_experts=32,
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=1,
)
PROMPT_TOKENS = (48, 17)  # the two requests' prompts
MAX_TOKENS = 8  # tokens each request decodes
KV_BUDGET_MB = 256.0  # per rank: EngineConfig's default
STEPS_DTYPE = "float32"  # the group's compute dtype: the CPU's


def steps_child(model_dir: str) -> dict[str, Any]:
    """The group's leader: start the group, read its follower's peak, serve two requests,
    read it again."""
    import torch

    from common.loading.serving_model import load_prefill_model
    from common.parallel import ParallelConfig
    from common.sampling.params import SamplingParams
    from services.decode.config import EngineConfig
    from services.decode.engine import DecodeEngine
    from tools.local_driver import collect, submit

    torch.set_num_threads(1)
    parallel = ParallelConfig(tp=2, latent_groups=2)
    cfg = EngineConfig(
        model=model_dir,
        parallel=parallel,
        master_port=0,
        kv_budget_mb=KV_BUDGET_MB,
        weight_dtype="float8",
        dtype=STEPS_DTYPE,
    )
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in PROMPT_TOKENS]
    start = time.perf_counter()
    with DecodeEngine(cfg) as engine:
        load_s = time.perf_counter() - start
        [follower] = engine.follower_pids
        loaded = vm_bytes(follower, "VmHWM")
        kept = engine.runtime.model.parameter_bytes()  # rank 0's: the follower's shapes
        prefill = load_prefill_model(model_dir, None, weight_dtype="float8")
        t0 = time.perf_counter()
        streams = submit(engine, prefill, prompts, [greedy] * len(prompts))
        tokens = [len(collect(first, stream).token_ids) for first, stream in streams]
        serve_s = time.perf_counter() - t0
        served = vm_bytes(follower, "VmHWM")
    return {
        "mode": "decode-fp8-steps",
        "layout": parallel.name,
        "rank": 1,
        "peak_rss_bytes": served,
        "peak_after_load_bytes": loaded,
        "parameter_bytes": kept,
        "kv_budget_bytes": int(KV_BUDGET_MB * 2**20),
        "load_seconds": round(load_s, 2),
        "requests": len(prompts),
        "prompt_tokens": list(PROMPT_TOKENS),
        "generated_tokens": tokens,
        "serve_seconds": round(serve_s, 2),
    }


def run_steps(model_dir: Path) -> dict[str, Any]:
    """`steps_child` in a fresh process (one thread, as the other rows)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tools.bench.follower_memory", str(model_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(steps_child(sys.argv[1])))

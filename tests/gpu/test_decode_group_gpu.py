"""A decode group's processes on GPUs: a rank on GPU k makes no CUDA context on GPU 0, and a
rank that dies fails the group within its collective timeout (the NCCL data group's too).

Each group runs in a child process: the first test reads the child's CUDA contexts, and in
the second NCCL's watchdog may end the child when the timeout passes, as it should."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"

_START = """
import ctypes, json, os, signal, sys, time
import torch
from common.loading.serving_model import load_prefill_model
from common.parallel import ParallelConfig
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from tools.local_driver import collect, submit

def start(tp, device, timeout_s=120.0):
    cfg = EngineConfig(model=sys.argv[1], parallel=ParallelConfig(tp=tp, latent_groups=1),
                       master_port=0, kv_budget_mb=16, dtype="bfloat16", device=device,
                       collective_timeout_s=timeout_s)
    return DecodeEngine(cfg)

def run(engine, max_tokens):
    prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return submit(engine, prefill, [list(range(2, 30))], [params])[0]
"""

# A tp = 1 group on cuda:1 decodes, then reports which GPUs hold a primary context (the
# driver's own record: any CUDA use of a GPU makes one) and what torch reserved on GPU 0.
_PLACEMENT = (
    _START
    + """
with start(1, "cuda:1") as engine:
    result = collect(*run(engine, 6))
cuda = ctypes.CDLL("libcuda.so.1")
active = []
for index in range(torch.cuda.device_count()):
    dev, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), index) == 0
    assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on)) == 0
    active.append(bool(on.value))
reserved0 = torch.cuda.memory_reserved(0)  # read after the contexts: it may make one
print(json.dumps({"tokens": len(result.token_ids), "contexts": active, "reserved0": reserved0}))
"""
)

# A tp = 2 group with a 5 s collective timeout: its follower is killed while steps run.
_KILL = (
    _START
    + """
engine = start(2, "cuda", timeout_s=5.0)
collect(*run(engine, 4))  # the NCCL communicator exists now
first, stream = run(engine, 100000)
stream.get(timeout=60)
os.kill(engine.follower_pids[0], signal.SIGKILL)
print("killed", flush=True)
events = list(stream)
print("ended", events[-1].finish_reason, flush=True)
engine.shutdown()
"""
)


def _child(script: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, str(DEMO)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_group_on_gpu_1_makes_no_context_on_gpu_0() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: the group runs on GPU 1 and GPU 0 must stay untouched")
    proc = _child(_PLACEMENT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["tokens"] == 6
    assert report["contexts"][1], "the detector saw no context on GPU 1, where the group ran"
    assert not report["contexts"][0], "a context was made on GPU 0"
    assert report["reserved0"] == 0


def test_a_killed_rank_fails_the_group_within_its_collective_timeout() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: one per rank of a tp = 2 group")
    proc = _child(_KILL)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("killed"):
                break
        else:
            pytest.fail(f"the group did not start (exit {proc.wait()})")
        killed = time.monotonic()
        # Either the leader's stream ends with the group's error, or NCCL's watchdog ends
        # the process at the timeout (5 s); never NCCL's default 10 minutes.
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the group did not fail within 60 s of a rank's death")
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 5.0 + 40.0, f"the group took {took:.0f} s to fail"
    if "ended" in rest:
        assert "error" in rest.split("ended", 1)[1], rest

"""`tpla autoscaler` in its loop, as a real process against the router rig (a real router
and Redis, scripted workers: two prefill workers, one decode group of two ranks) with
--dry-run: every interval it decides, reads the pools' sizes from the worker registry, and
publishes tpla:autoscaler_desired_replicas{role, mode="dry-run"} on its /metrics."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.runtime.ports import free_port
from common.text.tokenizer import Tokenizer
from tests.cli import ROOT
from tests.router_rig import Script, run_stack

pytestmark = pytest.mark.anyio

PROFILE = ROOT / "tests" / "data" / "autoscaler_profile.json"


def desired(text: str) -> dict[tuple[str, str], float]:
    return {
        (s.labels["role"], s.labels["mode"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tpla:autoscaler_desired_replicas"
    }


async def test_the_loop_publishes_from_the_registrys_counts(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = Script([*tokenizer.encode("a b c"), min(tokenizer.eos_token_ids)])
    port = free_port()
    async with run_stack(model_dir, redis_url, script) as stack:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tools.cli", "autoscaler", "--router-url", stack.base_url,
            "--redis-url", redis_url, "--profile", str(PROFILE), "--slo-ttft-ms", "500",
            "--slo-itl-ms", "50", "--window-s", "1", "--interval-s", "1", "--dry-run",
            "--host", "127.0.0.1", "--port", str(port),
            cwd=ROOT, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stderr is not None
        decisions: list[str] = []
        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                body = {"model": "tpla-test", "messages": [{"role": "user", "content": "hi"}]}
                while len(decisions) < 3:
                    r = await stack.client.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200
                    line = await asyncio.wait_for(proc.stderr.readline(), timeout=20)
                    assert line, "the autoscaler exited"
                    if b"autoscaler decision" in line:
                        decisions.append(line.decode())
                metrics = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), timeout=10)
    assert proc.returncode == 0
    # Read from the registry: the rig's two prefill workers and one group of two ranks.
    assert all("'current_replicas': {'prefill': 2, 'decode': 1}" in d for d in decisions)
    assert "'request_rate': 0.0" not in decisions[-1]
    got = desired(metrics)
    assert set(got) == {("prefill", "dry-run"), ("decode", "dry-run")}
    assert all(n >= 1 for n in got.values())

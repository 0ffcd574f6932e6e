"""`tpla autoscaler --router-url URL --once --json` against the real stack with the small
profile kept as test data (tests/data/autoscaler_profile.json): idle gives the minimum; a
burst of long prompts with one output token each raises the prefill workers and leaves the
decode groups at their minimum."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import httpx

from tests.cli import ROOT
from tests.stack import MODEL_NAME
from tools.local_stack import LocalStack

PROFILE = ROOT / "tests" / "data" / "autoscaler_profile.json"
# Long enough that a burst on a busy 2-core CI machine (5 s seen) ends inside it.
WINDOW_S = 10.0


def autoscaler(url: str) -> subprocess.Popen[str]:
    args = [
        sys.executable, "-m", "tools.cli", "autoscaler", "--router-url", url,
        "--profile", str(PROFILE), "--slo-ttft-ms", "200", "--slo-itl-ms", "50",
        "--min-prefill", "1", "--max-prefill", "6", "--min-decode", "1",
        "--max-decode", "6", "--window-s", str(WINDOW_S), "--once", "--json",
    ]  # fmt: skip
    return subprocess.Popen(
        args,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def decision(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def long_prompt(i: int) -> list[int]:
    return [(7 * i + j) % 300 + 10 for j in range(400)]


def test_idle_gives_the_minimum(stack: LocalStack) -> None:
    out = decision(autoscaler(stack.url))
    assert out["desired_replicas"] == {"prefill": 1, "decode": 1}
    assert out["inputs"]["observation"]["request_rate"] == 0.0


def test_long_prompts_raise_prefill_before_decode(stack: LocalStack) -> None:
    proc = autoscaler(stack.url)
    assert proc.stderr is not None
    assert "observing" in proc.stderr.readline()  # its first scrape follows at once

    def one(i: int) -> int:
        body = {"model": MODEL_NAME, "prompt": long_prompt(i), "max_tokens": 1}
        return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).status_code

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        codes = list(pool.map(one, range(24)))
    assert codes == [200] * 24
    assert time.monotonic() - t0 < WINDOW_S - 1.0, "the burst outlasted the window"
    out = decision(proc)
    obs = out["inputs"]["observation"]
    assert obs["request_rate"] >= 2.0 and obs["prompt_tokens"] >= 400
    assert out["desired_replicas"]["prefill"] > 1
    assert out["desired_replicas"]["decode"] == 1

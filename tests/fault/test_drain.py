"""Scale-in drains on the real stack: SIGTERM (what Kubernetes sends a pod it scales in) to the
leader of one of two decode groups, or to one of two prefill workers, while they serve.

The worker told to go finishes what it admitted, none of it fails or moves elsewhere (no
migration, no re-prefill), new requests go to the other worker meanwhile, and its process
exits within TPLA_DRAIN_GRACE_S. `tpla serve` then restarts it, so each test ends with the
stack whole again. One stack of two MLA-TP groups (tp=2: exact, so a stream's greedy text is
the undisturbed one) and two prefill workers.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.fault.test_faults import (
    CLIENT_TIMEOUT_S,
    Client,
    complete,
    decode_groups,
    finish,
    prefill_batches,
    run_clients,
    wait_progress,
    wait_recovered,
    workers,
)
from tests.stack import start_stack
from tests.tiny import save_tiny_chat_model
from tools.local_stack import LocalStack

DRAIN_GRACE_S = 15.0
PROMPTS = [f"drain {i}: the quick brown fox jumps over the lazy dog" for i in range(4)]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    model = save_tiny_chat_model(tmp_path_factory.mktemp("drain-model"), std=0.08)
    s = start_stack(
        model,
        "grpc",
        DECODE_GROUPS="2",
        PREFILL_WORKERS="2",
        LATENT_GROUPS="1",
        ROUTING_POLICY="least-loaded",
        WORKER_TTL_S="3",
        PREFILL_CHUNK_TOKENS="8",
        LEASE_SECONDS="10",
        DRAIN_GRACE_S=f"{DRAIN_GRACE_S:g}",
    )
    try:
        wait_recovered(s)
        yield s
    finally:
        s.stop()


def log_tail(stack: LocalStack) -> str:
    """The end of the stack's log, without the tests' own polling."""
    return "\n".join(ln for ln in stack.log().splitlines() if "GET /admin" not in ln)[-4000:]


def record(url: str, request_id: str) -> dict:
    return httpx.get(f"{url}/admin/requests/{request_id}", timeout=10).json()


def send(url: str, prompt: str, max_tokens: int) -> dict:
    resp = httpx.post(
        f"{url}/v1/chat/completions",
        json=Client(url, prompt, max_tokens).body(stream=False),
        timeout=CLIENT_TIMEOUT_S,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def exited_within(pid: int, seconds: float) -> float:
    """Seconds until `pid` is gone (or a zombie), failing past `seconds`."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"process {pid} still runs {seconds:g} s after its SIGTERM")
    return time.monotonic() - started


def test_a_prefill_worker_told_to_go_finishes_its_queued_burst(stack: LocalStack) -> None:
    wait_recovered(stack)
    victim = next(w for w in workers(stack.url) if w["role"] == "prefill")
    pid, before = victim["pid"], len(stack.log())
    batches = prefill_batches(victim)
    # Some 30 chunks a prompt (PREFILL_CHUNK_TOKENS), a worker's prompts advancing a chunk
    # each a batch: once the victim's first batch is done, its share of the burst is queued
    # or running there for many batches more when the SIGTERM comes.
    prompts = [
        f"burst {i}: " + "the quick brown fox jumps over the lazy dog. " * 24 for i in range(12)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as sends:
        burst = [sends.submit(send, stack.url, p, 4) for p in prompts]
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while prefill_batches(victim) == batches:
            assert time.monotonic() < deadline, "no prompt reached the victim\n" + log_tail(stack)
            time.sleep(0.01)
        os.kill(pid, signal.SIGTERM)
        try:
            results = [f.result(timeout=CLIENT_TIMEOUT_S) for f in burst]
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{log_tail(stack)}") from exc
    exited_within(pid, DRAIN_GRACE_S)
    records = [record(stack.url, r["id"]) for r in results]
    assert all(r["choices"][0]["finish_reason"] == "length" for r in results)
    log = stack.log()[before:]
    admitted = re.search(r"prefill worker draining: (\d+) prefills", log)
    assert admitted, log[-4000:]
    # Every prefill it admitted ran there to its end, KV push included, on its first try.
    ran_there = [r for r in records if r["prefill_worker"] == victim["worker_id"]]
    seen = [(r["prefill_worker"], r["attempt"], r.get("retry_reason")) for r in records]
    assert len(ran_there) == int(admitted.group(1)) >= 1, (admitted.group(0), seen)
    assert all(r["attempt"] == "1" for r in ran_there), ran_there
    assert "prefill worker drained" in log
    wait_recovered(stack)


def group_decoding(url: str, clients: list[Client]) -> str:
    """The decode group holding the most of these clients' requests that are still decoding,
    by their request records (a frozen group's leader answers no metrics scrape)."""
    records = [record(url, c.result.request_id) for c in clients]
    holding = Counter(r["decode_group"] for r in records if r["state"] == "DECODING")
    assert holding, f"every stream ended before a group was chosen: {records}"
    return holding.most_common(1)[0][0]


def test_a_decode_group_told_to_go_finishes_its_streams(stack: LocalStack) -> None:
    wait_recovered(stack)
    tokens = 4 * MAX_TOKENS
    reference = {p: complete(stack.url, p, tokens) for p in PROMPTS}
    clients = [Client(stack.url, p, tokens) for p in PROMPTS]
    pool, futures = run_clients(clients)
    wait_progress(clients, 4)
    # Every group's followers stopped (for less than a stalled step takes to be reported):
    # the groups' steps wait in their collectives, so the streams that still decode now are
    # still decoding when the victim is chosen (a tiny model's streams end in a second or two:
    # a group picked idle would drain at once and be gone before the router saw it), and the
    # victim's drain cannot end before the router has seen it and the new requests are placed.
    followers = {g: [w["pid"] for w in ranks[1:]] for g, ranks in decode_groups(stack.url).items()}
    for pid in itertools.chain(*followers.values()):
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.5)  # the last tokens of streams that ended before the stop reach the router
        group = group_decoding(stack.url, clients)
        victim = decode_groups(stack.url)[group]
        leader = victim[0]["pid"]
        for pid in itertools.chain(*(pids for g, pids in followers.items() if g != group)):
            os.kill(pid, signal.SIGCONT)
        os.kill(leader, signal.SIGTERM)
        # New requests once the router has seen it draining (a Reserve that reached it before
        # its SIGTERM was handled is admitted, and finishes there, as it should).
        deadline = time.monotonic() + 10
        while not any(w["draining"] for w in workers(stack.url) if w.get("group_id") == group):
            assert time.monotonic() < deadline, (
                f"the router never saw group {group} draining: {workers(stack.url)}\n"
                + log_tail(stack)
            )
            time.sleep(0.05)
        with concurrent.futures.ThreadPoolExecutor(3) as sends:
            meanwhile = list(sends.map(lambda i: send(stack.url, f"meanwhile {i}", 4), range(3)))
        still_draining = psutil.pid_exists(leader)
    finally:
        for pid in itertools.chain(*followers.values()):
            os.kill(pid, signal.SIGCONT)
    took = exited_within(leader, DRAIN_GRACE_S)
    results = finish(pool, futures)
    for client, r in zip(clients, results, strict=True):
        assert r.error is None, r.error
        assert r.done and r.finish_reason == "length"
        assert r.text == reference[client.prompt]
        assert r.completion_tokens == tokens
        rec = record(stack.url, r.request_id)
        assert rec["migrations"] == "0", rec  # finished where it ran: nothing re-prefilled
    on_victim = [r for r in results if record(stack.url, r.request_id)["decode_group"] == group]
    assert on_victim, "no stream ran on the group told to go"
    assert still_draining, f"the group ended before the new requests were placed ({took:.1f} s)"
    for resp in meanwhile:
        assert record(stack.url, resp["id"])["decode_group"] != group
    assert "decode leader drained" in stack.log()
    wait_recovered(stack)

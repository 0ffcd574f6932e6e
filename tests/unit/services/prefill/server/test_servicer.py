"""The Prefill call's caller going away (the router cancels it: the client left, or its
deadline passed) cancels the prompt: the worker computes none of its remaining chunks."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc

from common.kv.transfer import make_sender
from common.loading.serving_model import load_prefill_model
from common.messages import KvTargetInfo, Reservation
from common.rpc.gen import prefill_pb2
from common.rpc.proto_mapping import params_to_pb, reservation_to_pb
from common.sampling.params import SamplingParams
from services.prefill.runner import LocalRunner
from services.prefill.server.servicer import PrefillServicer
from services.prefill.worker import PrefillWorker
from tests.tiny import save_hf
from tests.unit.services.prefill.test_worker_chunking import WAIT_S, Gated


class Aborted(Exception):
    pass


class CallContext:
    """The servicer's side of a call: the callbacks it registers and how it ended."""

    def __init__(self) -> None:
        self.callbacks: list = []
        self.code: grpc.StatusCode | None = None

    def add_callback(self, callback) -> bool:  # type: ignore[no-untyped-def]
        self.callbacks.append(callback)
        return True

    def invocation_metadata(self) -> tuple:
        return ()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


def test_a_cancelled_call_stops_its_prompt_between_chunks(tmp_path: Path) -> None:
    save_hf("v2-greedy", tmp_path, vocab_size=320)
    model = load_prefill_model(tmp_path, None)
    gate = Gated(model)
    worker = PrefillWorker(LocalRunner(model, make_sender("grpc", "t")), 64, chunk_tokens=16)
    target = KvTargetInfo(0, "127.0.0.1:9", "", 0, model.config.kv_lora_rank, tuple(range(5)))
    request = prefill_pb2.PrefillRequest(
        request_id="gone",
        prompt_ids=[5] * 80,
        params=params_to_pb(SamplingParams(max_tokens=4, temperature=0.0)),
        reservation=reservation_to_pb(Reservation("gone", 16, 0, 0, "float32", 30.0, (target,))),
        deadline_seconds=30.0,
    )
    context = CallContext()
    ended: list[BaseException] = []

    def call() -> None:
        try:
            PrefillServicer(worker).Prefill(request, context)  # type: ignore[arg-type]
        except Aborted as exc:
            ended.append(exc)

    caller = threading.Thread(target=call)
    try:
        caller.start()
        gate.wait_batches(1)  # its first chunk is being computed
        for callback in context.callbacks:  # what gRPC runs when the call ends early
            callback()
        gate.release.set()
        caller.join(timeout=WAIT_S)
    finally:
        gate.release.set()
        worker.close()
    assert ended and context.code == grpc.StatusCode.CANCELLED
    assert [lens for lens, _ in gate.batches] == [[16]]
    assert worker.queued_tokens == 0

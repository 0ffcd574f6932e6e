"""The leader learns each rank's KV outcome through the group's store: bytes or the rank's
error, whether the report comes before or after the leader expects it; no report by the
deadline, or a failed group, fails the job."""

from __future__ import annotations

from concurrent.futures import Future
from datetime import timedelta

import pytest
import torch.distributed as dist

from common.kv.transfer import TransferError
from common.runtime.errors import Unavailable
from common.runtime.ports import free_port
from services.prefill.group.reports import Reports, report_when_sent


def _done(value: int | None = None, error: Exception | None = None) -> Future[int]:
    fut: Future[int] = Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value or 0)
    return fut


def test_reports_resolve_the_leaders_futures() -> None:
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    failed: list[BaseException] = []
    reports = Reports("127.0.0.1", port, lambda: failed[0] if failed else None)
    try:
        report_when_sent(store, 1, 1, [_done(100), _done(20)])  # before it is expected
        early = reports.expect(1, 1, 10.0, "r1")
        pending: Future[int] = Future()
        late = reports.expect(2, 1, 10.0, "r2")
        report_when_sent(store, 2, 1, [pending, _done(5)])
        assert early.result(timeout=5) == 120
        pending.set_result(7)
        assert late.result(timeout=5) == 12
        broken = reports.expect(3, 2, 10.0, "r3")
        report_when_sent(store, 3, 2, [_done(1), _done(error=TransferError("rank 4 refused"))])
        with pytest.raises(TransferError, match=r"prefill rank 2 .*r3.*rank 4 refused"):
            broken.result(timeout=5)
        with pytest.raises(TransferError, match="no report in time"):
            reports.expect(4, 1, 0.2, "r4").result(timeout=5)
        waiting = reports.expect(5, 1, 10.0, "r5")
        failed.append(RuntimeError("rank 1 died"))
        with pytest.raises(Unavailable, match="rank 1 died"):
            waiting.result(timeout=5)
    finally:
        reports.close()

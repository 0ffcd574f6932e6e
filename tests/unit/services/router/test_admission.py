"""Admission over `RouterLoad`: bounded slots, a bounded FIFO line, bounded waits."""

from __future__ import annotations

import asyncio

import pytest

from common.runtime.errors import Overloaded
from services.router.admission import Admission
from services.router.load import RouterLoad

pytestmark = pytest.mark.anyio


def admission(
    max_inflight: int, max_waiting: int, timeout_s: float = 5.0
) -> tuple[Admission, RouterLoad, list[tuple[int, int]]]:
    load = RouterLoad(max_inflight, max_waiting, max_per_group=8)
    gauges: list[tuple[int, int]] = []
    return Admission(load, timeout_s, lambda r, w: gauges.append((r, w))), load, gauges


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_slots_then_a_fifo_line_then_429() -> None:
    adm, load, gauges = admission(max_inflight=1, max_waiting=2)
    await adm.acquire()
    served: list[str] = []

    async def waiter(name: str) -> None:
        await adm.acquire()
        served.append(name)

    tasks = [asyncio.create_task(waiter(name)) for name in ("a", "b")]
    await _settle()
    assert (load.running, load.waiting) == (1, 2)
    with pytest.raises(Overloaded, match=r"1 requests in flight and 2 waiting \(limits 1 \+ 2\)"):
        await adm.acquire()
    late = asyncio.create_task(waiter("c"))  # the line is full: refused at once
    with pytest.raises(Overloaded):
        await late
    adm.release()  # the slot goes to the first in line, never to a newcomer
    assert not load.take_slot()
    await _settle()
    assert served == ["a"]
    adm.release()
    await _settle()
    assert served == ["a", "b"]
    adm.release()
    await asyncio.gather(*tasks)
    assert (load.running, load.waiting) == (0, 0)
    assert gauges[-1] == (0, 0) and (1, 2) in gauges


async def test_a_wait_is_bounded_in_time() -> None:
    adm, load, _ = admission(max_inflight=1, max_waiting=4, timeout_s=0.05)
    await adm.acquire()
    with pytest.raises(Overloaded, match=r"no request slot became free within 0\.05 s"):
        await adm.acquire()
    assert (load.running, load.waiting) == (1, 0)
    adm.release()
    assert load.running == 0


async def test_a_waiter_cancelled_as_its_slot_arrives_hands_it_on() -> None:
    adm, load, _ = admission(max_inflight=1, max_waiting=4)
    await adm.acquire()
    first = asyncio.create_task(adm.acquire())
    second = asyncio.create_task(adm.acquire())
    await _settle()
    adm.release()  # handed to `first`...
    first.cancel()  # ...which is cancelled before it runs: `second` gets the slot
    await _settle()
    assert first.cancelled() and second.done() and second.exception() is None
    assert (load.running, load.waiting) == (1, 0)
    adm.release()
    assert load.running == 0


async def test_a_cancelled_waiter_leaves_the_line() -> None:
    adm, load, _ = admission(max_inflight=1, max_waiting=1)
    await adm.acquire()
    waiter = asyncio.create_task(adm.acquire())
    await _settle()
    waiter.cancel()
    await _settle()
    assert waiter.cancelled() and load.waiting == 0
    adm.release()
    assert load.running == 0
    await adm.acquire()  # the freed slot is there for the next request
    assert load.running == 1


async def test_each_admission_reports_its_wait_and_a_refusal_none() -> None:
    load = RouterLoad(1, 1, max_per_group=8)
    waits: list[float] = []
    adm = Admission(load, 0.5, on_admit=waits.append)
    await adm.acquire()
    assert waits == [0.0]
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0.05)
    adm.release()
    await waiter
    assert len(waits) == 2 and waits[1] >= 0.04
    with pytest.raises(Overloaded):  # the slot stays taken: the wait times out
        await Admission(load, 0.01, on_admit=waits.append).acquire()
    assert len(waits) == 2

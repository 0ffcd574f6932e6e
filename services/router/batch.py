"""Several pipeline runs answered as one response (a completions request with a batch of
prompts): start them all, then merge their outputs as they come.

Lifecycle: `start` waits for every run's Started (admission, routing, Reserve); the first
that fails closes the others (each aborts and frees its reservation) and raises. `merged`
then yields (run, output) from all runs concurrently; the first error cancels the rest and
is raised; closing it (client gone) closes every run.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from services.router.request import Output

Runs = Sequence[AsyncGenerator[Output, None]]


class _End:
    """A run's last queue item."""


async def start(runs: Runs) -> None:
    """Advance every run past its Started output; on any failure close them all."""
    try:
        for outputs in runs:
            await anext(outputs)
    except BaseException:
        await close(runs)
        raise


async def close(runs: Runs) -> None:
    """Close every run (a no-op for one that ended): a live one aborts and cleans up."""
    for outputs in runs:
        await outputs.aclose()


async def merged(runs: Runs) -> AsyncIterator[tuple[int, Output]]:
    """(run index, output) from every run, in the order they are produced."""
    if len(runs) == 1:  # the common case needs no tasks
        try:
            async for out in runs[0]:
                yield 0, out
        finally:
            await runs[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Output | _End | Exception]] = asyncio.Queue()

    async def pump(k: int, outputs: AsyncGenerator[Output, None]) -> None:
        try:
            async for out in outputs:
                queue.put_nowait((k, out))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((k, exc))
        else:
            queue.put_nowait((k, _End()))

    tasks = [asyncio.create_task(pump(k, outputs)) for k, outputs in enumerate(runs)]
    try:
        live = len(runs)
        while live:
            k, item = await queue.get()
            if isinstance(item, _End):
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        # Cancelling a pump cancels its run where it waits: the run aborts and cleans up.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close(runs)

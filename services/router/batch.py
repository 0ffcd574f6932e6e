"""Several pipeline runs answered as one response (a completions request with a batch of
prompts): start them all, then merge their outputs as they come.

Lifecycle: `start` waits for every run's Started (admission, routing, Reserve); the first
that fails closes the others (each aborts and frees its reservation) and raises. `merged`
then yields (run, output) from all runs concurrently; the first error cancels the rest and
is raised; closing it (client gone) closes every run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from services.router.request import Output

_END = object()


async def start(runs: Sequence[AsyncIterator[Output]]) -> None:
    """Advance every run past its Started output; on any failure close them all."""
    try:
        for outputs in runs:
            await anext(outputs)
    except BaseException:
        await close(runs)
        raise


async def close(runs: Sequence[AsyncIterator[Output]]) -> None:
    for outputs in runs:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()


async def merged(runs: Sequence[AsyncIterator[Output]]) -> AsyncIterator[tuple[int, Output]]:
    """(run index, output) from every run, in the order they are produced."""
    if len(runs) == 1:  # the common case needs no tasks
        async with contextlib.aclosing(runs[0]) as only:  # type: ignore[type-var]
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(k: int, outputs: AsyncIterator[Output]) -> None:
        try:
            async for out in outputs:
                await queue.put((k, out))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((k, exc))
        else:
            await queue.put((k, _END))

    tasks = [asyncio.create_task(pump(k, outputs)) for k, outputs in enumerate(runs)]
    try:
        live = len(runs)
        while live:
            k, item = await queue.get()
            if item is _END:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item  # type: ignore[misc]
    finally:
        # Cancelling a pump cancels its run where it waits: the run aborts and cleans up.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close(runs)

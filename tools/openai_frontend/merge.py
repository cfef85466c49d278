"""Several async iterators read as one: `merge(iterators)` yields their items in the
order they arrive, as the front door interleaves the `n` choices of one request, each
on its own Triton stream (each item says which choice it belongs to).

At most `limit` iterators are read at once: the next one starts when one ends (a
generator's body, here a Triton request, begins at its first read). Leaving the merge
early (the consumer breaks, is cancelled or raises), or an error from any iterator,
cancels the reads still pending and closes every iterator, so each generator's
`finally` runs before the merge returns: that is what closes the other choices' Triton
streams.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, Sequence, TypeVar

T = TypeVar("T")


async def merge(iterators: Sequence[AsyncIterator[T]], limit: Optional[int] = None) -> AsyncIterator[T]:
    """The items as they arrive; items of one iterator keep their order, and of several
    ready at once the one from the earlier iterator comes first. Iterators start in
    order, at most `limit` (default: all) being read at a time."""
    pending: dict[asyncio.Future, int] = {}
    unstarted = iter(range(len(iterators)))

    def read(position: int) -> None:
        pending[asyncio.ensure_future(iterators[position].__anext__())] = position

    def start_next() -> None:
        position = next(unstarted, None)
        if position is not None:
            read(position)

    try:
        for _ in range(min(limit or len(iterators), len(iterators))):
            start_next()
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                position = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    start_next()
                    continue
                read(position)
                yield item
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for iterator in iterators:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

"""Several async iterators read as one: `merge(iterators)` yields their items in the
order they arrive, as the front door interleaves the `n` choices of one request, each
on its own Triton stream (each item says which choice it belongs to).

Leaving the merge early (the consumer breaks, is cancelled or raises), or an error from
any iterator, cancels the reads still pending and closes every iterator, so each
generator's `finally` runs before the merge returns: that is what closes the other
choices' Triton streams.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence, TypeVar

T = TypeVar("T")


async def merge(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items as they arrive; items of one iterator keep their order, and of several
    ready at once the one from the earlier iterator comes first."""
    pending: dict[asyncio.Future, int] = {}
    try:
        for position, iterator in enumerate(iterators):
            pending[asyncio.ensure_future(iterator.__anext__())] = position
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                position = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iterators[position].__anext__())] = position
                yield item
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for iterator in iterators:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

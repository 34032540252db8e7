"""A small time-bounded cache of async lookups, one fetch in flight per key: the
front asks the API server about a service at most once per TTL however many
requests arrive for it (a burst of a thousand requests is one read, not a
thousand)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._values: dict[K, tuple[float, V]] = {}
        self._pending: dict[K, asyncio.Future[V]] = {}

    async def get(self, key: K, fetch: Callable[[], Awaitable[V]]) -> V:
        """The cached value while fresh; else one fetch shared by every caller waiting.
        A fetch that raises is not cached: each waiter sees the error, the next call retries."""
        hit = self._values.get(key)
        if hit is not None and self.clock() < hit[0]:
            return hit[1]
        pending = self._pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        try:
            value = await fetch()
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        finally:
            self._pending.pop(key, None)
        self._values[key] = (self.clock() + self.ttl_s, value)
        fut.set_result(value)
        return value

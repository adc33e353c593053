"""The Redis connection shared by ``RedisBudget`` and ``RedisCooldown``: a URL or a client.

A URL gets a new ``redis.asyncio`` client, which ``close()`` closes; a client passed in
(several parts sharing one connection pool) is used as is and left open for its owner.
"""

from __future__ import annotations

from typing import Any

from carpool.compat import Self
from carpool.extras import require


class RedisUser:
    def __init__(self, redis: str | Any) -> None:
        if isinstance(redis, str):
            require("redis", "--redis")
            import redis.asyncio as aioredis

            self._redis, self._owns_client = aioredis.from_url(redis), True
        else:
            self._redis, self._owns_client = redis, False

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

"""The shared exact cache on Redis (``--cache redis://host:port/db``).

Values are JSON strings under ``<prefix><key>``; a TTL is Redis's own expiry (``SET ...
EX``), so Redis removes expired entries itself.  Lifetime hit/miss counts live in one
hash ``<prefix>__stats__`` so every worker of a distributed job adds to the same figures.
"""

from __future__ import annotations

import json
import math
import threading

from carpool.compat import Self
from carpool.extras import require

DEFAULT_PREFIX = "carpool:cache:v1:"
_STATS_SUFFIX = "__stats__"
_COUNTERS = ("hits", "misses", "puts")


class RedisStore:
    backend = "redis"

    def __init__(self, url: str, ttl_s: float | None = None, prefix: str = DEFAULT_PREFIX, client=None) -> None:
        require("redis", f"the Redis cache {_redact(url)}")
        import redis  # imported here: the SQLite default must not need the redis package

        self.url = url
        self.ttl_s = ttl_s
        self.prefix = prefix
        self._stats_key = prefix + _STATS_SUFFIX
        self._redis = client or redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10)
        self._lock = threading.Lock()
        self._session = dict.fromkeys(_COUNTERS, 0)
        try:
            self._redis.ping()
        except redis.RedisError as exc:
            raise ConnectionError(
                f"cannot reach the Redis cache at {url}: {exc}. Start redis-server or pass --cache off"
            ) from exc

    def _count(self, pipe, name: str) -> None:
        with self._lock:
            self._session[name] += 1
        pipe.hincrby(self._stats_key, name, 1)

    def get(self, key: str) -> dict | None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.get(self.prefix + key)
        value = pipe.execute()[0]
        pipe = self._redis.pipeline(transaction=False)
        self._count(pipe, "misses" if value is None else "hits")
        pipe.execute()
        return None if value is None else json.loads(value)

    def put(self, key: str, response: dict, ttl_s: float | None = None) -> None:
        ttl = self.ttl_s if ttl_s is None else ttl_s
        value = json.dumps(response, ensure_ascii=False, separators=(",", ":"))
        pipe = self._redis.pipeline(transaction=False)
        if ttl is None:
            pipe.set(self.prefix + key, value)
        else:
            # PX keeps sub-second TTLs exact; Redis needs at least 1 ms.
            pipe.set(self.prefix + key, value, px=max(1, math.ceil(ttl * 1000)))
        self._count(pipe, "puts")
        pipe.execute()

    def _keys(self):
        for raw in self._redis.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000):
            if not raw.endswith(_STATS_SUFFIX.encode()):
                yield raw

    def stats(self) -> dict:
        entries = payload = 0
        batch: list[bytes] = []

        def measure(keys: list[bytes]) -> int:
            pipe = self._redis.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(k)
            return sum(len(k) + n for k, n in zip(keys, pipe.execute(), strict=False))

        for raw in self._keys():
            batch.append(raw)
            entries += 1
            if len(batch) >= 1000:
                payload += measure(batch)
                batch = []
        if batch:
            payload += measure(batch)
        lifetime = {k.decode(): int(v) for k, v in self._redis.hgetall(self._stats_key).items()}
        server = self._redis.info("stats")
        with self._lock:
            session = dict(self._session)
        lookups = session["hits"] + session["misses"]
        return {
            "backend": self.backend,
            "location": _redact(self.url),
            "prefix": self.prefix,
            "entries": entries,
            "bytes": payload,  # keys + JSON values, as STRLEN counts them
            "ttl_s": self.ttl_s,
            **session,
            # Redis drops expired keys itself, so carpool cannot count them per prefix;
            # the server-wide figure is the closest honest number.
            "expired": None,
            "server_expired_keys": server.get("expired_keys"),
            "hit_rate": session["hits"] / lookups if lookups else 0.0,
            "lifetime": {name: lifetime.get(name, 0) for name in _COUNTERS},
        }

    def clear(self) -> None:
        """Delete this prefix's entries and counters; other keys in the database stay."""
        batch: list[bytes] = []
        for raw in self._keys():
            batch.append(raw)
            if len(batch) >= 1000:
                self._redis.delete(*batch)
                batch = []
        if batch:
            self._redis.delete(*batch)
        self._redis.delete(self._stats_key)

    def close(self) -> None:
        self._redis.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _redact(url: str) -> str:
    """Hide a password in ``redis://user:secret@host``."""
    head, sep, tail = url.partition("@")
    if not sep or "://" not in head:
        return url
    scheme, _, cred = head.partition("://")
    user = cred.split(":", 1)[0]
    return f"{scheme}://{user}:***@{tail}"

"""The shared exact cache on Redis (``--cache redis://host:port/db``).

Values are JSON strings under ``<prefix><key>``; a TTL is Redis's own expiry (``SET ...
EX``), so Redis removes expired entries itself.  Lifetime hit/miss counts live in one
hash ``<prefix>__stats__`` so every worker of a distributed job adds to the same figures.

``carpool cache clear --model NAME`` needs to find one model's entries without reading
them: each ``put`` adds the key to an index set ``<prefix>__index__:n=<hex
namespace>:m=<hex model>`` (hex, so any name is safe inside a SCAN pattern).  The set lives
as long as its longest-lived entry (a Lua script extends its expiry, never shortens it),
so expired entries do not leave sets behind for ever.  Entries written before the index
existed are read as before but only a full ``clear`` removes them.
"""

from __future__ import annotations

import json
import math
import threading

from carpool.compat import Self
from carpool.extras import require

DEFAULT_PREFIX = "carpool:cache:v1:"
_STATS_SUFFIX = "__stats__"
_INDEX = "__index__:"
_COUNTERS = ("hits", "misses", "puts")

# KEYS[1] the entry, KEYS[2] its index set; ARGV: the value, the TTL in ms ("": never).
# The set's expiry only grows: it must outlive every entry it lists.
_PUT_SCRIPT = """
local existed = redis.call('EXISTS', KEYS[2])
if ARGV[2] == '' then
  redis.call('SET', KEYS[1], ARGV[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
redis.call('SADD', KEYS[2], KEYS[1])
if ARGV[2] == '' then
  redis.call('PERSIST', KEYS[2])
else
  local left = redis.call('PTTL', KEYS[2])
  if existed == 0 or (left >= 0 and left < tonumber(ARGV[2])) then
    redis.call('PEXPIRE', KEYS[2], ARGV[2])
  end
end
return 1
"""


def _index_part(text: str) -> str:
    return text.encode().hex()


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
        self._put_script = self._redis.register_script(_PUT_SCRIPT)
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

    def put(self, key: str, response: dict, ttl_s: float | None = None, *, model: str | None = None,
            namespace: str = "") -> None:
        """``model`` / ``namespace``: the index ``clear`` selects the entry by."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        value = json.dumps(response, ensure_ascii=False, separators=(",", ":"))
        # PX keeps sub-second TTLs exact; Redis needs at least 1 ms.
        px = "" if ttl is None else str(max(1, math.ceil(ttl * 1000)))
        pipe = self._redis.pipeline(transaction=False)
        self._put_script(keys=[self.prefix + key, self._index_key(model or "", namespace)],
                         args=[value, px], client=pipe)
        self._count(pipe, "puts")
        pipe.execute()

    def _index_key(self, model: str, namespace: str) -> str:
        return f"{self.prefix}{_INDEX}n={_index_part(namespace)}:m={_index_part(model)}"

    def _keys(self):
        """The entry keys of this prefix (not its counters nor its index sets)."""
        own = (self.prefix + "__").encode()
        for raw in self._redis.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000):
            if not raw.startswith(own):
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
        lifetime = {(k.decode() if isinstance(k, bytes) else k): int(v)
                    for k, v in self._redis.hgetall(self._stats_key).items()}
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

    def clear(self, model: str | None = None, namespace: str | None = None) -> int:
        """Delete the entries of ``model`` and/or ``namespace`` (found through the index sets),
        or, both None, every entry of this prefix, its counters and index sets; other keys in
        the database stay.  Returns how many entries were deleted."""
        if model is None and namespace is None:
            gone = self._delete_all(self._keys())
            self._delete_all(self._redis.scan_iter(match=_glob_escape(self.prefix + _INDEX) + "*", count=1000))
            self._redis.delete(self._stats_key)
            return gone
        ns = "*" if namespace is None else _index_part(namespace)
        m = "*" if model is None else _index_part(model)
        gone = 0
        for index in list(self._redis.scan_iter(match=f"{_glob_escape(self.prefix + _INDEX)}n={ns}:m={m}",
                                                count=1000)):
            gone += self._delete_all(self._redis.sscan_iter(index, count=1000))
            self._redis.delete(index)
        return gone

    def _delete_all(self, keys) -> int:
        gone = 0
        batch: list[bytes] = []
        for raw in keys:
            batch.append(raw)
            if len(batch) >= 1000:
                gone += self._redis.delete(*batch)
                batch = []
        if batch:
            gone += self._redis.delete(*batch)
        return gone

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

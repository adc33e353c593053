"""Cache-aware routing: the tasks of one prefix group stay on one endpoint.

Each replica has a prefix cache of its own.  Sent by load alone, a document's questions
land on every replica, and each computes the document; sent to the replica that saw the
prefix last, it is computed once.  Sticking to a replica must not pile work on it, so a
group follows its replica only while that one is not overloaded: its requests in flight
(per unit of weight) may exceed the least loaded endpoint's by ``abs_slack`` plus
``rel_slack`` of that, and beyond the request goes to the least loaded one, as SGLang's
router balances its cache-aware choice.  The group keeps its replica for when the load
evens out again.

A request's prefix keys are hashes of its prompt's start at lengths that double
(``LEVELS``), only the two longest shorter than the prompt: a key then covers at least a
quarter of the prompt, so a short shared start (an instruction) does not pin every task
to one replica, while a document's questions share their document's keys.  The map from
key to endpoint is bounded (least recently used keys are forgotten).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

LEVELS = (512, 1024, 2048, 4096, 8192, 16384, 32768)  # characters, about 4 to a token


def prompt_text(body: object, limit: int = LEVELS[-1]) -> str | None:
    """The start of a request's prompt as the server sees it (chat messages in order, a
    completion prompt or an embedding input), up to ``limit`` characters; a raw task record
    (an OpenAI Batch line: the request in ``body``) is read the same way.  None when there is none."""
    if not isinstance(body, dict):
        return None
    inner = body.get("body")
    if isinstance(inner, dict):
        body = inner
    msgs = body.get("messages")
    if isinstance(msgs, list):
        parts, n = [], 0
        for m in msgs:
            if not isinstance(m, dict):
                return None
            c = m.get("content")
            part = f"{m.get('role')}:{c if isinstance(c, str) else json.dumps(c, sort_keys=True)}\n"
            parts.append(part)
            n += len(part)
            if n >= limit:
                break
        return "".join(parts)[:limit]
    for name in ("prompt", "input"):
        v = body.get(name)
        if isinstance(v, str):
            return v[:limit]
        if isinstance(v, list) and v and isinstance(v[0], str):
            return v[0][:limit]
    return None


def h64(text: str) -> int:
    """A stable 64-bit hash of a text (the same in every process, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def prefix_keys(body: dict) -> tuple[int, ...]:
    """The request's prefix keys, longest first (empty: a prompt too short to matter)."""
    text = prompt_text(body, LEVELS[-1] + 1)
    if text is None:
        return ()
    shorter = [lv for lv in LEVELS if lv < len(text)]
    return tuple(h64(text[:lv]) for lv in reversed(shorter[-2:]))


class Loaded(Protocol):
    outstanding: int

    @property
    def weight(self) -> float: ...


E = TypeVar("E", bound=Loaded)


class Affinity:
    """Which endpoint holds which prefix, and whether a request may follow it."""

    def __init__(self, abs_slack: int = 4, rel_slack: float = 0.5, max_keys: int = 1 << 17):
        self.abs_slack, self.rel_slack, self.max_keys = abs_slack, rel_slack, max_keys
        self._where: OrderedDict[int, Loaded] = OrderedDict()
        self.followed = 0  # requests sent to their group's endpoint
        self.overflowed = 0  # requests of a known group sent elsewhere: its endpoint was overloaded

    def choose(self, keys: Sequence[int], ready: Sequence[E], least_loaded: Callable[[list[E]], E]) -> E:
        """The endpoint for a request with ``keys`` among ``ready`` (all eligible: same tier, up)."""
        home = self._home(keys, ready)
        if home is not None:
            least = min(e.outstanding / e.weight for e in ready)
            if home.outstanding / home.weight <= least + self.abs_slack + self.rel_slack * least:
                self.followed += 1
                self._remember(keys, home, ready)
                return home
            self.overflowed += 1
            return least_loaded(list(ready))
        ep = least_loaded(list(ready))
        self._remember(keys, ep, ready)
        return ep

    def _home(self, keys: Sequence[int], ready: Sequence[E]) -> E | None:
        for k in keys:
            ep = self._where.get(k)
            for e in ready:
                if ep is e:
                    return e
        return None

    def _remember(self, keys: Sequence[int], ep: E, ready: Sequence[E]) -> None:
        """Point the keys at ``ep`` unless they point at another endpoint that is still eligible."""
        for k in keys:
            cur = self._where.get(k)
            if cur is None or cur is ep or not any(cur is e for e in ready):
                self._where[k] = ep
            self._where.move_to_end(k)
        while len(self._where) > self.max_keys:
            self._where.popitem(last=False)

    def summary(self) -> dict:
        return {"followed": self.followed, "overflowed": self.overflowed, "keys": len(self._where)}

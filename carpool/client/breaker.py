"""Circuit breakers: is an endpoint down, and is every endpoint down (then the job pauses)?

An outage (a server restart, a deploy, a network cut) must not turn the tasks in flight,
and every task dispatched until the server is back, into failures.  Each endpoint has a
``CircuitBreaker``:

- closed: requests go.  Failures where the endpoint gave no answer at all (the
  connection refused or timed out, dropped, or a read that timed out) are counted; a
  refused connection opens the breaker at once (nothing listens: every request would be
  refused too), the others after ``failures_to_open`` in a row.  Any answer (a success,
  but also a 4xx or a 5xx: the server is there) ends the streak.
- open: no request is sent to the endpoint.  A probe (``GET <base>/models``, answered
  by OpenAI, vLLM, SGLang and carpool serve; any HTTP answer below 500 counts) is sent
  after a wait that doubles after each failed probe, up to ``probe_cap_s``.
- half-open: the probe is in flight; its answer closes the breaker or opens it again.

The probe is a separate small request, not one of the job's: a sampled task sent as a
probe into a server that hangs would end ``maybe_executed``.

``OutageGate`` looks at all the breakers of a backend: when none is closed the job is
paused; ``wait`` holds a request back until one closes, and gives up once the outage is
older than the outage timeout (``OutageTimeout``: the job stops, exit code 4, and a rerun
resumes).  The executor waits there before it takes a concurrency slot, so a paused job
holds no slots and its limiter learns nothing from the outage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from carpool.client.retry import ErrorKind
from carpool.compat import StrEnum
from carpool.errors import OutageTimeout

# Failures where the endpoint did not answer at all (no HTTP status): an outage looks like these.
NO_ANSWER = frozenset({ErrorKind.CONNECT, ErrorKind.RESET, ErrorKind.TRUNCATED, ErrorKind.READ_TIMEOUT,
                       ErrorKind.TOTAL_TIMEOUT})


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class BreakerPolicy:
    failures_to_open: int = 3  # no-answer failures in a row (a refused connection opens at once)
    probe_first_s: float = 0.5  # first probe this long after the breaker opens
    probe_cap_s: float = 5.0  # probes back off (doubling) up to this interval: at most this late after recovery
    probe_timeout_s: float = 5.0  # a probe with no answer within this is a failed probe


class CircuitBreaker:
    def __init__(self, policy: BreakerPolicy | None = None, on_close: Callable[[], None] | None = None):
        self.policy = policy or BreakerPolicy()
        self.state = State.CLOSED
        self.streak = 0  # no-answer failures in a row
        self.opened_at = 0.0  # monotonic
        self.opened_wall = 0.0  # time.time() of the same moment, for messages
        self.next_probe = 0.0
        self.probe_wait = self.policy.probe_first_s
        self.probes = 0  # probes sent while open (for the summary)
        self.last_error = ""  # why it opened / why the last probe failed
        self._on_close = on_close  # a callable, told when the breaker closes

    @property
    def closed(self) -> bool:
        return self.state == State.CLOSED

    def on_answer(self) -> None:
        """The endpoint answered (any HTTP status): it is up."""
        self.streak = 0
        if self.state != State.CLOSED:
            self._close()

    def on_no_answer(self, kind: ErrorKind, message: str = "", now: float | None = None) -> None:
        """A request to the endpoint failed without an HTTP answer."""
        self.streak += 1
        if self.state == State.CLOSED and (kind == ErrorKind.CONNECT or self.streak >= self.policy.failures_to_open):
            self._open(message or str(kind), time.monotonic() if now is None else now)

    def probe_due(self, now: float) -> bool:
        return self.state == State.OPEN and now >= self.next_probe

    def start_probe(self) -> None:
        self.state = State.HALF_OPEN
        self.probes += 1

    def probe_failed(self, message: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.state = State.OPEN
        self.last_error = message
        self.probe_wait = min(self.policy.probe_cap_s, self.probe_wait * 2)
        self.next_probe = now + self.probe_wait

    def _open(self, message: str, now: float) -> None:
        self.state = State.OPEN
        self.opened_at, self.opened_wall = now, time.time() - (time.monotonic() - now)
        self.last_error = message
        self.probe_wait = self.policy.probe_first_s
        self.next_probe = now + self.probe_wait

    def _close(self) -> None:
        self.state = State.CLOSED
        self.streak = 0
        self.probe_wait = self.policy.probe_first_s
        if self._on_close is not None:
            self._on_close()


@dataclass
class Outage:
    """One period during which every endpoint was down."""

    start_wall: float  # time.time()
    start: float  # monotonic
    end: float | None = None  # monotonic; None while it lasts

    def seconds(self, now: float | None = None) -> float:
        return ((self.end if self.end is not None else (time.monotonic() if now is None else now))
                - self.start)


def clock_text(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall))


@dataclass
class OutageGate:
    """All the breakers of one backend as one: paused or not, since when, for how long."""

    breakers: list[CircuitBreaker]
    history: list[Outage] = field(default_factory=list)  # the last ``keep`` outages
    count: int = 0  # outages seen
    total_s: float = 0.0  # time paused, finished outages
    keep: int = 50

    def __post_init__(self) -> None:
        self._changed: asyncio.Event | None = None
        self._current: Outage | None = None
        for b in self.breakers:
            b._on_close = self._breaker_closed

    # -- state ------------------------------------------------------------------------------
    def down(self) -> bool:
        """True while no endpoint is closed (and records the start or end of an outage)."""
        down = not any(b.closed for b in self.breakers)
        if down and self._current is None:
            # The outage began when the last endpoint went down.
            start = max(b.opened_at for b in self.breakers)
            wall = max(b.opened_wall for b in self.breakers)
            self._current = Outage(wall, start)
            self.count += 1
            self.history.append(self._current)
            del self.history[:-self.keep]
        elif not down and self._current is not None:
            self._end()
        return down

    @property
    def current(self) -> Outage | None:
        """The outage going on now, if any."""
        self.down()
        return self._current

    def paused_s(self) -> float:
        """Seconds paused so far, the current outage included."""
        cur = self.current
        return self.total_s + (cur.seconds() if cur is not None else 0.0)

    def expired(self, timeout_s: float) -> bool:
        cur = self.current
        return cur is not None and cur.seconds() > timeout_s

    def status(self) -> str:
        """"paused: endpoint down since HH:MM:SS (N s; why)" during an outage, else ""."""
        cur = self.current
        if cur is None:
            return ""
        what = "endpoint" if len(self.breakers) == 1 else f"all {len(self.breakers)} endpoints"
        why = self.breakers[0].last_error if len(self.breakers) == 1 else ""
        return (f"paused: {what} down since {clock_text(cur.start_wall)} ({cur.seconds():.0f} s"
                + (f"; {_short(why)}" if why else "") + ")")

    # -- waiting ----------------------------------------------------------------------------
    async def wait(self, timeout_s: float, max_wait_s: float = 1.0) -> bool:
        """True at once if an endpoint is up; else wait up to ``max_wait_s`` for one to come
        back (True) or not (False: ask again); raise ``OutageTimeout`` once the outage is
        older than ``timeout_s``."""
        if not self.down():
            return True
        cur = self._current
        assert cur is not None
        left = timeout_s - cur.seconds()
        if left <= 0:
            raise OutageTimeout(self.status())
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=min(left, max_wait_s))
        except (TimeoutError, asyncio.TimeoutError):
            return not self.down()
        return True

    def _breaker_closed(self) -> None:
        if self._current is not None and any(b.closed for b in self.breakers):
            self._end()
        if self._changed is not None:
            self._changed.set()
            self._changed = None  # the next waiters wait on a fresh event

    def _end(self) -> None:
        cur = self._current
        if cur is not None:
            cur.end = time.monotonic()
            self.total_s += cur.seconds()
            self._current = None

    def summary(self) -> dict:
        """What the job summary says about outages."""
        cur = self.current
        return {
            "outages": self.count,
            "paused_s": round(self.paused_s(), 1),
            "down_since": clock_text(cur.start_wall) if cur is not None else None,
            "periods": [{"start": clock_text(o.start_wall), "seconds": round(o.seconds(), 1)}
                        for o in self.history],
        }


def _short(text: str, n: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."

"""Splits a server-sent-events byte stream into the ``data`` payloads of its events.

Written here rather than iterating ``aiohttp``'s ``StreamReader`` by line because that
raises on a line longer than its buffer limit (128 KiB): one chunk of vLLM's
``prompt_logprobs`` for a long prompt, or ``top_logprobs=20`` over a long piece, is larger.
The rules are the WHATWG ones a JSON API uses: lines end in LF, CRLF or CR; an event ends
at a blank line; its ``data:`` lines are joined with LF (one leading space after the colon
is dropped); comment lines (``:``) and other fields (``event:``, ``id:``, ``retry:``) are
ignored.  An event still open when the stream ends is dispatched (some servers do not end
the last event with a blank line).
"""

from __future__ import annotations

from carpool.errors import EventTooLarge

MAX_EVENT_BYTES = 64 * 1024 * 1024  # far above any real chunk; a bound against a runaway server


class SSEReader:
    """``feed(bytes) -> payloads`` of the events completed so far; ``close() -> payloads`` at the end."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES):
        self._buf = bytearray()
        self._data: list[bytes] = []
        self._event_bytes = 0
        self._max = max_event_bytes
        self._cr_pending = False  # the last byte fed was CR: a following LF belongs to it

    def feed(self, data: bytes) -> list[bytes]:
        if self._cr_pending and data[:1] == b"\n":
            data = data[1:]
        self._cr_pending = data[-1:] == b"\r"
        self._buf += data
        out: list[bytes] = []
        start = 0
        buf = self._buf
        while True:
            lf = buf.find(b"\n", start)
            cr = buf.find(b"\r", start)
            if lf < 0 and cr < 0:
                break
            if cr < 0 or (0 <= lf < cr):
                end, nxt = lf, lf + 1
            elif cr + 1 < len(buf) and buf[cr + 1] == 0x0A:
                end, nxt = cr, cr + 2
            else:
                end, nxt = cr, cr + 1
            self._line(bytes(buf[start:end]), out)
            start = nxt
        del buf[:start]
        if len(buf) + self._event_bytes > self._max:
            raise EventTooLarge(f"a stream event is over {self._max} bytes")
        return out

    def close(self) -> list[bytes]:
        out: list[bytes] = []
        if self._buf:
            self._line(bytes(self._buf), out)
            self._buf.clear()
        self._dispatch(out)
        return out

    def _line(self, line: bytes, out: list[bytes]) -> None:
        if not line:
            self._dispatch(out)
            return
        if line.startswith(b":"):
            return
        name, sep, value = line.partition(b":")
        if name != b"data":
            return
        if sep and value.startswith(b" "):
            value = value[1:]
        self._data.append(value)
        self._event_bytes += len(value)
        if self._event_bytes > self._max:
            raise EventTooLarge(f"a stream event is over {self._max} bytes")

    def _dispatch(self, out: list[bytes]) -> None:
        if self._data:
            out.append(b"\n".join(self._data))
            self._data = []
            self._event_bytes = 0

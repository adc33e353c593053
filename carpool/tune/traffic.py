"""A day's traffic, hour by hour, from a file (``carpool tune --traffic FILE``).

Two shapes are read:

- **hourly rates**: a CSV with an hour column (``hour``; 0-23, ``HH:MM`` or a timestamp) and a
  rate column (``req_s``, ``rate``, ``qps`` or ``rps``), or JSONL objects with the same keys.
  An hour's peak is its rate: the file says nothing finer.
- **arrival times**: a CSV with a ``timestamp`` (or ``arrival``, ``time``, ``ts``) column, a
  JSONL of such objects or of bare numbers: seconds (Unix time, read as UTC hours; or from 0,
  the start of the day) or ISO 8601.  Each hour's rate is its arrivals / 3600, and its peak
  the busiest five minutes of it.  A log longer than a day is folded onto the hours of the
  day, keeping each hour's busiest day: capacity is planned for the worst day seen.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from carpool.errors import TrafficFileError
from carpool.tune.workload import jsonl_values

RATE_KEYS = ("req_s", "rate", "qps", "rps", "requests_per_s", "req_per_s")
TIME_KEYS = ("timestamp", "arrival", "time", "ts", "arrival_time")
PEAK_WINDOW_S = 300.0  # the peak of an hour: its busiest five minutes


@dataclass(frozen=True)
class HourLoad:
    hour: int  # 0-23
    rate: float  # mean req/s over the hour
    peak: float  # req/s in the hour's busiest five minutes (the rate, for an hourly file)


def _seconds(value: object, where: str) -> float:
    """A timestamp as seconds: a number, or ISO 8601 text."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise TrafficFileError(f"{where}: {text!r} is neither seconds nor an ISO 8601 time") from None
    # A time without a zone is read as UTC, not as this machine's local time: the hours of the
    # day must not move with the planner's time zone.
    return (when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)).timestamp()


def _hour(value: object, where: str) -> int:
    text = str(value).strip()
    try:
        h = float(text)
    except ValueError:
        try:
            h = datetime.fromisoformat(text.replace("Z", "+00:00")).hour if "-" in text else int(text.split(":")[0])
        except ValueError:
            raise TrafficFileError(f"{where}: hour {text!r}: write 0-23, HH:MM or a timestamp") from None
    if not (0 <= h < 24 and h == int(h)):
        raise TrafficFileError(f"{where}: hour {text!r} is not a whole hour of the day (0-23)")
    return int(h)


def _rows(path: Path) -> list[dict]:
    """The file's records: CSV rows by header, JSONL objects, or bare JSONL numbers."""
    text = path.read_text(encoding="utf-8-sig")  # -sig: Excel's "CSV UTF-8" starts with a byte order mark
    first = next((line for line in text.splitlines() if line.strip()), "")
    if not first:
        raise TrafficFileError(f"--traffic {path}: the file is empty")
    if first.lstrip().startswith(("{", "[")) or _is_number(first):
        values = jsonl_values(text.splitlines(), f"--traffic {path}", TrafficFileError)
        return [v if isinstance(v, dict) else {"timestamp": v} for _, v in values]
    return [{(k or "").strip().lower(): v for k, v in row.items()} for row in csv.DictReader(io.StringIO(text))]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _key(row: dict, keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if k in row), None)


def _hourly(rows: list[dict], rate_key: str, where: str) -> list[HourLoad]:
    hours: dict[int, float] = {}
    for n, row in enumerate(rows, 2):
        if "hour" not in row:
            raise TrafficFileError(f"{where}: row {n} has a {rate_key} but no hour")
        h = _hour(row["hour"], f"{where}: row {n}")
        try:
            rate = float(row[rate_key])
        except (TypeError, ValueError):
            raise TrafficFileError(f"{where}: row {n}: {rate_key} {row[rate_key]!r} is not a number") from None
        if rate < 0 or math.isnan(rate):
            raise TrafficFileError(f"{where}: row {n}: {rate_key} must be >= 0")
        if h in hours:
            raise TrafficFileError(f"{where}: hour {h} is given twice")
        hours[h] = rate
    return [HourLoad(h, hours.get(h, 0.0), hours.get(h, 0.0)) for h in range(24)]


def _arrivals(times: list[float]) -> list[HourLoad]:
    """Rates and five-minute peaks per hour of the day; a multi-day log keeps each hour's busiest day."""
    counts: dict[tuple[int, int], int] = defaultdict(int)  # (day, hour) -> arrivals
    windows: dict[tuple[int, int], int] = defaultdict(int)  # (day, five-minute slot) -> arrivals
    for t in times:
        counts[(int(t // 86400), int(t % 86400 // 3600))] += 1
        windows[(int(t // 86400), int(t % 86400 // PEAK_WINDOW_S))] += 1
    per_hour = int(3600 / PEAK_WINDOW_S)
    out = []
    for h in range(24):
        days = [d for d, hh in counts if hh == h]
        rate = max((counts[(d, h)] for d in days), default=0) / 3600.0
        peak = max((windows.get((d, h * per_hour + k), 0) for d in days for k in range(per_hour)), default=0)
        out.append(HourLoad(h, rate, max(peak / PEAK_WINDOW_S, rate)))
    return out


def read(path: str) -> list[HourLoad]:
    """The 24 hours of ``path`` (hours it leaves out carry no traffic)."""
    p = Path(path)
    try:
        rows = _rows(p)
    except OSError as e:
        raise TrafficFileError(f"--traffic {path}: {e.strerror or e}") from None
    except (csv.Error, UnicodeDecodeError) as e:
        raise TrafficFileError(f"--traffic {path}: not CSV or JSONL ({e})") from None
    if not rows:
        raise TrafficFileError(f"--traffic {path}: no rows")
    rate_key, time_key = _key(rows[0], RATE_KEYS), _key(rows[0], TIME_KEYS)
    if rate_key:
        return _hourly(rows, rate_key, f"--traffic {path}")
    if time_key:
        return _arrivals([_seconds(r.get(time_key), f"--traffic {path}: row {n}") for n, r in enumerate(rows, 1)])
    raise TrafficFileError(f"--traffic {path}: no rate column ({', '.join(RATE_KEYS)}) with an hour, and no "
                           f"arrival-time column ({', '.join(TIME_KEYS)})")

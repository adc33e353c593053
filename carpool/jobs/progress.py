"""The live progress bar: done/total, req/s, tok/s, errors, cache hits, ETA.

Drawn on stderr with rich when stderr is a terminal (or ``--progress``); otherwise a plain
status line every ``log_every_s`` seconds so logs of long jobs show that they move.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from carpool.jobs.summary import JobStats

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID


class Progress:
    def __init__(self, stats: JobStats, enabled: bool | None = None, log_every_s: float = 30.0):
        self.stats = stats
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        # Not a terminal and not switched off: a plain status line now and then, for logs.
        self.log_lines = enabled is None and not self.enabled
        self.log_every_s = log_every_s
        self._last_log = time.monotonic()
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        self._rate_points: list[tuple[float, int, int]] = []  # (t, done, tokens) for a moving rate

    def start(self) -> None:
        if not self.enabled:
            return
        from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]carpool run"),
            BarColumn(),
            TextColumn("{task.completed:,.0f}/{task.fields[total_s]}"),
            TextColumn("{task.fields[rates]}"),
            TextColumn("[red]{task.fields[errors]} err"),
            TextColumn("[green]{task.fields[hits]} cached"),
            TimeRemainingColumn(),
            transient=False, refresh_per_second=4,
        )
        self._bar.start()
        self._task = self._bar.add_task("run", total=None, total_s="?", rates="", errors=0, hits=0)

    def _rates(self) -> tuple[float, float]:
        now = time.monotonic()
        s = self.stats
        self._rate_points.append((now, s.done, s.tokens))
        while len(self._rate_points) > 2 and now - self._rate_points[0][0] > 10.0:
            self._rate_points.pop(0)
        t0, d0, k0 = self._rate_points[0]
        dt = now - t0
        if dt <= 0:
            return 0.0, 0.0
        return (s.done - d0) / dt, (s.tokens - k0) / dt

    def update(self, extra: str = "") -> None:
        s = self.stats
        rps, tps = self._rates()
        completed = s.done + s.skipped
        hits = s.cache_hits + s.semantic_hits + s.dedup_fanouts
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=completed, total=s.total,
                             total_s=f"{s.total:,}" if s.total is not None else "?",
                             rates=f"{rps:,.1f} req/s {tps:,.0f} tok/s{extra}", errors=s.n_errors, hits=hits)
        elif self.log_lines and time.monotonic() - self._last_log >= self.log_every_s:
            self._last_log = time.monotonic()
            total = "?" if s.total is None else f"{s.total:,}"
            print(f"carpool run: {completed:,}/{total} done, {rps:,.1f} req/s, {tps:,.0f} tok/s, "
                  f"{s.n_errors} errors, {hits} cached{extra}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self._bar is not None:
            self.update()
            self._bar.stop()
            self._bar = None

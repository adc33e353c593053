"""The live progress bar: done/total, req/s, tok/s, errors, answers reused, ETA.

Reused answers are named by where they came from, since each says something else: the
result cache (``cached``: an earlier run paid for it), the semantic cache (``semantic``)
and dedup (``deduplicated``: a copy of an identical task of this run, which happens with
the cache off too).

In Jupyter (an IPython kernel) it is a tqdm bar (``tqdm.auto``: the ipywidgets bar when
ipywidgets is installed, text otherwise), since rich's live display and stderr status
lines do not redraw in a notebook.  Elsewhere it is drawn on stderr with rich when stderr
is a terminal (or ``--progress``); otherwise a plain status line every ``log_every_s``
seconds so logs of long jobs show that they move.  ``enabled=False`` draws nothing.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from carpool.jobs.summary.stats import JobStats

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID


def in_notebook() -> bool:
    """True inside a Jupyter kernel (IPython imported by ipykernel), without importing either."""
    if "ipykernel" not in sys.modules or "IPython" not in sys.modules:
        return False
    ip = sys.modules["IPython"].get_ipython()
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def reuse_text(stats: JobStats) -> str:
    """``12 cached, 3 deduplicated``: the answers of this run that were not sent for, by their
    source; ``cached`` shows while the result cache is on (a 0 there says it is on and missed),
    the others once they happened; "" when there is nothing to say."""
    cache_on = not stats.cache_backend.startswith("off")
    parts = [f"{n:,} {what}" for n, what, show in (
        (stats.cache_hits, "cached", cache_on or stats.cache_hits),
        (stats.semantic_hits, "semantic", stats.semantic_hits),
        (stats.dedup_fanouts, "deduplicated", stats.dedup_fanouts)) if show]
    return ", ".join(parts)


class Progress:
    def __init__(self, stats: JobStats, enabled: bool | None = None, log_every_s: float = 30.0,
                 notebook: bool | None = None):
        """``notebook``: draw with tqdm (None: when running in Jupyter)."""
        self.stats = stats
        self._tqdm: Any = None
        self.notebook = enabled is not False and (in_notebook() if notebook is None else notebook)
        if self.notebook:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # no tqdm: the status lines below
                self.notebook = False
            else:
                self._tqdm_cls = tqdm
        if self.notebook:
            enabled = True
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
        if self.notebook:
            self._tqdm = self._tqdm_cls(total=None, desc="carpool run", unit="task", file=sys.stderr)
            return
        from rich.console import Console
        from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]carpool run"),
            BarColumn(),
            TextColumn("{task.completed:,.0f}/{task.fields[total_s]}"),
            TextColumn("{task.fields[rates]}"),
            TextColumn("[red]{task.fields[errors]} err"),
            TextColumn("[green]{task.fields[reused]}"),
            TimeRemainingColumn(),
            # stderr, as every message of a job: stdout is the caller's (--summary-json -).
            console=Console(stderr=True), transient=False, refresh_per_second=4,
        )
        self._bar.start()
        self._task = self._bar.add_task("run", total=None, total_s="?", rates="", errors=0, reused="")

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
        reused = reuse_text(s)
        extra = s.prompt_reuse.progress_text() + extra
        if self._tqdm is not None:
            if s.total is not None and self._tqdm.total != s.total:
                self._tqdm.total = s.total
            self._tqdm.n = completed
            self._tqdm.set_postfix_str(f"{rps:,.1f} req/s, {tps:,.0f} tok/s, {s.n_errors} err"
                                       f"{', ' + reused if reused else ''}{extra}", refresh=True)
        elif self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=completed, total=s.total,
                             total_s=f"{s.total:,}" if s.total is not None else "?",
                             rates=f"{rps:,.1f} req/s {tps:,.0f} tok/s{extra}", errors=s.n_errors, reused=reused)
        elif self.log_lines and time.monotonic() - self._last_log >= self.log_every_s:
            self._last_log = time.monotonic()
            total = "?" if s.total is None else f"{s.total:,}"
            print(f"carpool run: {completed:,}/{total} done, {rps:,.1f} req/s, {tps:,.0f} tok/s, "
                  f"{s.n_errors} errors{', ' + reused if reused else ''}{extra}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self._tqdm is not None:
            self.update()
            self._tqdm.close()
            self._tqdm = None
        if self._bar is not None:
            self.update()
            self._bar.stop()
            self._bar = None

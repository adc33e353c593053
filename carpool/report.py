"""Self-contained HTML report pages: tables and matplotlib plots as base64 PNGs.

Each ``--report`` says what to show (``carpool.jobs.summary.html_report`` for ``carpool run``,
``carpool.bench.report`` for ``carpool bench``, ``carpool.tune.report`` for ``carpool
simulate``); this module draws headless (matplotlib's Agg backend, no display on servers
and CI), encodes, and lays out one page, which can be mailed or attached to a ticket as
is.  A leaf module: it imports nothing of carpool but ``carpool.extras``, and matplotlib only when a plot is drawn.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable
from typing import Any

from carpool.extras import require

STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
         "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
         "td:first-child,th:first-child{text-align:left}img{max-width:100%}")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend."""
    require("report", "an HTML report with plots (--report)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig: Any, dpi: int = 100, layout: bool = True) -> bytes:
    """The figure as PNG bytes, cropped to what is drawn; ``layout``: first move subplots so
    their labels do not overlap (``tight_layout``).  The figure is closed."""
    buf = io.BytesIO()
    if layout:
        fig.tight_layout()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return buf.getvalue()


def figure(title: str, png_bytes: bytes, alt: str | None = None) -> str:
    """A titled plot, embedded; ``alt``: what it shows in words, for those who cannot see it
    (default: the title)."""
    t = html.escape(title)
    a = html.escape(alt if alt is not None else title)
    return f'<h2>{t}</h2><img alt="{a}" src="data:image/png;base64,{base64.b64encode(png_bytes).decode()}">'


def table(rows: Iterable[Iterable[object]], header: Iterable[object] | None = None) -> str:
    """Cells are escaped; None is an empty cell."""

    def cells(tag: str, row: Iterable[object]) -> str:
        return "".join(f"<{tag}>{'' if v is None else html.escape(str(v))}</{tag}>" for v in row)

    head = "<tr>" + cells("th", header) + "</tr>" if header is not None else ""
    body = "".join("<tr>" + cells("td", r) + "</tr>" for r in rows)
    return f"<table>{head}{body}</table>"


def paragraph(text: str) -> str:
    return f"<p>{html.escape(text)}</p>"


def page(title: str, *parts: str) -> str:
    """One HTML document: the title as <h1>, then ``parts`` (HTML) in order."""
    t = html.escape(title)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{t}</title><style>{STYLE}</style>"
            f"</head><body><h1>{t}</h1>{''.join(parts)}</body></html>\n")

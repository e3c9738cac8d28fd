"""Rich display in notebooks: the HTML that ``_repr_html_`` of layerwise's objects returns.

Jupyter shows an object's ``_repr_html_()`` instead of its ``repr``. :class:`~layerwise.Extractor` (a model card),
:class:`~layerwise.EncodeSpec`, :class:`~layerwise.LayerStack` (per layer: shape and norms, with an inline SVG
norm curve), :class:`~layerwise.store.FeatureStore` (manifest summary, counts, integrity), probe results (the
table and the per-layer curve) and a head's training result build theirs from the helpers here: a titled
key/value card (:func:`card`), a table (:func:`table`) and a line chart as inline SVG (:func:`svg_curve`). Every
text that enters the markup is escaped (:func:`html.escape`), so a text or label holding ``<script>`` shows as
text; no script, style sheet or font is loaded from anywhere, so the output works offline.
"""

from __future__ import annotations

import html
import math
from typing import Any, Sequence

STYLE = "border-collapse:collapse;font-family:monospace;font-size:12px"
CELL = "border:1px solid #ddd;padding:2px 6px;text-align:left"


def esc(value: Any) -> str:
    """``value`` as text safe inside HTML (quotes included)."""
    return html.escape(str(value), quote=True)


def table(header: Sequence[Any], rows: Sequence[Sequence[Any]], *, max_rows: int = 50) -> str:
    """An HTML table of ``rows`` (escaped); rows past ``max_rows`` are counted, not shown."""
    head = "".join(f'<th style="{CELL}">{esc(h)}</th>' for h in header)
    body = "".join("<tr>" + "".join(f'<td style="{CELL}">{esc(c)}</td>' for c in row) + "</tr>"
                   for row in rows[:max_rows])
    more = (f'<tr><td style="{CELL}" colspan="{len(header)}">... {len(rows) - max_rows:,} more</td></tr>'
            if len(rows) > max_rows else "")
    return f'<table style="{STYLE}"><thead><tr>{head}</tr></thead><tbody>{body}{more}</tbody></table>'


def card(title: str, fields: Sequence[tuple[str, Any]], *extra: str) -> str:
    """A titled key/value table, followed by ``extra`` HTML fragments (already built with these helpers)."""
    rows = "".join(f'<tr><th style="{CELL}">{esc(k)}</th><td style="{CELL}">{esc(v)}</td></tr>' for k, v in fields)
    return (f'<div class="layerwise"><div style="font-weight:bold;font-family:monospace">{esc(title)}</div>'
            f'<table style="{STYLE}">{rows}</table>{"".join(extra)}</div>')


def svg_curve(xs: Sequence[Any], ys: Sequence[float], *, title: str, y_label: str = "", width: int = 360,
              height: int = 140) -> str:
    """A line chart of ``ys`` over the labels ``xs`` as inline SVG (no script; labels escaped); ``""`` when there is
    nothing finite to draw."""
    points = [(i, float(y)) for i, y in enumerate(ys) if y is not None and math.isfinite(float(y))]
    if not points:
        return ""
    lo, hi = min(y for _, y in points), max(y for _, y in points)
    span = (hi - lo) or 1.0
    left, right, top, bottom = 40, 10, 18, 22
    n = max(len(ys) - 1, 1)

    def at(i: int, y: float) -> tuple[float, float]:
        return (left + (width - left - right) * i / n, top + (height - top - bottom) * (1 - (y - lo) / span))

    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (at(i, v) for i, v in points))
    ticks = "".join(
        f'<text x="{at(i, lo)[0]:.1f}" y="{height - 6}" font-size="9" text-anchor="middle">{esc(xs[i])}</text>'
        for i in range(len(xs)) if len(xs) <= 16 or i % math.ceil(len(xs) / 16) == 0)
    dots = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2"><title>{esc(xs[i])}: {v:.4g}</title></circle>'
                   for (i, v), (x, y) in ((p, at(*p)) for p in points))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="{esc(title)}" style="font-family:monospace">'
        f'<text x="{left}" y="12" font-size="10">{esc(title)}</text>'
        f'<text x="2" y="{top + 8}" font-size="9">{hi:.3g}</text>'
        f'<text x="2" y="{height - bottom}" font-size="9">{lo:.3g}</text>'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{path}"/>{dots}{ticks}'
        f'{f"<title>{esc(y_label)}</title>" if y_label else ""}</svg>'
    )


__all__ = ["card", "esc", "svg_curve", "table"]

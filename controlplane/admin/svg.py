"""Small inline SVG charts for the admin page (no JavaScript, no external assets).

Every drawing carries its scale: a sparkline shows its current value and its range
(``0–max``), a chart its y axis (0, half, max), its time axis (window start .. now) and
the current value of each line. Values are drawn from 0 to the largest value, oldest
first, evenly spaced; ``None`` is a gap in a chart (no data then) and joined over in a
sparkline.

The same sparkline exists in JavaScript in ``templates/admin/nodes.html`` for the live
refresh; both map values onto the box the same way and format them with the same rules
(:func:`fmt_value`).
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape

FORMATS = ("num", "secs", "ms", "pct", "rps")
"""Value formats: plain number, seconds (shown as ms below 1 s), milliseconds, a 0-1
fraction as %, a rate per second."""


def fmt_num(v: float) -> str:
    """A number with 0-3 decimals depending on its size (``1234``, ``2.5``, ``0.125``)."""
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}".rstrip("0").rstrip(".")
    return f"{v:.3f}".rstrip("0").rstrip(".")


def fmt_value(v: float | None, kind: str = "num", unit: str = "") -> str:
    """``v`` formatted by ``kind`` (one of :data:`FORMATS`) plus ``unit``; ``–`` for None."""
    if v is None:
        return "–"
    if kind == "secs":
        return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"
    if kind == "ms":
        return f"{v:.0f} ms" if v < 1000 else f"{v / 1000:.2f} s"
    if kind == "pct":
        if v == 0:
            return "0 %"
        return f"{v * 100:.1f} %" if v < 0.1 else f"{v * 100:.0f} %"
    if kind == "rps":
        return f"{fmt_num(round(v, 2 if v < 10 else 1))}/s"
    return fmt_num(v) + unit


def _top(values: Sequence[float | None], vmax: float | None = None) -> float:
    known = [v for v in values if v is not None]
    top = vmax if vmax is not None else (max(known) if known else 0.0)
    return top if top > 0 else 1.0


def _points(values: Sequence[float | None], width: float, height: float, pad: float,
            vmax: float | None = None, x0: float = 0.0,
            gaps: bool = True) -> list[list[tuple[float, float]]]:
    """Runs of (x, y) for the non-null values, x evenly spaced over
    ``x0 + pad .. x0 + width - pad``, y from 0 (bottom) to ``vmax`` (top). With ``gaps``
    a ``None`` breaks the line; without, the line joins the known values around it."""
    n = len(values)
    top = _top(values, vmax)
    step = (width - 2 * pad) / max(n - 1, 1)
    runs: list[list[tuple[float, float]]] = []
    cur: list[tuple[float, float]] = []
    for i, v in enumerate(values):
        if v is None:
            if cur and gaps:
                runs.append(cur)
                cur = []
            continue
        y = height - pad - (min(max(v, 0.0), top) / top) * (height - 2 * pad)
        cur.append((x0 + pad + i * step, y))
    if cur:
        runs.append(cur)
    return runs


def _draw(runs: list[list[tuple[float, float]]], cls: str = "", r: float = 1.5) -> str:
    out = []
    c = f' class="{cls}"' if cls else ""
    for run in runs:
        if len(run) == 1:
            x, y = run[0]
            out.append(f'<circle{c} cx="{x:.1f}" cy="{y:.1f}" r="{r}"/>')
        else:
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in run)
            out.append(f'<polyline{c} points="{pts}"/>')
    return "".join(out)


def _last(values: Sequence[float | None]) -> float | None:
    for v in reversed(values):
        if v is not None:
            return v
    return None


def sparkline(values: Sequence[float | None] | None, *, width: int = 80, height: int = 24,
              title: str = "", kind: str = "num", unit: str = "",
              vmax: float | None = None, css_class: str = "spark") -> Markup:
    """A sparkline of ``values`` (oldest first) with its scale: the SVG line (a flat dash
    when there is no data), then the current (last known) value in bold and the range
    ``0–max`` under it, formatted by ``kind`` (:func:`fmt_value`). ``title`` becomes the
    tooltip, with the figures."""
    values = list(values or [])
    known = [v for v in values if v is not None]
    top = _top(values, vmax)
    if not known:
        body = (f'<line x1="2" y1="{height - 2}" x2="{width - 2}" y2="{height - 2}" '
                'class="empty"/>')
        now_txt, range_txt = "–", "no data"
    else:
        runs = _points(values, width, height, 2, top, gaps=False)
        lx, ly = runs[-1][-1]
        body = _draw(runs) + f'<circle class="last" cx="{lx:.1f}" cy="{ly:.1f}" r="2"/>'
        now_txt = fmt_value(known[-1], kind, unit)
        range_txt = f"0–{fmt_value(top if vmax is None else vmax, kind, unit)}"
    tip = f"{title}: now {now_txt}, range {range_txt}" if title else ""
    t = f"<title>{escape(tip)}</title>" if tip else ""
    return Markup(
        f'<span class="{escape(css_class)}"><svg width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">{t}{body}</svg>'
        f'<span class="sv"><b>{escape(now_txt)}</b><small>{escape(range_txt)}</small>'
        f'</span></span>')


def _span_label(ts: Sequence[float | None]) -> str:
    tsk = [t for t in ts if t is not None]
    span = (max(tsk) - min(tsk)) if len(tsk) > 1 else 0.0
    if span >= 120:
        return f"−{span / 60:.0f} min"
    return f"−{span:.0f} s"


def chart(ts: Sequence[float | None], values: Sequence[float | None] | None = None, *,
          label: str, unit: str = "", kind: str = "num", width: int = 560, height: int = 140,
          vmax: float | None = None, join: bool = False,
          series: Sequence[tuple[str, Sequence[float | None]]] | None = None) -> Markup:
    """A line chart with axes: y from 0 to the largest value (or ``vmax``) with labels
    at 0, half and max; x over the timestamps ``ts`` (oldest first, labelled ``−span``
    and ``now``). One line (``values``) or several (``series`` = [(name, values)], drawn
    in the colours ``l0``, ``l1``, ...). ``None`` is a gap, or joined over with ``join``
    (e.g. a latency that is unknown when no request finished between two polls). The
    title line reads ``label (now X)`` or ``label (name X · name Y)``. The SVG scales
    with its box (``viewBox``)."""
    lines = list(series) if series else [("", list(values or []))]
    allv = [v for _, vals in lines for v in vals]
    top = _top(allv, vmax)
    pad_l, pad_r, pad_t, pad_b = 52, 10, 20, 18
    plot_w, plot_h = width - pad_l - pad_r, height - pad_t - pad_b
    body = []
    for frac in (0.5, 1.0):
        y = pad_t + plot_h * (1 - frac)
        body.append(f'<line class="grid" x1="{pad_l}" y1="{y:.1f}" x2="{width - pad_r}" '
                    f'y2="{y:.1f}"/>')
        body.append(f'<text x="{pad_l - 4}" y="{y + 4:.1f}" text-anchor="end">'
                    f'{escape(fmt_value(top * frac, kind, unit))}</text>')
    body.append(f'<text x="{pad_l - 4}" y="{pad_t + plot_h + 4:.1f}" text-anchor="end">'
                f'{escape(fmt_value(0.0, kind, unit))}</text>')
    body.append(f'<line class="axis" x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" '
                f'y2="{pad_t + plot_h}"/>')
    body.append(f'<line class="axis" x1="{pad_l}" y1="{pad_t + plot_h}" x2="{width - pad_r}" '
                f'y2="{pad_t + plot_h}"/>')
    body.append(f'<text x="{pad_l}" y="{height - 3}">{escape(_span_label(ts))}</text>')
    body.append(f'<text x="{width - pad_r}" y="{height - 3}" text-anchor="end">now</text>')
    nows = []
    for i, (name, vals) in enumerate(lines):
        vals = list(vals)
        runs = _points(vals, plot_w + 8, plot_h + 8, 4, top, x0=pad_l - 4, gaps=not join)
        # _points draws inside a box from y=0; move it under the title
        runs = [[(x, y + pad_t - 4) for x, y in run] for run in runs]
        body.append(_draw(runs, f"l{i}", r=2))
        last = _last(vals)
        txt = fmt_value(last, kind, unit) if last is not None else "no data"
        nows.append(f"{name} {txt}" if name else f"now {txt}")
    if series:
        head = "".join(
            f'<tspan class="k{i}">■</tspan> {escape(n)}{" · " if i < len(nows) - 1 else ""}'
            for i, n in enumerate(nows))
        title = f'{escape(label)} ({head})'
        plain = f"{label} ({' · '.join(nows)})"
    else:
        title = f"{escape(label)} ({escape(nows[0])})"
        plain = f"{label} ({nows[0]})"
    return Markup(
        f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img"><title>{escape(plain)}</title>'
        f'<text class="head" x="{pad_l}" y="13">{title}</text>{"".join(body)}</svg>')

"""Small inline SVG charts for the admin page (no JavaScript, no external assets).

The same drawing exists in JavaScript in ``templates/admin/nodes.html`` for the live
refresh; both map values onto the box the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape


def _points(values: Sequence[float | None], width: float, height: float, pad: float,
            vmax: float | None = None) -> list[str]:
    """Polyline points for the non-null values, x evenly spaced, y from 0 to vmax."""
    n = len(values)
    known = [v for v in values if v is not None]
    if n == 0 or not known:
        return []
    top = vmax if vmax is not None else max(known)
    top = top if top > 0 else 1.0
    step = (width - 2 * pad) / max(n - 1, 1)
    pts = []
    for i, v in enumerate(values):
        if v is None:
            continue
        y = height - pad - (min(max(v, 0.0), top) / top) * (height - 2 * pad)
        pts.append(f"{pad + i * step:.1f},{y:.1f}")
    return pts


def sparkline(values: Sequence[float | None], *, width: int = 100, height: int = 22,
              title: str = "", css_class: str = "spark") -> Markup:
    """An SVG polyline of ``values`` (oldest first); a flat dash when there is no data.
    ``title`` becomes the tooltip."""
    pts = _points(values, width, height, 2)
    t = f"<title>{escape(title)}</title>" if title else ""
    if not pts:
        body = (f'<line x1="2" y1="{height - 2}" x2="{width - 2}" y2="{height - 2}" '
                'class="empty"/>')
    elif len(pts) == 1:
        x, y = pts[0].split(",")
        body = f'<circle cx="{x}" cy="{y}" r="1.5"/>'
    else:
        body = f'<polyline points="{" ".join(pts)}"/>'
    return Markup(f'<svg class="{escape(css_class)}" width="{width}" height="{height}" '
                  f'viewBox="0 0 {width} {height}" role="img">{t}{body}</svg>')


def fmt_num(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}".rstrip("0").rstrip(".")
    return f"{v:.3f}".rstrip("0").rstrip(".")


def chart(ts: Sequence[float | None], values: Sequence[float | None], *, label: str,
          unit: str = "", width: int = 560, height: int = 120,
          vmax: float | None = None) -> Markup:
    """A labelled line chart: max value on the y axis, time span (s) on the x axis."""
    known = [v for v in values if v is not None]
    top = vmax if vmax is not None else (max(known) if known else 0.0)
    pad_l, pad = 48, 14
    pts = _points(values, width - pad_l, height, pad, top if top > 0 else None)
    shifted = []
    for p in pts:
        x, y = p.split(",")
        shifted.append(f"{float(x) + pad_l - pad:.1f},{y}")
    tsk = [t for t in ts if t is not None]
    span = (max(tsk) - min(tsk)) if len(tsk) > 1 else 0.0
    last = fmt_num(known[-1]) + unit if known else "no data"
    line = (f'<polyline points="{" ".join(shifted)}"/>' if len(shifted) > 1 else
            (f'<circle cx="{shifted[0].split(",")[0]}" cy="{shifted[0].split(",")[1]}" r="2"/>'
             if shifted else ""))
    return Markup(
        f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img"><title>{escape(label)}</title>'
        f'<line class="axis" x1="{pad_l}" y1="{pad}" x2="{pad_l}" y2="{height - pad}"/>'
        f'<line class="axis" x1="{pad_l}" y1="{height - pad}" x2="{width - pad}" '
        f'y2="{height - pad}"/>'
        f'<text x="{pad_l - 4}" y="{pad + 4}" text-anchor="end">{escape(fmt_num(top))}</text>'
        f'<text x="{pad_l - 4}" y="{height - pad}" text-anchor="end">0</text>'
        f'<text x="{pad_l + 4}" y="{pad - 3}">{escape(label)} (now {escape(last)})</text>'
        f'<text x="{width - pad}" y="{height - 2}" text-anchor="end">'
        f'last {span:.0f} s</text>{line}</svg>')

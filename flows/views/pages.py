"""Static HTML pages (inspect views, the run page): one self-contained file each, opened from disk.

Every piece of text that came from a model, a tool, a reward or a user goes through `esc`
(html.escape, quotes included), so `<script>` in an episode is shown as text. A Content-Security-
Policy admits only the page's own inline script (by its hash) and inline styles: even a missed
escape could not run code, and nothing is fetched from anywhere. The script is small and optional
(a text filter); when it has run it marks `<html data-ready="1">`, and an error marks
`data-js-error`, which is what the headless-browser tests read back from the DOM.
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
import re
from pathlib import Path

from storage.atomic import write_text_atomic

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5rem auto;max-width:1200px;padding:0 1rem;color:#1d1d1f}
h1{font-size:1.5rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd}h3{font-size:1rem;margin:.2rem 0}
table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #ddd;padding:.2rem .5rem;text-align:left;vertical-align:top}
th{background:#f4f4f6}td.num{text-align:right;font-variant-numeric:tabular-nums}
.episode{border:1px solid #ccc;border-radius:6px;padding:.6rem .8rem;margin:.8rem 0}
.meta{color:#666;font-size:.85rem}.msg{margin:.35rem 0;padding:.3rem .5rem;border-left:4px solid #bbb;background:#fafafa}
.role{font-weight:600;font-size:.8rem;text-transform:uppercase;color:#555}
.role-system{border-color:#999}.role-user{border-color:#3b82f6}.role-assistant{border-color:#16a34a}.role-tool{border-color:#d97706}
pre{white-space:pre-wrap;word-break:break-word;margin:.2rem 0;font:13px/1.4 ui-monospace,monospace}
img.image{display:block;min-width:96px;max-width:384px;image-rendering:pixelated;border:1px solid #ddd;margin:.2rem 0}
.missing-image{color:#b91c1c}
.tool-call{font:13px ui-monospace,monospace;background:#fff7e6;padding:.1rem .3rem;margin:.15rem 0}
.explanation{background:#eef6ff;border-left:4px solid #3b82f6;padding:.3rem .5rem;margin:.3rem 0}
.sampled{background:#dcfce7}.masked{color:#777}.error{color:#b91c1c}
.side{display:grid;grid-template-columns:1fr 1fr;gap:.8rem}.up{color:#15803d}.down{color:#b91c1c}
.charts{display:flex;flex-wrap:wrap;gap:1rem}.chart{border:1px solid #eee}
nav a{margin-right:1rem}.wide{overflow-x:auto}th.ranked{background:#dbeafe}#filter{margin:.5rem 0;padding:.3rem;width:20rem}
"""

# Hides episodes whose text does not contain the filter; the page reads fine without it.
SCRIPT = """
window.addEventListener('error',function(e){document.documentElement.dataset.jsError=String(e.message)});
(function(){var box=document.getElementById('filter');
if(box){box.addEventListener('input',function(){var q=box.value.toLowerCase();
document.querySelectorAll('.episode').forEach(function(ep){ep.hidden=q!==''&&ep.textContent.toLowerCase().indexOf(q)<0});});}
document.documentElement.dataset.ready='1';})();
"""


def esc(value: object) -> str:
    """Text for HTML content or a quoted attribute value."""
    return html.escape("" if value is None else str(value), quote=True)


def fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}g}"


def slug(text: str) -> str:
    """A file-name-safe form of a reward or run name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "_"


def page(title: str, body: str, script: str = SCRIPT, css: str = "", connect: bool = False) -> str:
    """A complete, self-contained HTML document running `script` (the text filter by default) and no other.
    `connect`: the script may call the server the page came from (the review page's API); nothing else."""
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    csp = (f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'sha256-{digest}'"
           + ("; connect-src 'self'" if connect else ""))
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta http-equiv='Content-Security-Policy' content=\"{csp}\">"
            f"<title>{esc(title)}</title><style>{CSS}{css}</style></head><body>{body}<script>{script}</script></body></html>")


def write_page(path: Path, title: str, body: str) -> Path:
    """Write the page atomically (a reader never opens half a page); return its path."""
    write_text_atomic(path, page(title, body))
    return path


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], x_label: str = "step",
               band: dict[str, list[tuple[float, float, float]]] | None = None, width: int = 360, height: int = 200) -> str:
    """An inline SVG line chart: one polyline per series of (x, y) points, optional (x, low, high)
    bands drawn under them; each point's value is in its <title> (a tooltip)."""
    colors = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2", "#4b5563"]
    points = [p for s in series.values() for p in s] + [(x, y) for b in (band or {}).values() for x, lo, hi in b for y in (lo, hi)]
    points = [(x, y) for x, y in points if math.isfinite(y)]
    left, right, top, bottom = 48, 10, 22, 30
    svg = [f"<svg class='chart' width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img' "
           f"aria-label='{esc(title)}'><text x='{left}' y='14' font-size='12' font-weight='600'>{esc(title)}</text>"]
    if not points:
        svg.append(f"<text x='{left}' y='{height // 2}' font-size='12' fill='#888'>no data</text></svg>")
        return "".join(svg)
    x0, x1 = min(x for x, _ in points), max(x for x, _ in points)
    y0, y1 = min(y for _, y in points), max(y for _, y in points)
    x1 = x1 if x1 > x0 else x0 + 1
    if y1 <= y0:  # a flat series: centre it in a unit range rather than draw it on the axis
        y0, y1 = y0 - 0.5, y1 + 0.5

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y: float) -> float:
        return height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)

    svg.append(f"<line x1='{left}' y1='{height - bottom}' x2='{width - right}' y2='{height - bottom}' stroke='#999'/>"
               f"<line x1='{left}' y1='{top}' x2='{left}' y2='{height - bottom}' stroke='#999'/>"
               f"<text x='{left - 4}' y='{sy(y1) + 4:.1f}' font-size='10' text-anchor='end'>{fmt(y1, 3)}</text>"
               f"<text x='{left - 4}' y='{sy(y0) + 4:.1f}' font-size='10' text-anchor='end'>{fmt(y0, 3)}</text>"
               f"<text x='{left}' y='{height - 12}' font-size='10'>{fmt(x0, 3)}</text>"
               f"<text x='{width - right}' y='{height - 12}' font-size='10' text-anchor='end'>{fmt(x1, 3)}</text>"
               f"<text x='{(left + width) / 2:.0f}' y='{height - 2}' font-size='10' text-anchor='middle'>{esc(x_label)}</text>")
    for i, (name, pts) in enumerate(series.items()):
        color = colors[i % len(colors)]
        spread = [(x, lo, hi) for x, lo, hi in (band or {}).get(name, []) if math.isfinite(lo) and math.isfinite(hi)]
        if spread:
            outline = [(sx(x), sy(hi)) for x, _, hi in spread] + [(sx(x), sy(lo)) for x, lo, _ in reversed(spread)]
            svg.append(f"<polygon points='{' '.join(f'{a:.1f},{b:.1f}' for a, b in outline)}' fill='{color}' opacity='0.15'/>")
        pts = [(x, y) for x, y in pts if math.isfinite(y)]
        svg.append(f"<polyline fill='none' stroke='{color}' stroke-width='1.8' "
                   f"points='{' '.join(f'{sx(x):.1f},{sy(y):.1f}' for x, y in pts)}'/>")
        svg.extend(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='2.5' fill='{color}'><title>{esc(name)} at {fmt(x, 6)}: "
                   f"{fmt(y, 6)}</title></circle>" for x, y in pts)
        if len(series) > 1:
            svg.append(f"<text x='{width - right}' y='{top + 12 * i}' font-size='10' text-anchor='end' fill='{color}'>"
                       f"{esc(name)}</text>")
    svg.append("</svg>")
    return "".join(svg)

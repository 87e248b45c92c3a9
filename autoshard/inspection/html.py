"""The HTML of ``program.report``: inline CSS and SVG drawn here, no script but an error hook, nothing fetched
at view time. Every function takes plain data (autoshard/inspection/report.py collects it) and returns markup."""

from __future__ import annotations

import html
from typing import Any

__all__ = ["CATEGORY_COLORS", "graph_code", "memory_bars", "page", "table", "timeline"]

CATEGORY_COLORS = {
    "weights": "#4e79a7", "parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#e15759",
    "masters": "#76b7b2", "activations": "#59a14f", "gathered": "#edc948", "buffers": "#b07aa1",
    "other": "#9c755f",
}  # fmt: skip
ACTION_COLORS = {"F": "#4e79a7", "B": "#f28e2b", "W": "#59a14f"}  # W: a zero-bubble weight-gradient step

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px 32px; color: #222; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
.muted { color: #666; } .key { font-weight: 600; }
table { border-collapse: collapse; margin: 6px 0; } td, th { padding: 3px 10px; border-bottom: 1px solid #eee; }
th { text-align: left; background: #f6f6f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.chosen td { background: #eef5ff; font-weight: 600; }
.legend span { display: inline-block; margin-right: 14px; } .swatch { width: 11px; height: 11px;
  display: inline-block; margin-right: 4px; vertical-align: -1px; }
pre.graph { font: 12px/1.35 ui-monospace, monospace; background: #fafafa; border: 1px solid #eee; padding: 8px;
  max-height: 420px; overflow: auto; }
.tp { background: #fde2c4; } .pp { background: #cfe8cf; } .zero { background: #f9f1b6; }
details { margin: 6px 0; } summary { cursor: pointer; font-weight: 600; }
svg text { font: 11px system-ui, sans-serif; }
"""

# Console errors (none expected) are written into the page, where a headless browser's DOM dump reads them.
ERROR_HOOK = """<script>
window.onerror = function (msg) { document.getElementById('errors').textContent += msg + '\\n'; };
</script>"""


def esc(value: Any) -> str:
    return html.escape(str(value))


def table(header: list[str], rows: list[list[Any]], numeric: set[int] = frozenset(), marked: int | None = None) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cells = "".join(f'<td class="num">{esc(c)}</td>' if j in numeric else f"<td>{esc(c)}</td>" for j, c in
                        enumerate(row))  # fmt: skip
        body.append(f'<tr class="chosen">{cells}</tr>' if i == marked else f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def legend(names: list[str], colors: dict[str, str]) -> str:
    items = "".join(f'<span><i class="swatch" style="background:{colors.get(n, "#999")}"></i>{esc(n)}</span>'
                    for n in names)  # fmt: skip
    return f'<div class="legend">{items}</div>'


def memory_bars(bars: list[tuple[str, dict[str, int]]], capacity: int | None = None) -> str:
    """Horizontal stacked bars, one per (label, bytes by category), on one scale."""
    if not bars:
        return '<p class="muted">nothing measured yet</p>'
    top = max([sum(b.values()) for _, b in bars] + [1])
    width, row, left = 760, 22, 190
    svg = [f'<svg width="{width + left + 90}" height="{row * len(bars) + 10}" role="img">']
    for i, (label, parts) in enumerate(bars):
        x, y = left, 4 + i * row
        svg.append(f'<text x="0" y="{y + 13}">{esc(label)}</text>')
        for name, n in parts.items():
            w = width * n / top
            if w > 0:
                color = CATEGORY_COLORS.get(name, "#999")
                svg.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 6}" fill="{color}">'
                           f"<title>{esc(name)}: {_mib(n)}</title></rect>")  # fmt: skip
                x += w
        svg.append(f'<text x="{x + 6:.1f}" y="{y + 13}">{_mib(sum(parts.values()))}</text>')
    svg.append("</svg>")
    names = list(dict.fromkeys(n for _, b in bars for n in b))
    note = f'<p class="muted">device memory {_mib(capacity)}</p>' if capacity else ""
    return legend(names, CATEGORY_COLORS) + "".join(svg) + note


def _mib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def timeline(rows: list[tuple[str, list[tuple[str, float, float]]]], title: str) -> str:
    """One lane per pipeline rank: forward and backward blocks by microbatch; gaps are the bubble."""
    if not rows or not any(r for _, r in rows):
        return f'<p class="muted">{esc(title)}: none</p>'
    end = max(e for _, lane in rows for _, _, e in lane) or 1.0
    width, lane_h, left = 860, 26, 80
    svg = [f'<svg width="{width + left + 20}" height="{lane_h * len(rows) + 24}" role="img">']
    drawn: set[str] = set()
    for i, (label, lane) in enumerate(rows):
        y = 4 + i * lane_h
        svg.append(f'<text x="0" y="{y + 15}">{esc(label)}</text>')
        svg.append(f'<rect x="{left}" y="{y}" width="{width}" height="{lane_h - 6}" fill="#eee"/>')
        for action, start, stop in lane:
            x, w = left + width * start / end, max(1.0, width * (stop - start) / end)
            kind = action.lstrip("0123456789")[:1]  # "1W3": stage 1's W of microbatch 3
            kind = kind if kind in ACTION_COLORS else "F"
            drawn.add(kind)
            svg.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{lane_h - 6}" fill="{ACTION_COLORS[kind]}" '
                       f'stroke="#fff" stroke-width="0.5"><title>{esc(action)}: {start * 1e3:.3f}-{stop * 1e3:.3f} ms'
                       f'</title></rect>')  # fmt: skip
            if w > 22:
                svg.append(f'<text x="{x + 3:.1f}" y="{y + 14}" fill="#fff">{esc(action)}</text>')
    svg.append(f'<text x="{left}" y="{lane_h * len(rows) + 18}">0</text>')
    svg.append(f'<text x="{left + width - 60}" y="{lane_h * len(rows) + 18}">{end * 1e3:.3f} ms</text></svg>')
    busy = sum(e - s for _, lane in rows for _, s, e in lane)
    kinds = [k for k in ACTION_COLORS if k in "FB" or k in drawn]  # W in the legend where there are any
    idle = 1 - busy / (end * len(rows))
    return (f"<p><b>{esc(title)}</b>: step {end * 1e3:.3f} ms, idle (bubble) {idle:.1%} of rank time</p>"
            + legend(kinds, ACTION_COLORS) + "".join(svg))  # fmt: skip


def graph_code(code: str, limit: int = 4000) -> str:
    """A rank's graph code with collectives (tp), sends and receives (pp) and ZeRO gathers highlighted."""
    lines = code.strip("\n").splitlines()
    out = []
    for line in lines[:limit]:
        text = esc(line)
        if "autoshard_graph_ops_tp_" in line and "tp_vocab_parallel" not in line or "all_reduce" in line:
            text = f'<span class="tp">{text}</span>'
        elif "autoshard_graph_ops_pipeline_send" in line or "autoshard_graph_ops_pipeline_recv" in line:
            text = f'<span class="pp">{text}</span>'
        elif "autoshard_graph_ops_zero_gather" in line or "autoshard_graph_ops_zero_mark" in line:
            text = f'<span class="zero">{text}</span>'
        out.append(text)
    more = f"\n... {len(lines) - limit} more lines" if len(lines) > limit else ""
    return f'<pre class="graph">{chr(10).join(out)}{esc(more)}</pre>'


def page(title: str, sections: list[tuple[str, str]]) -> str:
    body = "".join(f'<h2 id="{esc(anchor.split()[0].lower())}">{esc(anchor)}</h2>{content}' for anchor, content
                   in sections)  # fmt: skip
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f"<style>{CSS}</style>{ERROR_HOOK}</head><body><h1>{esc(title)}</h1>{body}"
            f'<pre id="errors" hidden></pre></body></html>')  # fmt: skip

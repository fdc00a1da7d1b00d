"""Rendering a `mempath diagnose` report: terminal table, JSON file, self-contained HTML.

The HTML has no scripts and loads nothing from the network: its plots are inline
SVG drawn here (a memory timeline coloured by stage, predicted-vs-measured bars,
KV growth per step, allocated bytes per leak-check request).
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from mempath.memory.ledger import format_bytes

# Colours by pathway, so a stage and its row share a colour everywhere.
PATHWAY_COLOURS = {
    "weights": "#4e79a7", "kv_cache": "#f28e2b", "activation_peak": "#e15759",
    "embedding": "#76b7b2", "logits": "#59a14f", "leak": "#9c755f",
    "train_weights": "#4e79a7", "train_activations": "#e15759", "gradients": "#b07aa1",
    "optimizer_state": "#edc948", "idle": "#bab0ac",
}


def colour(pathway: str) -> str:
    return PATHWAY_COLOURS.get(pathway, "#8c8c8c")


def _size(n) -> str:
    return "-" if n is None else format_bytes(n)


def _error(pct) -> str:
    return "-" if pct is None else f"{pct:+.1f}%"


# ---------------------------------------------------------------- terminal

def format_table(report: dict) -> str:
    rows = [("pathway", "predicted", "measured", "error", "measured by")]
    for r in report["pathways"]:
        rows.append((r["pathway"], _size(r["predicted"]), _size(r["measured"]), _error(r["error_pct"]),
                     r["measured_source"]))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"mempath diagnose: {report['model']} on {report['device']['type']} "
             f"({report['device'].get('name', '')}), {report['dtype']}", ""]
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [row[j].rjust(widths[j]) for j in (1, 2, 3)] + [row[4]]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 11)
    lines += [""] + summary_lines(report)
    files = report.get("files") or {}
    if files:
        lines += [""] + [f"{kind}: {path}" for kind, path in files.items()]
    return "\n".join(lines)


def summary_lines(report: dict) -> list[str]:
    """The figures a plan cannot predict, one line each."""
    lines = []
    frag = report["fragmentation"]
    if frag.get("available"):
        lines.append(f"fragmentation: reserved - allocated {_size(frag['reserved_minus_allocated'])}, "
                     f"inactive split {_size(frag['inactive_split_bytes'])}, "
                     f"{frag['num_alloc_retries']} allocation retries, {frag['num_ooms']} OOMs "
                     f"({frag['source']})")
    else:
        lines.append(f"fragmentation: {frag['reason']}")
    out = report["outside_torch"]
    lines.append(f"outside PyTorch: {_size(out['outside_torch'])} ({out['source']})")
    leak = report["leak"]
    lines.append(f"leak check ({leak['requests']} identical requests): {leak['verdict']}; slope "
                 f"{leak['slope_bytes_per_request']:+.0f} B/request, KV blocks in use after: "
                 f"{leak['kv_blocks_used_after']}")
    host = report["host"]
    if "load_peak_increase" in host:
        lines.append(f"host memory during load: peak RssAnon {_size(host['load_rss_anon_peak'])}, "
                     f"+{_size(host['load_peak_increase'])} over its start ({host['source']})")
    bw = report["bandwidth"]
    if bw.get("available"):
        lines.append(f"host->device: pinned {bw['h2d_pinned_gbps']} GB/s, pageable "
                     f"{bw['h2d_pageable_gbps']} GB/s; device->host: pinned {bw['d2h_pinned_gbps']} GB/s, "
                     f"pageable {bw['d2h_pageable_gbps']} GB/s ({format_bytes(bw['bytes'])} copies)")
    else:
        lines.append(f"bandwidth: {bw['reason']}")
    pcie = report["pcie"]
    if pcie.get("available"):
        width = pcie.get("current_link_width")
        speed = pcie.get("current_link_speed") or f"gen {pcie.get('current_link_gen')}"
        lines.append(f"PCIe link: x{width} at {speed} (max x{pcie.get('max_link_width')}; {pcie['source']})")
    else:
        lines.append(f"PCIe link: {pcie['reason']}")
    if report.get("snapshot"):
        lines.append(f"memory snapshot: {report['snapshot']}")
    return lines


# ---------------------------------------------------------------- JSON

def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, default=str) + "\n")


# ---------------------------------------------------------------- SVG plots

def _axis_bytes(value: float) -> str:
    return format_bytes(value).replace(".00 ", " ")


def timeline_svg(samples: list[list], stage_pathways: dict[str, str], width: int = 900,
                 height: int = 260) -> str:
    """Device bytes over time; each segment and background band coloured by its stage's pathway."""
    if len(samples) < 2:
        return "<p>(too few samples for a timeline)</p>"
    left, right, top, bottom = 70, 10, 10, 30
    t_max = max(s[0] for s in samples) or 1.0
    y_max = max(s[1] for s in samples) or 1
    x = lambda t: left + (width - left - right) * t / t_max  # noqa: E731
    y = lambda v: top + (height - top - bottom) * (1 - v / y_max)  # noqa: E731
    parts = [f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{height}" viewBox="0 0 {width} {height}">']
    for start, end, stage in _stage_spans(samples):
        parts.append(f'<rect x="{x(start):.1f}" y="{top}" width="{max(1.0, x(end) - x(start)):.1f}" '
                     f'height="{height - top - bottom}" fill="{colour(stage_pathways.get(stage, "idle"))}" '
                     f'opacity="0.15"><title>{html.escape(stage)}</title></rect>')
    for a, b in zip(samples, samples[1:]):
        parts.append(f'<line x1="{x(a[0]):.1f}" y1="{y(a[1]):.1f}" x2="{x(b[0]):.1f}" y2="{y(b[1]):.1f}" '
                     f'stroke="{colour(stage_pathways.get(b[3], "idle"))}" stroke-width="2"/>')
    for frac in (0, 0.5, 1):
        parts.append(f'<text x="{left - 4}" y="{y(y_max * frac) + 4:.1f}" text-anchor="end" '
                     f'font-size="10">{_axis_bytes(y_max * frac)}</text>')
    parts.append(f'<text x="{left}" y="{height - 8}" font-size="10">0 s</text>')
    parts.append(f'<text x="{width - right}" y="{height - 8}" font-size="10" text-anchor="end">'
                 f'{t_max:.2f} s</text>')
    parts.append("</svg>")
    return "".join(parts)


def _stage_spans(samples):
    spans, start, stage = [], samples[0][0], samples[0][3]
    for s in samples[1:]:
        if s[3] != stage:
            spans.append((start, s[0], stage))
            start, stage = s[0], s[3]
    spans.append((start, samples[-1][0], stage))
    return [span for span in spans if span[2] != "idle"]


def bars_svg(rows: list[dict], width: int = 900) -> str:
    """Predicted (grey) and measured (coloured) bars per pathway, each row on its own scale.

    Pathways span bytes to gigabytes, so one shared axis would flatten most rows; the
    numbers and the error are printed beside each pair instead.
    """
    rows = [r for r in rows if r["predicted"] is not None or r["measured"] is not None]
    label_w, bar_w, row_h = 260, 380, 34
    height = row_h * len(rows) + 10
    parts = [f'<svg class="bars" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">']
    for i, r in enumerate(rows):
        top = 5 + i * row_h
        scale = max(r["predicted"] or 0, r["measured"] or 0, 1)
        pathway = _row_pathway(r["pathway"])
        parts.append(f'<text x="{label_w - 6}" y="{top + 18}" text-anchor="end" font-size="12">'
                     f'{html.escape(r["pathway"])}</text>')
        for j, (key, fill) in enumerate((("predicted", "#bab0ac"), ("measured", colour(pathway)))):
            value = r[key]
            w = 0 if value is None else bar_w * max(value, 0) / scale
            parts.append(f'<rect x="{label_w}" y="{top + 2 + j * 14}" width="{w:.1f}" height="12" '
                         f'fill="{fill}"><title>{key}: {_size(value)}</title></rect>')
        parts.append(f'<text x="{label_w + bar_w + 8}" y="{top + 12}" font-size="11">predicted '
                     f'{_size(r["predicted"])}</text>')
        parts.append(f'<text x="{label_w + bar_w + 8}" y="{top + 26}" font-size="11">measured '
                     f'{_size(r["measured"])} ({_error(r["error_pct"])})</text>')
    parts.append("</svg>")
    return "".join(parts)


def _row_pathway(name: str) -> str:
    if name.startswith(("weights", "rotary")):
        return "weights"
    if name.startswith(("kv", "kv_cache")):
        return "kv_cache"
    if name.startswith("train."):
        return {"train.weights": "train_weights", "train.gradients": "gradients",
                "train.optimizer_state": "optimizer_state"}.get(name, "train_activations")
    if name.startswith("embedding"):
        return "embedding"
    if name.startswith("logits"):
        return "logits"
    return "activation_peak"


def lines_svg(series: dict[str, list[tuple[float, float]]], colours: dict[str, str], x_label: str,
              width: int = 900, height: int = 220) -> str:
    """A small line chart of byte series against a step count."""
    points = [p for values in series.values() for p in values]
    if not points:
        return "<p>(no data)</p>"
    left, right, top, bottom = 70, 130, 10, 30
    x_max = max(p[0] for p in points) or 1
    y_max = max(p[1] for p in points) or 1
    y_min = min(0, min(p[1] for p in points))
    x = lambda v: left + (width - left - right) * v / x_max  # noqa: E731
    y = lambda v: top + (height - top - bottom) * (1 - (v - y_min) / ((y_max - y_min) or 1))  # noqa: E731
    parts = [f'<svg class="lines" xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{height}" viewBox="0 0 {width} {height}">']
    for k, (name, values) in enumerate(series.items()):
        path = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in values)
        dash = ' stroke-dasharray="5,3"' if k else ""
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colours[name]}" '
                     f'stroke-width="2"{dash}/>')
        parts.append(f'<text x="{width - right + 8}" y="{top + 14 + 16 * k}" font-size="11" '
                     f'fill="{colours[name]}">{html.escape(name)}</text>')
    for value in (y_min, y_max):
        parts.append(f'<text x="{left - 4}" y="{y(value) + 4:.1f}" text-anchor="end" '
                     f'font-size="10">{_axis_bytes(value)}</text>')
    parts.append(f'<text x="{(width - right) // 2}" y="{height - 8}" font-size="10">{x_label}</text>')
    parts.append("</svg>")
    return "".join(parts)


# ---------------------------------------------------------------- HTML

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1000px; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.bad { color: #b00; } .ok { color: #060; }
.legend span { display: inline-block; margin-right: 12px; font-size: 12px; }
.legend i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
"""


def write_html(report: dict, path: str | Path) -> None:
    Path(path).write_text(render_html(report))


def render_html(report: dict) -> str:
    stage_pathways = {s["name"]: s["pathway"] for s in report["stages"]}
    e = html.escape
    device = report["device"]
    body = [
        f"<h1>mempath diagnose</h1><p>{e(report['model'])} on {e(device['type'])} "
        f"({e(str(device.get('name', '')))}), {e(report['dtype'])}. Device bytes: "
        f"{e(report['measurement']['device_bytes'])}.</p>",
        "<h2>Predicted vs measured</h2>", _pathway_table(report["pathways"]),
        bars_svg(report["pathways"]),
        "<h2>Memory timeline</h2><p>Device bytes (live tensors) over the run; colour = the "
        "pathway of the stage running.</p>",
        timeline_svg(report["timeline"]["samples"], stage_pathways), _legend(stage_pathways),
        "<h2>Stages</h2>", _stage_table(report["stages"]),
    ]
    growth = report.get("kv_growth") or []
    if growth:
        body += ["<h2>KV growth while generating</h2>", lines_svg(
            {"predicted": [(s["step"], s["predicted_bytes"]) for s in growth],
             "measured": [(s["step"], s["measured_bytes"]) for s in growth]},
            {"predicted": "#bab0ac", "measured": colour("kv_cache")}, "engine step")]
    leak = report["leak"]
    body += ["<h2>Leak check</h2>",
             f"<p class=\"{'ok' if leak['ok'] else 'bad'}\">{e(leak['verdict'])}; slope "
             f"{leak['slope_bytes_per_request']:+.0f} B/request ({e(leak['source'])}).</p>",
             lines_svg({"allocated after request": list(enumerate(leak["allocated_after_each"], 1))},
                       {"allocated after request": colour("leak")}, "request")]
    body += ["<h2>What the plan cannot know</h2><ul>"]
    body += [f"<li>{e(line)}</li>" for line in summary_lines(report)] + ["</ul>"]
    body += ["<h2>Engine ledger</h2>", _ledger_table(report["ledger"])]
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>mempath diagnose</title>"
            f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>\n")


def _pathway_table(rows: list[dict]) -> str:
    e = html.escape
    out = ["<table><tr><th>pathway</th><th>predicted</th><th>measured</th><th>error</th>"
           "<th>predicted from</th><th>measured by</th></tr>"]
    for r in rows:
        out.append(f"<tr><td>{e(r['pathway'])}</td><td class=num>{_size(r['predicted'])}</td>"
                   f"<td class=num>{_size(r['measured'])}</td><td class=num>{_error(r['error_pct'])}</td>"
                   f"<td>{e(r['predicted_source'])}</td><td>{e(r['measured_source'])}"
                   f"{'<br><small>' + e(r['detail']) + '</small>' if r.get('detail') else ''}</td></tr>")
    return "".join(out) + "</table>"


def _stage_table(stages: list[dict]) -> str:
    out = ["<table><tr><th>stage</th><th>pathway</th><th>seconds</th><th>delta</th>"
           "<th>peak over start</th><th>host RssAnon peak</th></tr>"]
    for s in stages:
        out.append(f"<tr><td>{html.escape(s['name'])}</td><td>{html.escape(s['pathway'])}</td>"
                   f"<td class=num>{s['t_end'] - s['t_start']:.3f}</td><td class=num>{_size(s['delta'])}</td>"
                   f"<td class=num>{_size(s['peak_delta'])}</td><td class=num>{_size(s['host_peak'])}</td></tr>")
    return "".join(out) + "</table>"


def _ledger_table(ledger: dict) -> str:
    out = ["<table><tr><th>pathway</th><th>device</th><th>size</th><th>source</th><th>detail</th></tr>"]
    for name, entry in ledger.items():
        out.append(f"<tr><td>{html.escape(name)}</td><td>{html.escape(entry['device'])}</td>"
                   f"<td class=num>{_size(entry['bytes'])}</td><td>{html.escape(entry['source'])}</td>"
                   f"<td>{html.escape(entry['detail'])}</td></tr>")
    return "".join(out) + "</table>"


def _legend(stage_pathways: dict[str, str]) -> str:
    pathways = dict.fromkeys(stage_pathways.values())
    return '<p class="legend">' + "".join(
        f'<span><i style="background:{colour(p)}"></i>{html.escape(p)}</span>' for p in pathways) + "</p>"

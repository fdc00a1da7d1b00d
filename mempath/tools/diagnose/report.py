"""Rendering a `mempath diagnose` report: terminal table, JSON file, self-contained HTML.

The HTML has no scripts and loads nothing from the network: its charts are inline SVG
drawn with matplotlib (imported only here, when a report is written), each with one
scale, ticks and units: predicted-vs-measured bytes and error per pathway, a memory
timeline coloured by stage, KV growth per step, and allocated bytes per leak-check
request scaled to their change.
"""
from __future__ import annotations

import html
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from mempath.memory.ledger import format_bytes
from mempath.safe_io import loads_json

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
    line = f"outside PyTorch: {_size(out['outside_torch'])} ({out['source']})"
    if out["outside_torch"] < 0:
        line += ("; negative: tensors allocated but never written (most of a fresh KV cache) are counted as "
                 "tensor bytes but are not resident, so they are not in RssAnon" if report["device"]["type"] == "cpu"
                 else "; negative: the driver reports less in use than PyTorch has reserved")
    lines.append(line)
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

REPORT_FILES = ("diagnose.json", "diagnose.html", "memory_snapshot.pickle")


class ReportNotWritten(OSError):
    """The run finished but its files could not be written (a disk that filled during it): one line for the
    command, with the report, whose table is then the measurement."""

    def __init__(self, out_dir, error: OSError, report: dict):
        super().__init__(f"--out {out_dir}: the report could not be written: {_failure(error)}; the table is "
                         f"the measurement; free some space or give another --out folder")
        self.report = report


def write_report_files(write, report: dict, out_dir) -> None:
    """``write(report, Path(out_dir))``; its OSError (a disk that filled during the run) as ReportNotWritten,
    which carries the report, whose table is then still printed."""
    try:
        write(report, Path(out_dir))
    except OSError as error:
        report["files"] = {}
        raise ReportNotWritten(out_dir, error, report) from error


@contextmanager
def out_folder(out_dir: str | Path | None, snapshot: bool = False):
    """Around a run that writes its report to ``out_dir`` (None: none): refuse_foreign_outputs first, so a bad
    --out is refused before the run; if the run fails, the folders made for it are removed again while still
    empty, so a refused or failed run leaves nothing behind (rmdir never removes a file)."""
    made = [] if out_dir is None else refuse_foreign_outputs(out_dir, snapshot)
    try:
        yield
    except BaseException:
        _remove_empty(made)
        raise


def refuse_foreign_outputs(out_dir: str | Path, snapshot: bool = False) -> list[Path]:
    """Raise the one-line ValueError if ``out_dir`` holds a file this run would write that no
    diagnose wrote: a report replaces only an earlier report (its JSON's "mempath_diagnose" key,
    its HTML's title; with ``snapshot``, a memory snapshot beside such a JSON). Else make the folder
    now and check a file can be written there, so a bad --out is refused before the run; return the
    folders it made, the deepest first."""
    out_dir = Path(out_dir)
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise ValueError(f"--out {out_dir} is a file, not a folder; give a folder for the report "
                             f"(it is made if missing)")
        _check_can_make(out_dir)
        ours = {"diagnose.json": _is_report_json(out_dir / "diagnose.json")}
        ours["diagnose.html"] = _is_report_html(out_dir / "diagnose.html")
        ours["memory_snapshot.pickle"] = ours["diagnose.json"]
        for name in REPORT_FILES if snapshot else REPORT_FILES[:2]:
            if (out_dir / name).exists() and not ours[name]:
                raise ValueError(f"--out {out_dir}: {name} is there and is not a mempath diagnose report; "
                                 f"give another --out folder, or move the file")
    except OSError as error:  # stat refused: a name too long, a folder above that cannot be searched
        raise ValueError(f"--out {out_dir} cannot be made: {_failure(error)}; give a folder you can write") \
            from error
    return _make_and_try(out_dir)


def _check_can_make(out_dir: Path) -> None:
    """The folder, or the nearest existing one above it, must be a folder this user can write: found
    before the run, not when the report is written after it."""
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():
            raise ValueError(f"--out {out_dir} cannot be made: {existing} is a link to {os.readlink(existing)}, "
                             f"which does not exist; give a folder for the report")
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--out {out_dir} cannot be made: {existing} is not a folder; give a folder for the report")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out_dir} cannot be made: {existing} is not writable by this user; give a folder "
                         f"you can write")


def _make_and_try(out_dir: Path) -> list[Path]:
    """Make the folder and write a scratch file into it; the folders made, the deepest first. os.access says
    yes to root, on /proc and on a read-only mount, and the folder used to be made only after the run, whose
    measurement was then lost. The scratch file is a new one (mkstemp opens with O_EXCL), removed at once:
    no file is touched that this check did not create."""
    missing = [out_dir, *out_dir.parents]
    missing = missing[:next(i for i, folder in enumerate(missing) if folder.exists())]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--out {out_dir} cannot be made: {_failure(error)}; give a folder you can write") \
            from error
    try:
        fd, scratch = tempfile.mkstemp(prefix=".mempath-diagnose-", suffix=".tmp", dir=out_dir)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(b"mempath diagnose: checking that --out can be written\n")
        finally:
            os.unlink(scratch)
    except OSError as error:
        _remove_empty(missing)
        raise ValueError(f"--out {out_dir} cannot be written: {_failure(error)}; give a folder you can write") \
            from error
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders made for a run that failed, the deepest first, while they are empty: rmdir never
    removes a file, so one that holds anything (a report file got written) stays, with those above it."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _failure(error: OSError) -> str:
    """'/proc/nope: No such file or directory' from an OSError: the path that failed and why."""
    return f"{error.filename}: {error.strerror}" if error.filename and error.strerror else str(error)


def _is_report_json(path: Path) -> bool:
    try:
        report = loads_json(path.read_text())
        return isinstance(report, dict) and "mempath_diagnose" in report
    except (OSError, ValueError, TypeError):
        return False


def _is_report_html(path: Path) -> bool:
    try:
        return "<title>mempath diagnose</title>" in path.read_text(errors="replace")[:4096]
    except OSError:
        return False


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, default=str) + "\n")


# ---------------------------------------------------------------- charts

def _figure_class():
    """matplotlib's Figure, imported on first use: only the HTML report draws."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ValueError(f"the HTML report plots with matplotlib, which cannot be imported ({error}): "
                         f"pip install matplotlib") from None
    return Figure


def require_plotting() -> None:
    """Raise the one-line ValueError now if the charts could not be drawn later."""
    _figure_class()


_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def byte_unit(largest: float) -> tuple[str, int]:
    """The binary unit that keeps `largest` at 1 or more: one unit per axis."""
    for name, size in _UNITS:
        if abs(largest) >= size:
            return name, size
    return "B", 1


def _axis_bytes(value: float) -> str:
    name, size = byte_unit(value)
    return f"{value / size:g} {name}"


def _svg(figure) -> str:
    """The figure as an inline <svg> element: text kept as text, no file header or metadata."""
    import io

    import matplotlib
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "font.size": 9}):
        figure.savefig(buffer, format="svg", bbox_inches="tight",  # labels are never clipped
                       metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def _chart(name: str, svg: str, caption: str) -> str:
    return f'<figure class="chart" id="{name}">{svg}<figcaption>{caption}</figcaption></figure>'


def pathways_svg(rows: list[dict]) -> str:
    """Predicted and measured bytes per pathway on one log axis, and the error on one % axis."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter
    rows = [r for r in rows if r["predicted"] is not None or r["measured"] is not None]
    figure = _figure_class()(figsize=(9.5, 0.3 * len(rows) + 1.0))
    sizes, errors = figure.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 1.3], "wspace": 0.04})
    positive = [v for r in rows for v in (r["predicted"], r["measured"]) if v is not None and v > 0] or [1]
    for i, r in enumerate(rows):
        for offset, key, fill in ((-0.2, "predicted", "#bab0ac"), (0.2, "measured", colour(_row_pathway(r["pathway"])))):
            if r[key] is not None and r[key] > 0:
                sizes.barh(i + offset, r[key], height=0.38, color=fill)
        if r["error_pct"] is not None:
            shade = "#b00" if abs(r["error_pct"]) > 10 else "#666"
            errors.barh(i, r["error_pct"], height=0.6, color=shade, alpha=0.6)
            errors.plot([r["error_pct"]], [i], marker="|", ms=9, mew=2, color=shade)  # 0% shows too
        else:
            errors.text(0, i, "no prediction" if r["predicted"] is None else "predicted 0", va="center",
                        ha="center", fontsize=7, color="#666")
    low, high = max(1, min(positive) // 2), max(positive) * 2
    sizes.set_xscale("log", base=2)
    sizes.set_xlim(low, high)
    # Ticks at powers of 32 (1 B, 32 B, 1 KiB, 32 KiB, ...): each is a whole number in its unit.
    ticks = [2 ** k for k in range(0, 64, 5) if low <= 2 ** k <= high]
    sizes.xaxis.set_major_locator(FixedLocator(ticks))
    sizes.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _axis_bytes(v)))
    sizes.xaxis.set_minor_formatter(NullFormatter())
    sizes.set_xlabel("bytes (log scale): grey predicted, coloured measured")
    sizes.set_yticks(range(len(rows)), [r["pathway"] for r in rows])
    sizes.invert_yaxis()
    sizes.grid(axis="x", alpha=0.3)
    worst = max([abs(r["error_pct"]) for r in rows if r["error_pct"] is not None] + [5.0])
    errors.set_xlim(-worst * 1.15, worst * 1.15)
    errors.axvline(0, color="#333", lw=0.8)
    errors.set_xlabel("error (% of predicted)")
    errors.grid(axis="x", alpha=0.3)
    return _svg(figure)


def timeline_svg(samples: list[list], stage_pathways: dict[str, str]) -> str:
    """Device bytes over time; the background of each stage takes its pathway's colour."""
    from matplotlib.patches import Patch
    if len(samples) < 2:
        return "<p>(too few samples for a timeline)</p>"
    unit, size = byte_unit(max(s[1] for s in samples))
    figure = _figure_class()(figsize=(9.5, 3.0))
    axes = figure.subplots()
    for start, end, stage in _stage_spans(samples):
        axes.axvspan(start, end, color=colour(stage_pathways.get(stage, "idle")), alpha=0.25, lw=0)
    axes.plot([s[0] for s in samples], [s[1] / size for s in samples], color="#333", lw=1.2)
    axes.set_xlim(0, samples[-1][0])
    axes.set_ylim(bottom=0)
    axes.set_xlabel("time (s)")
    axes.set_ylabel(f"live tensor bytes ({unit})")
    axes.grid(alpha=0.3)
    pathways = dict.fromkeys(stage_pathways.get(s[2], "idle") for s in _stage_spans(samples))
    axes.legend(handles=[Patch(color=colour(p), alpha=0.4, label=p) for p in pathways], fontsize=8,
                loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _svg(figure)


def _stage_spans(samples):
    spans, start, stage = [], samples[0][0], samples[0][3]
    for s in samples[1:]:
        if s[3] != stage:
            spans.append((start, s[0], stage))
            start, stage = s[0], s[3]
    spans.append((start, samples[-1][0], stage))
    return [span for span in spans if span[2] != "idle"]


def kv_growth_svg(growth: list[dict]) -> str:
    """KV bytes in use after every engine step: the blocks the tokens need against the blocks held."""
    unit, size = byte_unit(max(max(s["measured_bytes"], s["predicted_bytes"]) for s in growth))
    figure = _figure_class()(figsize=(9.5, 2.6))
    axes = figure.subplots()
    steps = [s["step"] for s in growth]
    axes.plot(steps, [s["measured_bytes"] / size for s in growth], color=colour("kv_cache"), lw=3,
              label="measured: blocks in use")
    axes.plot(steps, [s["predicted_bytes"] / size for s in growth], color="#333", lw=1, ls="--",
              label="predicted: blocks the tokens need")
    axes.set_ylim(bottom=0)
    axes.set_xlabel("engine step")
    axes.set_ylabel(f"KV cache in use ({unit})")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _svg(figure)


def leak_svg(leak: dict) -> str:
    """Allocated bytes after each request relative to the first after warm-up, scaled to the change.

    Drawn from 0 a leak of kilobytes on gigabytes is a flat line; relative to request 2 and
    scaled by requests 2.. (the ones the slope is fitted on) it is a visible ramp.
    """
    after = leak["allocated_after_each"]
    if len(after) < 2:
        return "<p>(one request: nothing to compare)</p>"
    base = after[1]
    change = [a - base for a in after]
    fitted = change[1:]
    unit, size = byte_unit(max([abs(c) for c in fitted] + [1024]))
    limit = max(max(abs(c) for c in fitted) * 1.3, 1024) / size
    figure = _figure_class()(figsize=(9.5, 3.0))
    axes = figure.subplots()
    requests = list(range(1, len(after) + 1))
    axes.plot(requests[1:], [c / size for c in fitted], color=colour("leak"), marker="o", lw=1.5,
              label="after warm-up (slope fitted)")
    warm_up = change[0] / size
    if abs(warm_up) <= limit:
        axes.plot([1], [warm_up], marker="o", mfc="none", color=colour("leak"), ls="none", label="warm-up")
    else:  # off the scale: say where it is instead of flattening the rest
        axes.annotate(f"request 1 (warm-up): {'+' if change[0] > 0 else ''}{format_bytes(change[0])}, off the scale",
                      xy=(1, limit if warm_up > 0 else -limit),
                      xytext=(4, -12 if warm_up > 0 else 4), textcoords="offset points", fontsize=8)
    axes.axhline(0, color="#333", lw=0.8)
    axes.set_ylim(-limit, limit)
    axes.set_xlim(0.5, len(after) + 0.5)
    axes.set_xticks(requests)
    axes.set_xlabel("request")
    axes.set_ylabel(f"allocated − request 2 ({unit})")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _svg(figure)


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


# ---------------------------------------------------------------- HTML

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1000px; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.bad { color: #b00; } .ok { color: #060; }
figure.chart { margin: 1em 0; } figure.chart svg { max-width: 100%; height: auto; }
figcaption, p.note { font-size: 12px; color: #555; }
"""


def write_html(report: dict, path: str | Path) -> None:
    Path(path).write_text(render_html(report))


def render_html(report: dict) -> str:
    return html_document(["<h1>mempath diagnose</h1>"] + html_sections(report))


def html_document(body: list[str]) -> str:
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>mempath diagnose</title>"
            f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>\n")


def html_sections(report: dict) -> list[str]:
    """One model's report: its rows, charts, stages, leak check and ledger."""
    stage_pathways = {s["name"]: s["pathway"] for s in report["stages"]}
    e = html.escape
    device = report["device"]
    body = [
        f"<p>{e(report['model'])} on {e(device['type'])} "
        f"({e(str(device.get('name', '')))}), {e(report['dtype'])}. Device bytes: "
        f"{e(report['measurement']['device_bytes'])}.</p>",
        "<h2>Predicted vs measured</h2>", _pathway_table(report["pathways"]),
        f"<p class=note>{ERROR_NOTE}</p>",
        _chart("pathways", pathways_svg(report["pathways"]),
               "Left: bytes per pathway on one log scale (grey: the plan, coloured: measured). Right: the "
               "error in % of the plan; red beyond ±10%."),
        "<h2>Memory timeline</h2>",
        _chart("timeline", timeline_svg(report["timeline"]["samples"], stage_pathways),
               "Live tensor bytes over the run; the background is the pathway of the stage running "
               "(start times in the table below)."),
        "<h2>Stages</h2>", _stage_table(report["stages"]), f"<p class=note>{STAGE_NOTE}</p>",
    ]
    growth = report.get("kv_growth") or []
    if growth:
        body += ["<h2>KV growth while generating</h2>", _chart(
            "kv-growth", kv_growth_svg(growth),
            "KV bytes held after each engine step against the bytes the live tokens need; the lines coincide "
            "unless blocks are miscounted.")]
    leak = report["leak"]
    body += ["<h2>Leak check</h2>",
             f"<p class=\"{'ok' if leak['ok'] else 'bad'}\">{e(leak['verdict'])}; slope "
             f"{leak['slope_bytes_per_request']:+.0f} B/request ({e(leak['source'])}).</p>",
             _chart("leak", leak_svg(leak),
                    "Allocated bytes after each identical request, relative to request 2 and scaled to the "
                    "change: a flat line at 0 is no leak. Request 1 warms up lazily built state.")]
    body += ["<h2>What the plan cannot know</h2><ul>"]
    body += [f"<li>{e(line)}</li>" for line in summary_lines(report)] + ["</ul>"]
    body += ["<h2>Engine ledger</h2>", _ledger_table(report["ledger"])]
    return body


ERROR_NOTE = ("error = (measured − predicted) / predicted; negative: less was measured than planned. "
              "Rows sized by a formula over tensor shapes must read 0%; activation rows are estimates "
              "(their detail says of what).")
STAGE_NOTE = ("delta: live bytes after the stage minus before; negative: the stage freed more than it kept "
              "(the backward frees the activations the forward kept). peak over start: the stage's highest "
              "live bytes minus those at its start.")


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
    out = ["<table><tr><th>stage</th><th>pathway</th><th>start (s)</th><th>seconds</th><th>delta</th>"
           "<th>peak over start</th><th>host RssAnon peak</th></tr>"]
    for s in stages:
        out.append(f"<tr><td>{html.escape(s['name'])}</td><td>{html.escape(s['pathway'])}</td>"
                   f"<td class=num>{s['t_start']:.2f}</td>"
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

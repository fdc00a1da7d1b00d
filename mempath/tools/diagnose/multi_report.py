"""Rendering `mempath diagnose A B`: one model's section as a one-model report renders it, then the
shared KV pages (their rows, each model's block and the split over the alternating workload)."""
from __future__ import annotations

import html
from pathlib import Path

from mempath.tools.diagnose.report import (_chart, _figure_class, _ledger_table, _pathway_table, _size, _svg,
                                           format_table, html_document, html_sections)

MODEL_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#76b7b2")


def format_multi_table(report: dict) -> str:
    """Each model's table and summary, then the shared pages' section; the files last."""
    parts = [format_table({**section, "files": {}}) for section in report["models"]]
    parts.append("\n".join(shared_lines(report["shared_kv_pages"])))
    files = report.get("files") or {}
    if files:
        parts.append("\n".join(f"{kind}: {path}" for kind, path in files.items()))
    return "\n\n".join(parts)


def shared_lines(shared: dict) -> list[str]:
    """The pool's header, its rows against the plan, each model's block and pages, the split's verdict."""
    lines = [shared_header(shared), ""]
    for r in shared["rows"]:
        error = "-" if r["error_pct"] is None else f"{r['error_pct']:+.1f}%"
        lines.append(f"  {r['pathway']:<28}{_size(r['predicted']):>12}{_size(r['measured']):>12}{error:>9}  "
                     f"{r['measured_source']}")
    return lines + [""] + model_page_lines(shared) + ["", split_verdict(shared["split"])]


def shared_header(shared: dict) -> str:
    return (f"shared KV pages: {shared['num_pages']:,} pages of {_size(shared['page_bytes'])} "
            f"(planned {shared['planned_num_pages']:,}), kv-min-share {shared['kv_min_share']}")


def model_page_lines(shared: dict) -> list[str]:
    lines = [f"  {'model':<16}{'block':>7}{'tokens/page':>13}{'page fill':>11}{'guaranteed':>12}"
             f"{'pages min':>11}{'max':>6}{'final':>7}"]
    for name, m in shared["models"].items():
        p = m["pages"]
        lines.append(f"  {name:<16}{m['block_size']:>7}{m['tokens_per_page']:>13}{m['page_fill']:>11.0%}"
                     f"{m['guaranteed_pages']:>12}{p['min']:>11}{p['max']:>6}{p['final']:>7}")
    return lines


def split_verdict(split: dict) -> str:
    requests = ", ".join(f"{n} to {name}" for name, n in split["requests"].items())
    verdict = "every page free" if split["all_free_at_end"] else f"{split['free_at_end']:,} pages free: pages leaked"
    return (f"split over {len(split['samples'])} steps of an alternating workload ({requests} requests, "
            f"each burst starting while the one before runs): {verdict} at the end, "
            f"{split['num_cross_model_preemptions']} cross-model preemptions")


def split_svg(split: dict) -> str:
    """Pages each model holds after every step, stacked, under the pool's size."""
    names = split["columns"][1:-1]
    samples = split["samples"]
    figure = _figure_class()(figsize=(9.5, 2.8))
    axes = figure.subplots()
    steps = [s[0] for s in samples]
    held = [[s[i + 1] for s in samples] for i in range(len(names))]
    axes.stackplot(steps, *held, labels=names, colors=MODEL_COLOURS[:len(names)], alpha=0.8)
    if len(steps) > 1:
        axes.set_xlim(steps[0], steps[-1])
    axes.set_ylim(bottom=0)
    axes.set_xlabel("step of the alternating workload")
    axes.set_ylabel("KV pages held")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _svg(figure)


def write_multi_html(report: dict, path: str | Path) -> None:
    e = html.escape
    body = ["<h1>mempath diagnose: several models</h1>"]
    for section in report["models"]:
        body += [f"<h1>{e(section['name'])}</h1>"] + html_sections(section)
    shared = report["shared_kv_pages"]
    split = shared["split"]
    body += ["<h1>Shared KV pages</h1>", f"<p>{e(shared_header(shared))}</p>", _pathway_table(shared["rows"]),
             "<pre>" + e("\n".join(model_page_lines(shared))) + "</pre>",
             f"<p class=\"{'ok' if split['all_free_at_end'] else 'bad'}\">{e(split_verdict(split))}</p>",
             _chart("split", split_svg(split),
                    "Pages each model holds after every step of the alternating workload (stacked)."),
             "<h2>Pool ledger</h2>", _ledger_table(shared["ledger"])]
    Path(path).write_text(html_document(body))

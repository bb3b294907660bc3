"""Write a profile's Chrome/Perfetto trace, its JSON, and a self-contained HTML report."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from ..utils import atomic_write, require

__all__ = ["write_outputs", "render_html"]


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _charts(report) -> list[str]:
    matplotlib = require("matplotlib", "bench", "the profile's HTML report")
    matplotlib.use("Agg")  # headless: no display on benchmark machines
    from matplotlib import pyplot as plt

    charts = []
    cats = [(c, s * 1e3) for c, s in report.categories.items() if s > 0]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([c for c, _ in cats][::-1], [ms for _, ms in cats][::-1], color="#4477aa")
    ax.set_xlabel("ms per step")
    ax.set_title(f"Where the {report.step_time_s * 1e3:.2f} ms step goes")
    charts.append(_png(fig))
    plt.close(fig)
    top = report.ops[:12]
    if top:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.barh([r.name[:40] for r in top][::-1], [r.share * 100 for r in top][::-1], color="#ee6677")
        ax.set_xlabel("% of step (self time)")
        ax.set_title("Top ops")
        charts.append(_png(fig))
        plt.close(fig)
    return charts


def _table(headers, rows) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report, title: str) -> str:
    ms = 1e3
    cat_rows = [(c, f"{s * ms:.3f}", f"{s / report.step_time_s:.1%}") for c, s in report.categories.items()]
    op_rows = [(r.name, r.category, f"{r.calls:.0f}", f"{r.self_cpu_s * ms:.3f}", f"{r.self_device_s * ms:.3f}",
                f"{r.share:.1%}", "-" if r.flops is None else f"{r.flops / 1e9:.3f}",
                "-" if r.bytes is None else f"{r.bytes / 1e6:.2f}",
                "-" if r.intensity is None else f"{r.intensity:.2f}", r.bound) for r in report.ops[:60]]
    recs = "".join(f"<li><b>{html.escape(r.config)}</b>: {html.escape(r.finding)}; {html.escape(r.suggestion)}</li>"
                   for r in report.recommendations) or "<li>nothing stands out</li>"
    mfu = "n/a (no peak)" if report.mfu is None else f"{report.mfu:.1%}"
    images = "".join(f'<img alt="chart" src="data:image/png;base64,{png}">' for png in _charts(report))
    notes = "".join(f"<p>{html.escape(n)}</p>" for n in report.notes)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:70em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}td:first-child,th:first-child{{text-align:left}}
img{{display:block;margin:1em 0}}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>Device {html.escape(report.device)}; {report.steps} profiled steps; step {report.step_time_s * ms:.3f} ms under
the profiler, {report.unprofiled_step_time_s * ms:.3f} ms without it. Model FLOPs/step {report.flops_per_step:.4g};
MFU {mfu}.</p><p><i>{html.escape(report.mfu_conventions)}</i></p>
{images}<h2>Categories (per step; sum = profiled step time)</h2>
{_table(["category", "ms", "% of step"], cat_rows)}
<h2>Recommendations</h2><ul>{recs}</ul>
<h2>Ops (per step)</h2>
{_table(["op", "category", "calls", "self CPU ms", "self device ms", "% step", "GFLOP", "MB", "FLOP/B", "bound"], op_rows)}
<p>Bytes: logical sizes of each op's tensor inputs read and outputs written (views move nothing, caches
ignored). Bound: arithmetic intensity against the ridge point peak FLOP/s / peak bytes/s.</p>{notes}
</body></html>"""


def write_outputs(report, prof, out_dir, title: str) -> None:
    """trace.json (open in ui.perfetto.dev or chrome://tracing), profile.json and report.html."""
    out = Path(out_dir)
    require("matplotlib", "bench", "the profile's HTML report")  # before anything is written
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    report.trace_path = str(trace)
    report.html_path = str(out / "report.html")
    atomic_write(out / "report.html", render_html(report, title))
    atomic_write(out / "profile.json", json.dumps(report.to_dict(), indent=1, default=str))

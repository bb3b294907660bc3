"""From worker results to results.json (schema: docs/benchmark-schema.md), PNG charts and report.html."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from ..utils import atomic_write, require
from .ceiling import target_lines
from .configs import BASELINE, get_config
from .stats import (achieved_flops, bootstrap_ratio_ci, mfu, relative_change, round_times, slow_dtypes, speed_ratio,
                    summarize, throughput)

__all__ = ["config_metrics", "loss_check", "ratio_to_reference", "build_results", "write_results", "write_reports",
           "write_charts", "train_loss_window", "table_cells", "SCHEMA", "CHARTS", "TABLE_COLUMNS", "TIMED_METRICS"]

SCHEMA = "turbotrain-bench/2"
CHARTS = ("throughput", "vs_ref", "memory", "loss")
#: Metrics derived from the step time: each carries the row's ratio to the reference.
TIMED_METRICS = ("step_time", "throughput", "achieved_flops", "mfu", "mfu_bf16")
_GROUP_COLORS = {"peer": "#f58518", "turbotrain": "#4c78a8"}
_OTHER_COLOR = "#54a24b"


def train_loss_window(steps: int) -> int:
    """Measured steps the reported train loss is averaged over: the last quarter (at least one)."""
    return max(1, steps // 4)


def _metric(unit, median, p20=None, p80=None) -> dict:
    return {"unit": unit, "median": median, "p20": p20, "p80": p80}


def _inverse(numerator: float, times: dict, fn) -> tuple[float, float, float]:
    # a rate's 20th percentile comes from the step time's 80th, and vice versa
    return fn(numerator, times["median"]), fn(numerator, times["p80"]), fn(numerator, times["p20"])


def config_metrics(header: dict, result: dict, baseline: dict | None) -> dict[str, dict]:
    """Every metric of one successful row: name -> {unit, median, p20, p80} (p20/p80 None for scalars)."""
    times = summarize(result["step_seconds"]).to_dict()
    unit = header["workload"]["unit"]
    flops = header["flops_per_step"]
    peaks = header["environment"]["matmul_peak_flops"]
    out = {
        "step_time": _metric("s", times["median"], times["p20"], times["p80"]),
        "throughput": _metric(f"{unit}/s", *_inverse(header["workload"]["items_per_step"], times, throughput)),
        "achieved_flops": _metric("FLOP/s", *_inverse(flops, times, achieved_flops)),
        "peak_memory": _metric("bytes", result["peak_memory_bytes"]),
    }
    if result.get("tensor_peak_bytes") is not None:  # CPU rows: tensors only, as CUDA's peak_memory
        out["tensor_peak"] = _metric("bytes", result["tensor_peak_bytes"])
    if result.get("ops_per_step") is not None:
        out["ops_per_step"] = _metric("aten ops", result["ops_per_step"])
    references = [("mfu", result["compute_dtype"])]
    # where bf16 is emulated (slower than fp32) every fp32 row would sit far above 100% of its peak
    if "bf16" not in slow_dtypes(header["environment"]):
        references.append(("mfu_bf16", "bf16"))
    for name, dtype in references:
        if dtype in peaks:
            out[name] = _metric(f"fraction of {dtype} matmul peak", *_inverse(flops, times, _mfu_at(peaks[dtype])))
    window = train_loss_window(len(result["step_seconds"]))
    out["train_loss"] = _metric("nats", sum(result["losses"][-window:]) / window)
    out["val_loss"] = _metric("nats", result["val_loss"])
    if baseline and baseline.get("status") in ("ok", "FAILED"):
        base_median = summarize(baseline["step_seconds"]).median
        out["speedup"] = _metric("x", base_median / times["median"])
        out["val_loss_delta"] = _metric("%", relative_change(result["val_loss"], baseline["val_loss"]))
    return out


def _mfu_at(peak: float):
    return lambda flops, seconds: mfu(flops, seconds, peak)


def loss_check(row: str, result: dict, baseline: dict | None, device: str) -> dict:
    """Whether ``row``'s val loss is within its declared tolerance of the fp32 row's.

    ``passed`` is True/False, or None when there is no fp32 row to check against.
    """
    tolerance = get_config(row).tolerance_on(device)
    out = {"reference": BASELINE, "tolerance_pct": tolerance, "delta_pct": None, "passed": None}
    if not baseline or baseline.get("status") not in ("ok", "FAILED") or not math.isfinite(baseline["val_loss"]):
        return {**out, "message": f"not checked: {BASELINE} did not run or did not finish"}
    value, base = result["val_loss"], baseline["val_loss"]
    delta = relative_change(value, base) if math.isfinite(value) else math.nan
    passed = math.isfinite(delta) and abs(delta) <= tolerance
    verdict = "within" if passed else "outside"
    return {**out, "delta_pct": delta, "passed": passed,
            "message": f"val loss {value:.4f} is {delta:+.2f}% from {BASELINE}'s {base:.4f}, "
                       f"{verdict} its {tolerance:g}% tolerance"}


def ratio_to_reference(result: dict, reference: dict | None) -> tuple[float | None, list[float] | None]:
    """(reference median / row median, its 95% bootstrap interval) over per-round times, or (None, None)."""
    if not reference or reference.get("status") not in ("ok", "FAILED"):
        return None, None
    ref, row = round_times(reference["round_seconds"]), round_times(result["round_seconds"])
    if not ref or not row:
        return None, None
    lo, hi = bootstrap_ratio_ci(ref, row)
    return speed_ratio(ref, row), [lo, hi]


def build_results(header: dict, raw: dict[str, dict]) -> dict:
    """The results.json document: header, long-format rows, and per-row detail.

    A row that ran is 'ok' or, when its val loss leaves its tolerance of the fp32 row, 'FAILED'
    (it keeps its metrics, so the figures stay on the page next to the verdict); a row that did
    not finish is 'error' and has no metrics.
    """
    run = header["run"]
    baseline, reference = raw.get(BASELINE), raw.get(run.get("reference"))
    common = {"workload": header["workload"]["name"], "device": run["device"],
              "versions": header["versions"], "timestamp": header["timestamp"]}
    rows, configs = [], {}
    for name, result in raw.items():
        config = get_config(name)
        detail = {"description": config.description, "group": config.group, **result}
        if name != config.name:
            detail["instance_of"] = config.name  # the A/A row: a second worker of the same config
        if result.get("status") in ("ok", "FAILED"):
            check = loss_check(name, result, baseline, run["device"])
            detail["status"] = "FAILED" if check["passed"] is False else "ok"
            detail["loss_check"] = check
            detail["metrics"] = config_metrics(header, result, baseline)
            ratio, ci = ratio_to_reference(result, reference)
            detail["ratio_vs_ref"], detail["ratio_ci95"] = ratio, ci
            for metric, value in detail["metrics"].items():
                timed = metric in TIMED_METRICS
                rows.append({**common, "config": name, "metric": metric, **value,
                             "ratio_vs_ref": ratio if timed else None, "ratio_ci95": ci if timed else None,
                             "rounds": result.get("rounds"), "status": detail["status"]})
        configs[name] = detail
    return {"schema": SCHEMA, "header": header, "rows": rows, "configs": configs}


# ------------------------------------------------------------------------------------------ charts
def _measured(results: dict) -> dict[str, dict]:
    """Rows with metrics, peers first (then ladder order), so the charts set them apart."""
    ran = {n: c for n, c in results["configs"].items() if "metrics" in c}
    return dict(sorted(ran.items(), key=lambda item: item[1]["group"] != "peer"))


def _style(config: dict) -> dict:
    style = {"color": _GROUP_COLORS.get(config["group"], _OTHER_COLOR)}
    if config.get("instance_of"):
        style["alpha"] = 0.55  # the A/A row: the reference again, drawn lighter
    if config["status"] == "FAILED":
        style.update(hatch="//", edgecolor="#d62728", linewidth=1.5)
    return style


def _label(name: str, config: dict) -> str:
    label = f"{name} (A/A)" if config.get("instance_of") else name
    return f"{label} (FAILED)" if config["status"] == "FAILED" else label


def _bars(ax, rows: dict, values: list[float], errors, ylabel: str):
    names = list(rows)
    for i, name in enumerate(names):
        err = None if errors is None else [[errors[0][i]], [errors[1][i]]]
        ax.bar(i, values[i], yerr=err, capsize=3, **_style(rows[name]))
    ax.set_xticks(range(len(names)), [_label(n, rows[n]) for n in names], rotation=30, ha="right")
    peers = sum(1 for c in rows.values() if c["group"] == "peer")
    if 0 < peers < len(names):
        ax.axvline(peers - 0.5, color="grey", ls=":", lw=1)
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=g) for g, c in (("peer (plain PyTorch)", _GROUP_COLORS["peer"]),
                                                     ("turbotrain", _GROUP_COLORS["turbotrain"]))]
    ax.legend(handles=handles, fontsize=7, loc="best")
    ax.set_ylabel(ylabel)


def _metric_chart(ax, results: dict, metric: str, scale: float, ylabel: str):
    rows = {n: c for n, c in _measured(results).items() if metric in c["metrics"]}
    values = [rows[n]["metrics"][metric] for n in rows]
    medians = [v["median"] / scale for v in values]
    errors = None
    if values and values[0]["p20"] is not None:
        errors = [[(v["median"] - v["p20"]) / scale for v in values], [(v["p80"] - v["median"]) / scale for v in values]]
    _bars(ax, rows, medians, errors, ylabel)
    reference = results["header"]["run"].get("reference")
    if metric == "throughput" and reference in rows:
        _reference_line(ax, rows[reference]["metrics"][metric]["median"] / scale, reference)


def _tensor_overlay(ax, results: dict):
    """CPU rows: their tensor peak drawn inside the RSS bar (hatched), labelled in the legend."""
    rows = {n: c for n, c in _measured(results).items() if "peak_memory" in c["metrics"]}
    tensors = [(i, c["metrics"]["tensor_peak"]["median"] / 2**20) for i, c in enumerate(rows.values())
               if "tensor_peak" in c["metrics"]]
    if not tensors:
        return
    for i, value in tensors:
        ax.bar(i, value, width=0.5, fill=False, hatch="//", edgecolor="black", lw=0.6)
    from matplotlib.patches import Patch

    handles = list(ax.get_legend().legend_handles)  # _bars' group legend, plus this one
    handles.append(Patch(fill=False, hatch="//", edgecolor="black", label="tensors (CPU: the rest is the process)"))
    ax.legend(handles=handles, fontsize=7, loc="best")


def _reference_line(ax, value: float, reference: str):
    ax.axhline(value, color="black", lw=1.2, ls="--")
    ax.annotate(f"reference: {reference}", xy=(0, value), xycoords=("axes fraction", "data"),
                xytext=(4, 4), textcoords="offset points", fontsize=7)


def _ratio_chart(ax, results: dict):
    reference = results["header"]["run"].get("reference")
    rows = {n: c for n, c in _measured(results).items() if c.get("ratio_vs_ref") is not None}
    ratios = [rows[n]["ratio_vs_ref"] for n in rows]
    errors = [[r - rows[n]["ratio_ci95"][0] for n, r in zip(rows, ratios)],
              [rows[n]["ratio_ci95"][1] - r for n, r in zip(rows, ratios)]]
    _bars(ax, rows, ratios, errors, "throughput / reference's (x, 95% CI)")
    if reference:
        _reference_line(ax, 1.0, reference)


def _draw(kind: str, ax, results: dict):
    unit = results["header"]["workload"]["unit"]
    if kind == "throughput":
        _metric_chart(ax, results, "throughput", 1.0, f"{unit}/s (median, p20-p80)")
    elif kind == "vs_ref":
        _ratio_chart(ax, results)
    elif kind == "memory":
        _metric_chart(ax, results, "peak_memory", 2**20, "peak memory (MiB)")
        _tensor_overlay(ax, results)
    else:
        warmup = results["header"]["run"]["warmup"]
        for name, c in _measured(results).items():
            ax.plot(range(1, len(c["losses"]) + 1), c["losses"], label=_label(name, c), lw=1.2,
                    ls="--" if c["group"] == "peer" else "-")
        if warmup:
            ax.axvspan(0.5, warmup + 0.5, color="grey", alpha=0.15, label="warm-up")
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        if ax.get_legend_handles_labels()[0]:  # every row failed and no warm-up: nothing to label
            ax.legend(fontsize=7)
    ax.set_title({"vs_ref": "throughput vs the reference"}.get(kind, kind))


def write_charts(results: dict, out_dir: Path) -> list[Path]:
    """One PNG per chart in CHARTS (matplotlib, Agg backend)."""
    matplotlib = require("matplotlib", "bench", "the benchmark report's charts")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for kind in CHARTS:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        _draw(kind, ax, results)
        fig.tight_layout()
        path = out_dir / f"{kind}.png"
        atomic_write(path, lambda f, fig=fig: fig.savefig(f, format="png", dpi=100))
        plt.close(fig)
        paths.append(path)
    return paths


# -------------------------------------------------------------------------------------------- html
TABLE_COLUMNS = ("config", "status", "step s median (p20-p80)", "throughput", "vs best peer (95% CI)",
                 "speed-up vs fp32", "peak mem", "MFU", "MFU@bf16", "ops/step", "train loss", "val loss",
                 "Δval vs fp32 (tol)")


def error_cell(error: str, limit: int = 240) -> str:
    """A failed row's error for its table cell: the first line, then the first compiler ``error:``
    line where one follows (an Inductor C++ error is thousands of lines of compiler output), at most
    ``limit`` characters. results.json keeps the whole text and the traceback.

    >>> error_cell("InductorError: CppCompileError: C++ compile error\\nwarning: x\\nk.cpp:3: error: bad")
    'InductorError: CppCompileError: C++ compile error | k.cpp:3: error: bad'
    """
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if not lines:
        return ""
    detail = next((line for line in lines[1:] if "error:" in line), None)
    text = lines[0] + (f" | {detail}" if detail else "")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def table_cells(name: str, config: dict, unit: str) -> list[str]:
    """The report's table row for one config (shared by the terminal table and the HTML)."""
    if "metrics" not in config:
        return [name, config.get("status", "?"), error_cell(str(config.get("error", "")))] + [""] * (len(TABLE_COLUMNS) - 3)
    m = config["metrics"]

    def fmt(metric, pattern, scale=1.0):
        return pattern.format(m[metric]["median"] * scale) if metric in m else "—"

    st = m["step_time"]
    ratio, ci = config.get("ratio_vs_ref"), config.get("ratio_ci95")
    check = config.get("loss_check", {})
    delta = fmt("val_loss_delta", "{:+.2f}%") + (f" (±{check['tolerance_pct']:g}%)" if check else "")
    return [
        name,
        config["status"],
        f"{st['median']:.3f} ({st['p20']:.3f}-{st['p80']:.3f})",
        fmt("throughput", "{:,.0f} " + unit + "/s"),
        f"{ratio:.2f}x ({ci[0]:.2f}-{ci[1]:.2f})" if ratio is not None else "—",
        fmt("speedup", "{:.2f}x"),
        fmt("peak_memory", "{:,.0f} MiB", 2**-20) + (fmt("tensor_peak", " (tensors {:,.0f})", 2**-20)
                                                      if "tensor_peak" in m else ""),
        fmt("mfu", "{:.1f}% " + config["compute_dtype"], 100),
        fmt("mfu_bf16", "{:.1f}%", 100),
        fmt("ops_per_step", "{:,.0f}"),
        fmt("train_loss", "{:.4f}"),
        fmt("val_loss", "{:.4f}"),
        delta,
    ]


def _html_table(header_cells, rows) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in header_cells)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _peak_text(env: dict, peak: dict | None) -> str:
    text = ", ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in env["matmul_peak_flops"].items())
    if peak:
        where = "; ".join(f"{d}: best at {v['best_gemm']}, {v['source']} ({v['reason']}), load average "
                          f"{', '.join(f'{x:.2f}' for x in v['loadavg'])} when measured"
                          for d, v in peak["detail"].items())
        text += f" ({where})"
    return text + f" [{env['matmul_peak_method']}]"


def write_html(results: dict, out_dir: Path, charts: list[Path]) -> Path:
    h = results["header"]
    env = h["environment"]
    hw = env["hardware"]
    run = h["run"]
    env_rows = [
        ("device", hw["device"] + (f" {hw['cuda_name']} (capability {hw['cuda_capability']})" if hw["cuda_name"] else "")),
        ("cpu", f"{hw['cpu_model']}, {hw['cpu_count']} logical CPUs, torch threads {hw['torch_threads']}"),
        ("cpu features", ", ".join(hw["cpu_features"]) or "none"),
        ("versions", ", ".join(f"{k} {v}" for k, v in h["versions"].items())),
        ("matmul peak (MFU denominator)", _peak_text(env, h.get("peak"))),
        ("copy bandwidth", f"{env['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s"),
        ("recommended precision", f"{env['recommended_precision']}: {env['recommended_precision_reason']}"),
        ("workload", f"{h['workload']['name']} {json.dumps(h['workload']['settings'])}"),
        ("FLOPs per step", f"{h['flops_per_step'] / 1e9:.2f} GFLOP ({h['flop_conventions']})"),
        ("measurement", h.get("measurement", "")),
        ("run", json.dumps(run)),
        ("timestamp", h["timestamp"]),
    ] + [("note", n) for n in h["notes"]]
    unit = h["workload"]["unit"]
    rows = [table_cells(n, c, unit) for n, c in results["configs"].items()]
    verdict = "\n".join(target_lines(results.get("targets")))
    targets = f"<h2>Targets</h2><pre>{html.escape(verdict)}</pre>" if verdict else ""
    images = "".join(
        f'<figure><img alt="{p.stem}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"<figcaption>{p.name}</figcaption></figure>" for p in charts)
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>turbotrain bench: {html.escape(h['workload']['name'])}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin-bottom:1.5em}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}}figure{{display:inline-block;margin:0 1em 1em 0}}</style>
</head><body><h1>turbotrain bench: {html.escape(h['workload']['name'])}</h1>
<h2>Environment</h2>{_html_table(("", ""), env_rows)}
<h2>Results</h2>{_html_table(TABLE_COLUMNS, rows)}
<p>vs best peer = the reference's median per-round step time over the row's ({html.escape(str(run.get('reference')))},
the strongest peer), with its 95% bootstrap interval over {run.get('rounds')} interleaved rounds;
{html.escape(str(run.get('aa_row') or 'no A/A row'))} is the reference run again in its own worker: its interval is
the noise floor. FAILED: the val loss left the row's tolerance of {BASELINE}'s. MFU = FLOPs per step / median step
time / matmul peak of the row's compute dtype (and of bf16 for every row). Speed-up and Δval are relative to
{BASELINE}.</p>{targets}
<h2>Charts</h2>{images}</body></html>"""
    path = out_dir / "report.html"
    atomic_write(path, doc)
    return path


def write_results(results: dict, out_dir: Path) -> Path:
    """``out_dir/results.json``, replaced atomically (the ladder rewrites it after every round)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    atomic_write(json_path, json.dumps(results, indent=1))
    return json_path


def write_reports(results: dict, out_dir: Path) -> list[Path]:
    """results.json, the PNG charts and report.html in ``out_dir``; returns their paths."""
    json_path = write_results(results, out_dir)
    charts = write_charts(results, out_dir)
    return [json_path, write_html(results, out_dir, charts), *charts]

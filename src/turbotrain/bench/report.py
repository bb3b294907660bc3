"""From worker results to results.json (schema: docs/benchmark-schema.md), PNG charts and report.html."""

from __future__ import annotations

import base64
import html
import json
import os
from pathlib import Path

from .configs import BASELINE, get_config
from .stats import achieved_flops, mfu, relative_change, slow_dtypes, summarize, throughput

__all__ = ["config_metrics", "build_results", "write_reports", "train_loss_window", "SCHEMA", "CHARTS"]

SCHEMA = "turbotrain-bench/1"
CHARTS = ("throughput", "speedup", "memory", "loss")


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
    if baseline and baseline.get("status") == "ok":
        base_median = summarize(baseline["step_seconds"]).median
        out["speedup"] = _metric("x", base_median / times["median"])
        out["val_loss_delta"] = _metric("%", relative_change(result["val_loss"], baseline["val_loss"]))
    return out


def _mfu_at(peak: float):
    return lambda flops, seconds: mfu(flops, seconds, peak)


def build_results(header: dict, raw: dict[str, dict]) -> dict:
    """The results.json document: header, long-format rows, and per-config detail."""
    baseline = raw.get(BASELINE)
    common = {"workload": header["workload"]["name"], "device": header["run"]["device"],
              "versions": header["versions"], "timestamp": header["timestamp"]}
    rows, configs = [], {}
    for name, result in raw.items():
        config = get_config(name)
        detail = {"description": config.description, "group": config.group, **result}
        if result.get("status") == "ok":
            detail["metrics"] = config_metrics(header, result, baseline)
            rows += [{**common, "config": name, "metric": metric, **value}
                     for metric, value in detail["metrics"].items()]
        configs[name] = detail
    return {"schema": SCHEMA, "header": header, "rows": rows, "configs": configs}


# ------------------------------------------------------------------------------------------ charts
def _ok(results: dict) -> dict[str, dict]:
    return {n: c for n, c in results["configs"].items() if c.get("status") == "ok"}


def _bar_chart(ax, results: dict, metric: str, scale: float, ylabel: str):
    ok = _ok(results)
    names = [n for n, c in ok.items() if metric in c["metrics"]]
    values = [ok[n]["metrics"][metric] for n in names]
    medians = [v["median"] / scale for v in values]
    errs = None
    if values and values[0]["p20"] is not None:
        errs = [[(v["median"] - v["p20"]) / scale for v in values], [(v["p80"] - v["median"]) / scale for v in values]]
    ax.bar(names, medians, yerr=errs, capsize=3, color="#4c78a8")
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", rotation=30)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")


def _draw(kind: str, ax, results: dict):
    unit = results["header"]["workload"]["unit"]
    if kind == "throughput":
        _bar_chart(ax, results, "throughput", 1.0, f"{unit}/s (median, p20-p80)")
    elif kind == "speedup":
        _bar_chart(ax, results, "speedup", 1.0, f"speed-up vs {BASELINE} (x)")
        ax.axhline(1.0, color="grey", lw=0.8)
    elif kind == "memory":
        _bar_chart(ax, results, "peak_memory", 2**20, "peak memory (MiB)")
    else:
        warmup = results["header"]["run"]["warmup"]
        for name, c in _ok(results).items():
            ax.plot(range(1, len(c["losses"]) + 1), c["losses"], label=name, lw=1.2)
        if warmup:
            ax.axvspan(0.5, warmup + 0.5, color="grey", alpha=0.15, label="warm-up")
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.legend(fontsize=7)
    ax.set_title(kind)


def write_charts(results: dict, out_dir: Path) -> list[Path]:
    """One PNG per chart in CHARTS (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for kind in CHARTS:
        fig, ax = plt.subplots(figsize=(7, 4))
        _draw(kind, ax, results)
        fig.tight_layout()
        path = out_dir / f"{kind}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# -------------------------------------------------------------------------------------------- html
TABLE_COLUMNS = ("config", "step s median (p20-p80)", "throughput", "speed-up", "peak mem", "MFU",
                 "MFU@bf16", "ops/step", "train loss", "val loss", "Δval vs fp32")


def table_cells(name: str, config: dict, unit: str) -> list[str]:
    """The report's table row for one config (shared by the terminal table and the HTML)."""
    if config.get("status") != "ok":
        return [name, f"error: {config.get('error', 'unknown')}"] + [""] * (len(TABLE_COLUMNS) - 2)
    m = config["metrics"]

    def fmt(metric, pattern, scale=1.0):
        return pattern.format(m[metric]["median"] * scale) if metric in m else "—"

    st = m["step_time"]
    return [
        name,
        f"{st['median']:.3f} ({st['p20']:.3f}-{st['p80']:.3f})",
        fmt("throughput", "{:,.0f} " + unit + "/s"),
        fmt("speedup", "{:.2f}x"),
        fmt("peak_memory", "{:,.0f} MiB", 2**-20),
        fmt("mfu", "{:.1f}% " + config["compute_dtype"], 100),
        fmt("mfu_bf16", "{:.1f}%", 100),
        fmt("ops_per_step", "{:,.0f}"),
        fmt("train_loss", "{:.4f}"),
        fmt("val_loss", "{:.4f}"),
        fmt("val_loss_delta", "{:+.2f}%"),
    ]


def _html_table(header_cells, rows) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in header_cells)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write_html(results: dict, out_dir: Path, charts: list[Path]) -> Path:
    h = results["header"]
    env = h["environment"]
    hw = env["hardware"]
    env_rows = [
        ("device", hw["device"] + (f" {hw['cuda_name']} (capability {hw['cuda_capability']})" if hw["cuda_name"] else "")),
        ("cpu", f"{hw['cpu_model']}, {hw['cpu_count']} logical CPUs, torch threads {hw['torch_threads']}"),
        ("cpu features", ", ".join(hw["cpu_features"]) or "none"),
        ("versions", ", ".join(f"{k} {v}" for k, v in h["versions"].items())),
        ("matmul peak", ", ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in env["matmul_peak_flops"].items())
         + f" ({env['matmul_peak_method']})"),
        ("copy bandwidth", f"{env['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s"),
        ("recommended precision", f"{env['recommended_precision']}: {env['recommended_precision_reason']}"),
        ("workload", f"{h['workload']['name']} {json.dumps(h['workload']['settings'])}"),
        ("FLOPs per step", f"{h['flops_per_step'] / 1e9:.2f} GFLOP ({h['flop_conventions']})"),
        ("run", json.dumps(h["run"])),
        ("timestamp", h["timestamp"]),
    ] + [("note", n) for n in h["notes"]]
    unit = h["workload"]["unit"]
    rows = [table_cells(n, c, unit) for n, c in results["configs"].items()]
    images = "".join(
        f'<figure><img alt="{p.stem}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"<figcaption>{p.name}</figcaption></figure>" for p in charts)
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>turbotrain bench: {html.escape(h['workload']['name'])}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin-bottom:1.5em}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}}figure{{display:inline-block;margin:0 1em 1em 0}}</style>
</head><body><h1>turbotrain bench: {html.escape(h['workload']['name'])}</h1>
<h2>Environment</h2>{_html_table(("", ""), env_rows)}
<h2>Results</h2>{_html_table(TABLE_COLUMNS, rows)}
<p>MFU = FLOPs per step / median step time / measured matmul peak of the row's compute dtype
(and of bf16 for every row). Speed-up and Δval are relative to {BASELINE}.</p>
<h2>Charts</h2>{images}</body></html>"""
    path = out_dir / "report.html"
    path.write_text(doc, encoding="utf-8")
    return path


def write_reports(results: dict, out_dir: Path) -> list[Path]:
    """results.json, the PNG charts and report.html in ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    tmp = json_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, json_path)
    charts = write_charts(results, out_dir)
    return [json_path, write_html(results, out_dir, charts), *charts]

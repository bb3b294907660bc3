"""What a tune writes: tuned.json (the winning Config), tune.json (every candidate), tune.md, tune.html.

tune.json keys: ``schema``, ``timestamp``, ``workload``, ``environment`` (hardware, measured peaks,
bandwidth), ``settings``, ``facts`` (the analysis pass), ``space`` (axes, size, counts by status),
``pruned_axes`` (each pruned axis value with its reason and how many candidates it removed),
``models`` (the memory estimate and ordering model, stated), ``loss_check`` (the shadow run and
its tolerances), ``measurement``, ``candidates`` (one entry each: name, settings, config, status,
reason, estimates, measured), ``winner`` and ``tuner_wall_seconds``. With a data-parallel stage
(``--nproc``): ``data_parallel`` (its ranks, link, model, margin, rounds, choice rule and its
``candidates``, each with the model's prediction and, measured, its throughput ratio to the
uncompressed job with the 95% interval, wire bytes per step and val-loss delta) and
``compute_winner`` (the single-process search's choice; ``winner`` is then the two together).
"""

from __future__ import annotations

import html
import json
import logging
import time
from collections import Counter
from pathlib import Path

from ..utils import atomic_write
from ..bench.configs import LOSS_TOLERANCE
from ..bench.runner import MEASUREMENT
from ..bench.stats import BOOTSTRAP_RESAMPLES
from .prune import MEMORY_MODEL, ORDERING_MODEL
from .space import AXES, Candidate

__all__ = ["SCHEMA", "build_document", "write_reports", "render_markdown", "render_html", "pruned_axes"]

logger = logging.getLogger(__name__)

SCHEMA = "turbotrain-tune/1"
LOSS_CHECK = ("every candidate trains on the same seed and train batches as the baseline (plain FP32, no "
              "transforms: the shadow run) and is rejected when its val loss on the same val batches differs from "
              "the baseline's by more than the tolerance of its compute dtype, in percent of the baseline's")


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def _entry(c: Candidate) -> dict:
    return {"name": c.name, "settings": c.settings(), "config": c.config().to_dict(), "status": c.status,
            "reason": c.reason, "pruned_axis": c.pruned_axis, "baseline": c.is_baseline,
            "estimates": dict(c.estimates), "measured": dict(c.measured)}


def _axis_value(c: Candidate, axis: str) -> str:
    if axis == "memory":
        return c.name
    if axis == "data_parallel":
        return c.dp_label
    return str(c.settings()[axis])


def pruned_axes(candidates: list[Candidate], shown: int = 8) -> list[dict]:
    """One entry per (axis, reason): the values it removed (at most ``shown`` listed) and how many candidates."""
    def reason_of(c: Candidate) -> str:  # memory reasons carry each candidate's own estimate
        if c.pruned_axis == "memory":
            return "memory estimate (each candidate's in tune.json) " + c.reason.rsplit(") ", 1)[-1]
        return c.reason

    pruned = [c for c in candidates if c.status == "pruned"]
    groups = Counter((c.pruned_axis, reason_of(c)) for c in pruned)
    out = []
    for (axis, reason), count in groups.most_common():
        values = sorted({_axis_value(c, axis) for c in pruned if c.pruned_axis == axis and reason_of(c) == reason})
        if len(values) > shown:
            values = values[:shown] + [f"... {len(values) - shown} more"]
        out.append({"axis": axis, "values": values, "reason": reason, "candidates": count})
    return out


def _dp_section(dp) -> dict:
    counts = dict(Counter(c.status for c in dp.candidates))
    return {**dp.section, "space": {"size": len(dp.candidates), "counts": counts},
            "candidates": [_entry(c) for c in dp.candidates]}


def build_document(candidates: list[Candidate], winner: Candidate, facts, info, peaks: dict, bandwidth: float,
                   settings, workload, steps_per_round: list[int], wall_seconds: float, *, dp=None,
                   compute_winner: Candidate | None = None) -> dict:
    """tune.json's document. ``dp``: the data-parallel stage (dp_search.DpStage), whose winner is then
    ``winner`` and the single-process search's ``compute_winner``."""
    axes = {axis: sorted({str(c.settings().get(axis)) for c in candidates}) for axis in AXES
            if axis != "data_parallel"}
    if dp is not None:
        axes["data_parallel"] = sorted({c.dp_label for c in dp.candidates})
    extra = {} if dp is None else {"data_parallel": _dp_section(dp), "compute_winner": _entry(compute_winner)}
    return {
        "schema": SCHEMA,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": {"name": workload.name, "settings": workload.settings, "description": workload.description},
        "environment": {"hardware": info.to_dict(), "matmul_peak_flops": peaks, "memory_bandwidth_bytes_per_s": bandwidth},
        "settings": {"budget_s": settings.budget_s, "max_memory_bytes": settings.max_memory, "steps": sum(steps_per_round),
                     "rounds": len(steps_per_round), "steps_per_round": steps_per_round, "warmup": settings.warmup,
                     "seed": settings.seed, "val_batches": settings.val_batches, "world_size": settings.world_size,
                     "link": settings.link, "fit_json": settings.fit_json},
        "facts": facts.to_dict(),
        "space": {"axes": axes, "size": len(candidates), "counts": dict(Counter(c.status for c in candidates))},
        "pruned_axes": pruned_axes(candidates + (dp.candidates if dp is not None else [])),
        "models": {"memory": MEMORY_MODEL, "ordering": ORDERING_MODEL},
        "loss_check": {"rule": LOSS_CHECK, "tolerance_percent": dict(LOSS_TOLERANCE)},
        "measurement": MEASUREMENT + f"; ratio_vs_baseline is taken against the baseline row, not the A/A pair "
                                     f"(tune runs none); {BOOTSTRAP_RESAMPLES} bootstrap resamples",
        "candidates": [_entry(c) for c in candidates],
        "winner": _entry(winner),
        **extra,
        "tuner_wall_seconds": wall_seconds,
    }


_STATUS_ORDER = {"measured": 0, "rejected": 1, "error": 2, "not reached": 3, "pruned": 4, "candidate": 5}


def _ran(doc: dict) -> list[dict]:
    rows = [c for c in doc["candidates"] if c["status"] in ("measured", "rejected", "error")]
    return sorted(rows, key=lambda c: (_STATUS_ORDER[c["status"]], -c["measured"].get("ratio_vs_baseline", 0)))


def _ratio(m: dict) -> str:
    if "ratio_vs_baseline" not in m:
        return "-"
    lo, hi = m["ratio_ci95"]
    return f"{m['ratio_vs_baseline']:.3f}x ({lo:.3f}-{hi:.3f})"


def _table_rows(doc: dict) -> list[list[str]]:
    out = []
    for c in _ran(doc):
        m = c["measured"]
        delta = (f"{m['loss_delta_percent']:+.3f}% (±{m['loss_tolerance_percent']:g}%)"
                 if "loss_delta_percent" in m else "-")
        out.append([c["name"] + (" (baseline)" if c["baseline"] else ""), c["status"], _ratio(m),
                    f"{m['step_seconds']:.3f}" if "step_seconds" in m else "-", str(m.get("rounds", "-")),
                    _mib(c["estimates"].get("total_bytes")), _mib(m.get("peak_memory_bytes")), delta,
                    c["reason"] or ""])
    return out


_HEAD = ["candidate", "status", "vs baseline (95% CI)", "step s", "rounds", "est. MiB", "peak MiB", "Δ val loss (tol)",
         "note"]


def _dp_ratio(m: dict) -> str:
    if "ratio_vs_reference" not in m:
        return "-"
    lo, hi = m["ratio_ci95"]
    return f"{m['ratio_vs_reference']:.3f}x ({lo:.3f}-{hi:.3f})"


def _summary_lines(doc: dict) -> list[str]:
    w = doc["winner"]
    hw = doc["environment"]["hardware"]
    counts = ", ".join(f"{n} {s}" for s, n in sorted(doc["space"]["counts"].items()))
    lines = [
        f"workload {doc['workload']['name']} {doc['workload']['settings'] or ''} on {hw['device']} "
        f"({hw['cpu_model']}; {', '.join(hw['cpu_features']) or 'no listed features'})",
        f"space {doc['space']['size']} candidates: {counts}; tuner wall time {doc['tuner_wall_seconds']:.0f} s "
        f"of a {doc['settings']['budget_s']:.0f} s budget",
    ]
    dp = doc.get("data_parallel")
    if dp is None:
        lines.append(f"winner {w['name']}: {_ratio(w['measured'])} vs the baseline")
    else:
        cw = doc["compute_winner"]
        dp_counts = ", ".join(f"{n} {s}" for s, n in sorted(dp["space"]["counts"].items()))
        lines += [f"compute recipe {cw['name']}: {_ratio(cw['measured'])} vs the baseline (one process)",
                  f"data parallel on {dp['nproc']} ranks, link {dp['link']}: {dp['space']['size']} candidates "
                  f"({dp_counts}) in {dp['rounds']} round(s); winner {w['name']}: {_dp_ratio(w['measured'])} vs "
                  f"{dp['reference']}"]
    lines.append(f"loss check: {doc['loss_check']['rule']}; tolerances {doc['loss_check']['tolerance_percent']}")
    return lines


_DP_HEAD = ["candidate", "status", "vs uncompressed (95% CI)", "step s", "steps", "wire MB/step", "× fp32 ring",
            "model s/step", "Δ val loss (tol)", "note"]


def _dp_rows(doc: dict) -> list[list[str]]:
    """The data-parallel candidates that were not pruned: measured first, by ratio."""
    dp = doc.get("data_parallel")
    if dp is None:
        return []
    rows = [c for c in dp["candidates"] if c["status"] != "pruned"]
    rows.sort(key=lambda c: (_STATUS_ORDER[c["status"]], -c["measured"].get("ratio_vs_reference", 0)))
    out = []
    for c in rows:
        m = c["measured"]
        wire = m.get("wire_bytes_per_step")
        ring = m.get("wire_vs_fp32_ring")
        delta = m.get("loss_delta_percent")
        out.append([c["name"], c["status"], _dp_ratio(m), f"{m['step_seconds']:.3f}" if "step_seconds" in m else "-",
                    str(m.get("steps", "-")), "-" if wire is None else f"{wire / 1e6:.2f}",
                    "-" if ring is None else f"{ring:.3f}", f"{c['estimates']['predicted_seconds']:.3f}",
                    "-" if delta is None else f"{delta:+.3f}% (±{m['loss_tolerance_percent']:g}%)",
                    c["reason"] or ""])
    return out


def _dp_markdown(doc: dict) -> list[str]:
    dp = doc.get("data_parallel")
    if dp is None:
        return []
    link = dp["link_model"]
    return ["", f"## Data parallel: {dp['nproc']} ranks, link {dp['link']}", "",
            f"Compute recipe {dp['compute_recipe']}; {dp['threads_per_rank']} thread(s) a rank; {dp['steps_per_job']} "
            f"timed steps a job after {dp['warmup']} untimed (compressed after {dp['comm_warmup']} of them), "
            f"{dp['rounds']} alternating round(s). Model link: {link['name']} ({link['gbps'] * link['efficiency']:.3g} "
            f"Gbit/s effective, {link['alpha_s'] * 1e6:.0f} us a hop); compute {dp['compute_s_per_rank']:.3f} s a rank "
            f"({dp['compute_from']}). Wire bytes: {dp['wire_bytes']}. Choice: {dp['choice']}.", "",
            "| " + " | ".join(_DP_HEAD) + " |", "|" + "---|" * len(_DP_HEAD)] + [
            "| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in _dp_rows(doc)]


def render_markdown(doc: dict) -> str:
    lines = ["# turbotrain tune", ""] + [f"- {s}" for s in _summary_lines(doc)] + [""]
    lines += ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in _table_rows(doc)]
    lines += _dp_markdown(doc)
    lines += ["", "## Pruned before running", "", "| axis | values | candidates | reason |", "|---|---|---|---|"]
    lines += [f"| {p['axis']} | {', '.join(p['values'])} | {p['candidates']} | {p['reason']} |"
              for p in doc["pruned_axes"]]
    missed = [c for c in doc["candidates"] if c["status"] == "not reached"]
    if missed:
        lines += ["", f"## Not reached within the budget ({len(missed)})", ""]
        lines += [f"- {c['name']}: {c['reason']}" for c in missed]
    lines += ["", "## Models", "", doc["models"]["memory"], "", doc["models"]["ordering"], ""]
    if "data_parallel" in doc:
        lines += [doc["data_parallel"]["model"], ""]
    lines += [
              "## Measurement", "", doc["measurement"], "", "## tuned.json", "", "```json",
              json.dumps(doc["winner"]["config"], indent=2), "```", ""]
    return "\n".join(lines)


def _charts(doc: dict) -> list[str]:
    """Base64 PNGs: each run candidate's ratio with its interval; predicted vs measured step time."""
    from ..profile.html import _png

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = [c for c in _ran(doc) if "ratio_vs_baseline" in c["measured"]]
    if not rows:
        return []
    charts = []
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    names = [c["name"] for c in rows][::-1]
    ratios = [c["measured"]["ratio_vs_baseline"] for c in rows][::-1]
    lo = [r - c["measured"]["ratio_ci95"][0] for r, c in zip(ratios, rows[::-1])]
    hi = [c["measured"]["ratio_ci95"][1] - r for r, c in zip(ratios, rows[::-1])]
    colours = ["#4477aa" if c["status"] == "measured" else "#ee6677" for c in rows][::-1]
    ax.barh(names, ratios, xerr=[lo, hi], color=colours, capsize=3)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("throughput vs the baseline (95% bootstrap interval); red: rejected")
    charts.append(_png(fig))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in rows:
        ax.scatter(c["estimates"]["predicted_seconds"], c["measured"]["step_seconds"],
                   color="#4477aa" if c["status"] == "measured" else "#ee6677")
    ax.set_xlabel("ordering model, s/step (not a prediction of speed)")
    ax.set_ylabel("measured s/step (median)")
    charts.append(_png(fig))
    plt.close(fig)
    return charts


def render_html(doc: dict, charts: list[str] | None, missing: str | None = None) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in _HEAD)
    body = "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in _table_rows(doc))
    pruned = "".join(f"<tr><td>{esc(str(p['axis']))}</td><td>{esc(', '.join(p['values']))}</td>"
                     f"<td>{p['candidates']}</td><td>{esc(p['reason'])}</td></tr>" for p in doc["pruned_axes"])
    images = "".join(f'<img alt="chart" src="data:image/png;base64,{png}">' for png in charts or [])
    if missing:
        images = f"<p><em>{esc(missing)}</em></p>"
    summary = "".join(f"<li>{esc(s)}</li>" for s in _summary_lines(doc))
    dp_table = ""
    if "data_parallel" in doc:
        dp = doc["data_parallel"]
        dp_head = "".join(f"<th>{esc(h)}</th>" for h in _DP_HEAD)
        dp_body = "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in _dp_rows(doc))
        dp_table = (f"<h2>Data parallel: {dp['nproc']} ranks, link {esc(str(dp['link']))}</h2>"
                    f"<p>{esc(dp['choice'])}</p><table><tr>{dp_head}</tr>{dp_body}</table>"
                    f"<p>{esc(dp['model'])}</p>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>turbotrain tune</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}</style></head><body>"
            f"<h1>turbotrain tune</h1><ul>{summary}</ul>{images}"
            f"<h2>Candidates run</h2><table><tr>{head}</tr>{body}</table>{dp_table}"
            f"<h2>Pruned before running</h2><table><tr><th>axis</th><th>values</th><th>candidates</th>"
            f"<th>reason</th></tr>{pruned}</table>"
            f"<h2>Models</h2><p>{esc(doc['models']['memory'])}</p><p>{esc(doc['models']['ordering'])}</p>"
            f"<h2>Measurement</h2><p>{esc(doc['measurement'])}</p>"
            f"<h2>tuned.json</h2><pre>{esc(json.dumps(doc['winner']['config'], indent=2))}</pre></body></html>")


def write_reports(doc: dict, winner: Candidate, out_dir: Path) -> list[Path]:
    """Write the four files into ``out_dir``; without matplotlib the HTML has no plots, and a
    warning says so once."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in ("tuned.json", "tune.json", "tune.md", "tune.html")}
    atomic_write(paths["tuned.json"], json.dumps(winner.config().to_dict(), indent=2) + "\n")
    atomic_write(paths["tune.json"], json.dumps(doc, indent=1, default=str) + "\n")
    atomic_write(paths["tune.md"], render_markdown(doc))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        missing = "matplotlib is not installed, so this page has no plots: pip install 'turbotrain[bench]'"
        logger.warning("%s", missing)
        atomic_write(paths["tune.html"], render_html(doc, None, missing))
    else:
        atomic_write(paths["tune.html"], render_html(doc, _charts(doc)))
    return list(paths.values())

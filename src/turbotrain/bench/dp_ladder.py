"""The data-parallel benchmark ladder: what each way of exchanging gradients costs, and what it loses.

    turbotrain bench --nproc 2 [--link 1gbit] [--quick] [--configs ddp,fsdp,tp+sp] [--max-state-bytes 30M]
    >>> from turbotrain.bench.dp_ladder import DP_ROWS
    >>> list(DP_ROWS)
    ['ddp', 'ddp+accumulate4', 'ddp+bf16', 'ddp+powersgd', 'ddp+onebit', 'fsdp', 'fsdp+ckpt', 'tp', 'tp+sp']

Every row is one torchrun job (gloo, 127.0.0.1, one torch/OMP thread per rank) that trains the
same workload through ``Engine(Config(data_parallel=...))``, and is paired with a *local* job: the
same Engine on the same per-rank batches with no data parallelism, two processes side by side so
they share the CPU exactly as the dp ranks do. So

    comm overhead = (t_dp - t_local) / t_dp

is everything data parallelism adds to a step: the exchange, waiting for the slower rank, and the
compression arithmetic (PowerSGD's matmuls, 1-bit packing), which is not free either. Local jobs
are keyed by the work they do (precision, accumulate): ddp, ddp+bf16, ddp+powersgd and ddp+onebit
do identical local work, so they share one local measurement, which saves three jobs per link.

Choices, and why:

* **Precision 'auto'** for every row, resolved once: bf16-master where bf16 matmul is native (then
  gradients are already bf16, plain ``ddp`` sends 2 bytes per parameter and ``ddp+bf16`` is a
  control row that only adds a cast), fp32 where it is emulated (an AVX2-only CPU: there bf16
  compute runs tens of times slower than fp32, and ``ddp+bf16`` halves the fp32 wire). Either way
  communication is measured against the compute a user would really run; ``precision=`` overrides.
* **The default gpt** (d=512, 4 layers, T=256, B=8 per rank: 21M parameters, 42 MB of bf16
  gradient per exchange). On a 1 Gbit/s link a two-rank ring all-reduce moves 2 x 42 MB through
  the one shaped loopback, >= 0.68 s, against ~1.6 s of compute per step at one thread: comm-bound
  enough to be interesting. The ratio of gradient bytes to compute hardly depends on width (both
  scale with the parameters), only on tokens per step, so a smaller model would not be more
  honest, just faster.
* **6 measured + 8 untimed steps** per job, every row the same 14 optimizer steps so the val
  losses compare after the same steps. PowerSGD and 1-bit Adam start compressing at step 7
  (DataParallelConfig.warmup_steps = warmup - 1), so the last untimed step absorbs their
  first-compression set-up and every timed step is compressed. Why 8 and not 3: 1-bit Adam freezes
  Adam's variance when compression starts, and frozen after 2 steps it is too noisy: the quick gpt
  at bf16-master went 8.9 -> 333 -> NaN within three compressed steps; after 8 it trains. At ~1.6 s
  a step on the shared 2-core box and ~12 s of torchrun start-up per job, the 7 jobs (5 dp,
  2 local; the two accumulate jobs do 4 micro-batches a step) take ~6 minutes per link.
  14 steps is a short run: the val-loss deltas say whether compression hurts early training, not
  whether it converges to the same place.
* ``quick=True``: the bench's quick gpt (d=128, 2 layers, T=64, B=4), 3 + 8 steps, 2 val batches:
  start-up dominates, ~90 s for the whole ladder; a smoke test, not a benchmark.
* **Sharded rows** (``fsdp``, ``fsdp+ckpt``, ``tp``, ``tp+sp``; by name only, not in the default
  ladder) train through ``Engine(Config(parallel=ParallelConfig(...)))`` instead of DDP: FSDP2 over every rank
  (``dp_shard=-1``, 2 on two ranks), the same with activation checkpointing, tensor parallel over
  2 ranks (``tp=2``: ``dp_shard=1`` on two ranks; FSDP over the rest on more) and the same with
  sequence parallel. Their memory is the point: every row reports each rank's peak of parameters
  + gradients + optimizer state (their local shards' bytes, turbotrain.bench.dp_worker) and the
  process's resident high-water mark beside it, and ``state_bytes_vs_ddp`` against the baseline.
  The two tensor-parallel ranks share their rows, so a tp step trains on half the tokens of a ddp
  step (throughput counts that), and its local comparison is the local step divided by tp (a
  perfect split of the compute): its ``comm_overhead`` is then the exchange *and* the work tensor
  parallel repeats on every rank (the cross-entropy over the gathered logits, the embedding).
  ``step_time_vs_ddp`` is the row's step time over ddp's. FSDP's and DTensor's collectives are not
  counted (``collectives/step`` shows —), only DDP's hook is.
* ``max_state_bytes`` caps those bytes, enforced in every dp job (not assumed from the sizes): a row
  whose largest rank goes over stops with StateCapExceeded before its next forward and is reported
  as an error. ``turbotrain bench --nproc 2 --configs ddp,fsdp --max-state-bytes N`` with N between
  FSDP's and DDP's figure shows a model that does not fit a rank under DDP training under FSDP2.
  Local jobs are never capped (they are the timing reference, unsharded by definition).
* ``link='1gbit'`` runs each job inside ``shape-link.sh`` (shipped in turbotrain/bench/data: a private network namespace
  whose loopback is tc-shaped). Both directions share the one shaped egress, like a half-duplex
  link. Without root, ``ip`` or ``tc`` it raises HardwareError rather than measure unshaped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch

from ..comm.launch import torchrun_command
from ..errors import ConfigError, HardwareError, check_choice, check_positive
from ..utils import atomic_write, check_output_dir
from .console import escape, make_console
from .dp_worker import LadderSpec

__all__ = [
    "DP_ROWS", "DpRow", "BASELINE_ROW", "DEFAULT_STEPS", "DEFAULT_WARMUP", "QUICK_STEPS", "QUICK_WARMUP",
    "run_dp_ladder", "comm_overhead", "parse_rate", "link_floor_seconds", "check_link",
    "row_metrics", "shape_link_script", "DEFAULT_PRECISION", "local_key", "DEFAULT_CONFIGS",
]

SCHEMA = "turbotrain-dp-bench/1"
DEFAULT_STEPS, DEFAULT_WARMUP = 6, 8
QUICK_STEPS, QUICK_WARMUP = 3, 8
#: 'auto' is resolved once by the ladder (bf16-master where bf16 matmul is native, fp32 elsewhere) and
#: the concrete mode is what every job runs and the header records.
DEFAULT_PRECISION = "auto"


@dataclass(frozen=True)
class DpRow:
    """One ladder row: the DataParallelConfig compression (or the ParallelConfig) it trains with."""

    compression: str | None
    accumulate: int
    description: str
    parallel: dict | None = None
    """ParallelConfig fields: train through Config(parallel=...) instead of DDP."""
    checkpoint: str | None = None
    """Config.checkpoint of the row (and of its local job)."""

    @property
    def tp(self) -> int:
        return (self.parallel or {}).get("tp", 1)


DP_ROWS = {
    "ddp": DpRow(None, 1, "plain DDP all-reduce in the gradients' dtype"),
    "ddp+accumulate4": DpRow(None, 4, "4 micro-batches per optimizer step, one exchange per step"),
    "ddp+bf16": DpRow("bf16", 1, "gradients cast to bf16 on the wire"),
    "ddp+powersgd": DpRow("powersgd", 1, "rank-4 PowerSGD with error feedback"),
    "ddp+onebit": DpRow("onebit", 1, "1-bit Adam: sign-compressed momentum after warm-up"),
    "fsdp": DpRow(None, 1, "FSDP2 (ZeRO-3): parameters, gradients and Adam state sharded over every rank",
                  parallel={"dp_shard": -1}),
    "fsdp+ckpt": DpRow(None, 1, "FSDP2 with activation checkpointing of every block",
                       parallel={"dp_shard": -1}, checkpoint="blocks"),
    "tp": DpRow(None, 1, "tensor parallel over 2 ranks (the rows shared by the pair)",
                parallel={"dp_shard": -1, "tp": 2}),
    "tp+sp": DpRow(None, 1, "tensor + sequence parallel over 2 ranks (norms and residual split along T)",
                   parallel={"dp_shard": -1, "tp": 2, "sequence_parallel": True}),
}
#: The row val-loss deltas are relative to: uncompressed, no accumulation.
BASELINE_ROW = "ddp"
#: What ``configs=None`` runs: the ways of exchanging DDP's gradients (the sharded rows are asked for by
#: name, so the default ladder stays the one the dated benchmarks/dp entries were made with).
DEFAULT_CONFIGS = tuple(name for name, row in DP_ROWS.items() if row.parallel is None)


def comm_overhead(t_dp: float, t_local: float) -> float:
    """Fraction of a data-parallel step spent on what data parallelism adds: (t_dp - t_local) / t_dp.

    >>> comm_overhead(2.0, 1.5)
    0.25
    """
    check_positive("data-parallel step time", t_dp)
    return (t_dp - t_local) / t_dp


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
_RATE_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}  # tc's units are decimal


def parse_rate(rate: str) -> float:
    """A tc rate ('1gbit', '500mbit', '100mbps' = bytes) in bits per second."""
    match = _RATE.match(rate.strip().lower())
    if not match:
        raise ConfigError(f"link rate {rate!r} is not a tc rate; write e.g. 1gbit, 500mbit or 100mbps (bytes/s)")
    value, unit = float(match.group(1)), match.group(2)
    bits = value * _RATE_SCALE[unit[0] if unit[0] in "kmgt" else ""]
    return bits * 8 if unit.endswith("bps") else bits


def link_floor_seconds(wire_bytes: float, world: int, rate: str) -> float:
    """Least time a bandwidth-optimal all-reduce of ``wire_bytes`` takes when every rank shares one link.

    Each rank sends 2(n-1)/n of the buffer; on one shaped loopback all n ranks' traffic crosses
    the same egress, so the link carries 2(n-1) buffers' worth.
    """
    return 2 * (world - 1) * wire_bytes * 8 / parse_rate(rate)


def shape_link_script() -> Path:
    """The path of ``shape-link.sh``, installed with the package as data."""
    path = Path(str(resources.files("turbotrain.bench") / "data" / "shape-link.sh"))
    if not path.is_file():  # e.g. a zipped install, where package data is no file bash can run
        raise HardwareError(f"link shaping needs {path}, which this installation lacks; reinstall turbotrain "
                            "from a wheel or a source checkout, or drop --link to measure on plain loopback")
    return path


def check_link(rate: str) -> None:
    """HardwareError naming the fix unless ``shape-link.sh --rate RATE`` can run here."""
    parse_rate(rate)
    script = shape_link_script()
    if os.geteuid() != 0:
        raise HardwareError("--link needs root to create a network namespace (ip netns) and shape its loopback "
                            "(tc); run as root (sudo), or drop --link to measure on plain loopback")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise HardwareError(f"--link needs {' and '.join(missing)}; install iproute2 (apt-get install iproute2) "
                            "or drop --link")
    probe = subprocess.run(["bash", str(script), "--rate", rate, "--", "true"], capture_output=True,
                           text=True, timeout=60)
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise HardwareError(f"could not create a shaped network namespace ({tail}); this container may forbid "
                            "network namespaces (needs CAP_NET_ADMIN); drop --link to measure on plain loopback")


def _job_env(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # one core per rank: the intra-op pool would otherwise oversubscribe the two cores
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), GLOO_SOCKET_IFNAME="lo")
    return env


def _run_job(spec: LadderSpec, nproc: int, link: str | None, workdir: Path, timeout: float) -> dict:
    """One torchrun job (inside the shaped namespace when ``link``); a result dict whatever happens."""
    name = spec.row.replace("+", "_")
    spec_path, result_path, log_path = (workdir / f"{name}.{k}" for k in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps(asdict(spec)))
    # one node: the rendezvous store listens on 127.0.0.1 only, on a port it picked itself
    cmd = torchrun_command(nproc, "turbotrain.bench.dp_worker", [str(spec_path), str(result_path)], module=True)
    if link:
        cmd = ["bash", str(shape_link_script()), "--rate", link, "--", *cmd]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        # own session, so a timeout ends torchrun, its ranks and the namespace wrapper together
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_job_env(spec.threads),
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            reason = f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # TERM first: shape-link.sh's trap deletes the namespace
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            reason = f"timed out after {timeout:.0f} s (raise --timeout)"
    wall = time.perf_counter() - t0
    if result_path.exists():
        return {**json.loads(result_path.read_text()), "job_seconds": wall}
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    error = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "no output")
    return {"status": "error", "error": f"job died ({reason}): {error.strip()}", "job_seconds": wall}


# --------------------------------------------------------------------------------------- results
def _summary(values: list[float]) -> dict:
    from .stats import summarize

    return summarize(values).to_dict()


def _metric(unit: str, median, p20=None, p80=None) -> dict:
    return {"unit": unit, "median": median, "p20": p20, "p80": p80}


def row_metrics(dp: dict, local: dict | None, baseline: dict | None, *, tp: int = 1) -> dict[str, dict]:
    """Every metric of one row from its dp result, its local result and the baseline row's dp result.

    ``tp``: the row's tensor-parallel degree; its local step is compared as split over that many ranks.
    """
    from .stats import relative_change, throughput

    t = _summary(dp["step_seconds"])
    items, unit = dp["items_per_step"], dp["unit"]
    steps = len(dp["step_seconds"])
    out = {
        "step_time": _metric("s", t["median"], t["p20"], t["p80"]),
        # a rate's p20 comes from the time's p80
        "throughput": _metric(f"{unit}/s", throughput(items, t["median"]), throughput(items, t["p80"]),
                              throughput(items, t["p20"])),
        "val_loss": _metric("nats", dp["val_loss"]),
    }
    if dp.get("exchange_rounds") is not None:  # sharded rows: their collectives are not counted
        out["exchange_rounds_per_step"] = _metric("collectives/optimizer step", dp["exchange_rounds"] / steps)
        out["collective_calls_per_step"] = _metric("calls/optimizer step", dp["collective_calls"] / steps)
    if dp.get("state_bytes_peak") is not None:  # parameters + gradients + optimizer state, and the whole process
        out["state_bytes_peak"] = _metric("bytes, largest rank", dp["state_bytes_peak"])
        out["rss_peak"] = _metric("bytes, largest rank", dp["rss_peak_bytes"])
    if local is not None and local.get("status") == "ok":
        lt = _summary(local["step_seconds"])
        out["local_step_time"] = _metric("s", lt["median"], lt["p20"], lt["p80"])
        out["comm_overhead"] = _metric("fraction of dp step", comm_overhead(t["median"], lt["median"] / tp))
    if baseline is not None and baseline.get("status") == "ok":
        if None not in (dp["val_loss"], baseline["val_loss"]):
            out["val_loss_delta"] = _metric("%", relative_change(dp["val_loss"], baseline["val_loss"]))
        base_t = _summary(baseline["step_seconds"])["median"]
        out["step_time_vs_ddp"] = _metric(f"x {BASELINE_ROW}", t["median"] / base_t)
        if dp.get("state_bytes_peak") and baseline.get("state_bytes_peak"):
            ratio = dp["state_bytes_peak"] / baseline["state_bytes_peak"]
            out["state_bytes_vs_ddp"] = _metric(f"x {BASELINE_ROW}", ratio)
    return out


def local_key(row: DpRow) -> str:
    """Local jobs are named by the only work they vary in (precision is the same in every row).

    >>> local_key(DP_ROWS["ddp+accumulate4"]), local_key(DP_ROWS["fsdp+ckpt"]), local_key(DP_ROWS["tp+sp"])
    ('local+accumulate4', 'local+ckpt', 'local')
    """
    key = "local" if row.accumulate == 1 else f"local+accumulate{row.accumulate}"
    return key + ("+ckpt" if row.checkpoint else "")


def _local_settings(key: str) -> dict:
    """The LadderSpec fields a local job's key stands for (the inverse of local_key)."""
    match = re.fullmatch(r"local(?:\+accumulate(\d+))?(\+ckpt)?", key)
    return {"accumulate": int(match.group(1) or 1), "checkpoint": "blocks" if match.group(2) else None}


def _job_order(names: list[str]) -> list[tuple[str, str]]:
    """(kind, name) jobs: each local job just before the first dp row that needs it."""
    jobs, seen = [], set()
    for name in names:
        key = local_key(DP_ROWS[name])
        if key not in seen:
            seen.add(key)
            jobs.append(("local", key))
        jobs.append(("dp", name))
    return jobs


def _print_table(console, doc: dict) -> None:
    from rich.table import Table

    link = doc["header"]["link"]
    table = Table(title=f"data-parallel ladder: {doc['header']['workload']['name']}, "
                        f"{doc['header']['nproc']} ranks, link {link}")
    for col in ("config", "step ms (p20-p80)", "local step ms", "comm overhead", "tokens/s", "val loss",
                "Δval vs ddp", "collectives/step", "state MiB/rank", "× ddp", "peak RSS MiB"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for name, row in doc["configs"].items():
        m = row.get("metrics")
        if m is None:
            table.add_row(name, f"[red]error[/]: {escape(str(row.get('error', '?')))}", *[""] * 9)
            continue

        def get(metric, pattern, scale=1.0):
            value = m.get(metric, {}).get("median")
            return "—" if value is None else pattern.format(value * scale)

        st = m["step_time"]
        table.add_row(
            name, f"{st['median'] * 1e3:.0f} ({st['p20'] * 1e3:.0f}-{st['p80'] * 1e3:.0f})",
            get("local_step_time", "{:.0f}", 1e3), get("comm_overhead", "{:.1%}"),
            get("throughput", "{:,.0f}"), get("val_loss", "{:.4f}"), get("val_loss_delta", "{:+.2f}%"),
            get("exchange_rounds_per_step", "{:g}"), get("state_bytes_peak", "{:.2f}", 2**-20),
            get("state_bytes_vs_ddp", "{:.2f}"), get("rss_peak", "{:.0f}", 2**-20))
    console.print(table)


def _target_note(doc: dict) -> str:
    """Which rows meet issue 5's bar (overhead <= 15%, |Δval| <= 2% vs uncompressed)."""
    met, missed = [], []
    for name, row in doc["configs"].items():
        m = row.get("metrics", {})
        if "comm_overhead" not in m or "val_loss_delta" not in m or name == BASELINE_ROW or DP_ROWS[name].parallel:
            continue  # the bar is for the ways of exchanging DDP's gradients; sharded rows trade memory
        ok = m["comm_overhead"]["median"] <= 0.15 and abs(m["val_loss_delta"]["median"]) <= 2.0
        (met if ok else missed).append(name)
    return (f"target (comm overhead <= 15% and |Δval| <= 2% vs {BASELINE_ROW}) on link {doc['header']['link']}: "
            f"met by {', '.join(met) or 'none'}; missed by {', '.join(missed) or 'none'}")


def _header(workload: str, overrides: dict, names, nproc, steps, warmup, precision, link, quick, seed, val_batches,
            max_state_bytes=None):
    from ..hardware import detect
    from ..workloads import get_workload

    wl = get_workload(workload, **overrides)
    hw = detect("cpu").to_dict()
    hw["torch_threads"] = 1  # what every rank runs with, not this parent process
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": {"name": wl.name, "unit": wl.unit, "items_per_batch": wl.items_per_batch,
                     "settings": wl.settings, "overrides": overrides},
        "configs": list(names), "nproc": nproc, "backend": "gloo", "threads_per_rank": 1,
        "steps": steps, "warmup": warmup, "comm_warmup": warmup - 1, "seed": seed, "val_batches": val_batches,
        "precision": precision, "link": link or "loopback", "quick": quick, "hardware": hw,
        "versions": hw["versions"], "baseline": BASELINE_ROW,
        "step_time": "per optimizer step (all its micro-batches), slowest rank per step, warm-up excluded",
        "comm_overhead": "(median dp step - median local step / tp) / median dp step; local = same Engine, "
                         "same per-rank batches, no data_parallel, ranks side by side; tp = 1 but in "
                         "tensor-parallel rows",
        "state_bytes": "per rank, peak over the optimizer steps of the parameters + gradients + optimizer "
                       "state it holds (local shards, each storage once; read before and after every "
                       "optimizer step); rss_peak: the process's ru_maxrss; both the largest rank's",
        "max_state_bytes": max_state_bytes,
        "notes": [],
    }


def run_dp_ladder(workload: str = "gpt", nproc: int = 2, steps: int | None = None, configs=None,
                  link: str | None = None, out_dir: str | Path = "bench-out", quick: bool = False,
                  overrides: dict | None = None, *, warmup: int | None = None, precision: str = DEFAULT_PRECISION,
                  seed: int = 0, timeout: float = 900.0, max_state_bytes: int | None = None, console=None) -> dict:
    """Run the ladder, print the environment line and table, write ``out_dir/dp_results.json``; returns it.

    ``max_state_bytes``: every dp job stops when a rank's parameters + gradients + optimizer state
    pass it (see the module docstring); None, no cap.
    """
    from ..precision.config import PRECISIONS
    from .runner import QUICK_OVERRIDES

    out = check_output_dir(out_dir)
    console = make_console(console)
    names = list(dict.fromkeys(configs or DEFAULT_CONFIGS))
    for name in names:
        check_choice("dp ladder config", name, tuple(DP_ROWS))
    check_choice("precision", precision, PRECISIONS)
    if nproc < 2:
        raise ConfigError(f"nproc={nproc}: a data-parallel ladder needs at least 2 ranks (--nproc 2)")
    for name in names:
        if nproc % DP_ROWS[name].tp:
            raise ConfigError(f"{name} runs tensor parallel over {DP_ROWS[name].tp} ranks, which does not divide "
                              f"--nproc {nproc}; use an even --nproc or leave {name} out")
    if max_state_bytes is not None:
        check_positive("max_state_bytes", max_state_bytes)
    steps = steps or (QUICK_STEPS if quick else DEFAULT_STEPS)
    warmup = warmup if warmup is not None else (QUICK_WARMUP if quick else DEFAULT_WARMUP)
    if warmup < 2:
        raise ConfigError(f"warmup={warmup} must be >= 2: compression starts at step warmup-1, untimed")
    if link:
        check_link(link)
    precision_note = None
    if precision == "auto":
        from ..precision.policy import resolve_precision

        precision, reason = resolve_precision("auto", torch.device("cpu"))
        precision_note = f"precision 'auto' chose {precision!r}: {reason}"
    overrides = {**(QUICK_OVERRIDES.get(workload, {}) if quick else {}), **(overrides or {})}
    val_batches = 2 if quick else 4
    doc_header = _header(workload, overrides, names, nproc, steps, warmup, precision, link, quick, seed, val_batches,
                         max_state_bytes)
    hw = doc_header["hardware"]
    console.print(f"[bold]environment[/] cpu {hw['cpu_model']} ({hw['cpu_count']} logical CPUs), {nproc} ranks x 1 "
                  f"thread, gloo on {'loopback shaped to ' + link if link else 'plain loopback'}; "
                  + ", ".join(f"{k} {v}" for k, v in hw["versions"].items() if v))
    console.print(f"[bold]workload[/] {workload} {doc_header['workload']['settings']}, precision {precision}, "
                  f"{steps} measured + {warmup} warm-up steps")
    if quick:
        doc_header["notes"].append("quick mode: tiny model, few steps; a smoke test, not a benchmark")
    if precision_note:
        doc_header["notes"].append(precision_note)
        console.print(f"[yellow]note[/] {escape(precision_note)}")

    common = dict(workload=workload, overrides=overrides, precision=precision, steps=steps, warmup=warmup,
                  comm_warmup=warmup - 1, seed=seed, val_batches=val_batches, threads=1)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="turbotrain-dp-") as tmp:
        for kind, name in _job_order(names):
            if kind == "local":
                spec = LadderSpec(row=name, mode="local", **_local_settings(name), **common)
            else:
                row = DP_ROWS[name]
                spec = LadderSpec(row=name, mode="dp", compression=row.compression, accumulate=row.accumulate,
                                  parallel=row.parallel, checkpoint=row.checkpoint, max_state_bytes=max_state_bytes,
                                  **common)
            with console.status(f"{kind} job {name} ..."):
                results[name] = _run_job(spec, nproc, link, Path(tmp), timeout)
            r = results[name]
            state = f"{_summary(r['step_seconds'])['median'] * 1e3:.0f} ms/step" if r["status"] == "ok" else r["error"]
            console.print(f"  {kind:5} {name:<20} {escape(str(state))}  [dim]({r['job_seconds']:.0f} s)[/]")
    doc = _build_doc(doc_header, names, results)
    # the results first: whatever the terminal does with the table, the measurements are kept
    out.mkdir(parents=True, exist_ok=True)
    path = out / "dp_results.json"
    atomic_write(path, json.dumps(doc, indent=1))
    _print_table(console, doc)
    for note in doc_header["notes"]:
        console.print(f"[yellow]note[/] {escape(note)}")
    console.print(f"wrote {escape(path)}")
    return doc


def _build_doc(header: dict, names: list[str], results: dict) -> dict:
    baseline = results.get(BASELINE_ROW)
    common = {"workload": header["workload"]["name"], "device": "cpu", "versions": header["versions"],
              "timestamp": header["timestamp"], "link": header["link"]}
    rows, configs = [], {}
    for name in names:
        dp = results[name]
        row = DP_ROWS[name]
        key = local_key(row)
        local = results.get(key)
        detail = {"description": row.description, "local_job": key, "parallel": row.parallel,
                  "checkpoint": row.checkpoint, "local_divisor": row.tp, **dp, "local": local}
        if dp.get("status") == "ok":
            if dp.get("diverged"):
                header["notes"].append(f"{name}: training diverged (non-finite loss or weights)")
            elif dp.get("replicas_in_sync") is False:
                header["notes"].append(f"{name}: the ranks' weights differ after training (replicas out of sync)")
            if local is not None and local.get("status") != "ok":
                header["notes"].append(f"{name}: its local job failed ({local.get('error')}), so no overhead")
            detail["metrics"] = row_metrics(dp, local, baseline, tp=row.tp)
            rows += [{**common, "config": name, "metric": metric, **value}
                     for metric, value in detail["metrics"].items()]
        configs[name] = detail
    if header["link"] != "loopback" and baseline is not None and baseline.get("status") == "ok":
        floor = link_floor_seconds(baseline["gradient_bytes"], baseline["world_size"], header["link"])
        header["link_floor_seconds"] = floor
        header["notes"].append(
            f"an uncompressed exchange of {baseline['gradient_bytes'] / 1e6:.1f} MB takes >= {floor * 1e3:.0f} ms on "
            f"{header['link']} (2(n-1) buffers through one shaped loopback)")
    doc = {"schema": SCHEMA, "header": header, "rows": rows, "configs": configs}
    header["notes"].append(_target_note(doc))
    if header.get("max_state_bytes") is not None:
        header["notes"].append(_cap_note(doc))
    return doc


def _cap_note(doc: dict) -> str:
    """Which rows trained under the state cap and which it stopped."""
    cap = doc["header"]["max_state_bytes"]
    under = [f"{n} ({c['state_bytes_peak'] / 2**20:.2f} MiB)" for n, c in doc["configs"].items()
             if c.get("status") == "ok"]
    over = [n for n, c in doc["configs"].items() if "StateCapExceeded" in str(c.get("error", ""))]
    return (f"state cap {cap / 2**20:.2f} MiB per rank (parameters + gradients + optimizer state, enforced): "
            f"trained under it: {', '.join(under) or 'none'}; stopped by it: {', '.join(over) or 'none'}")

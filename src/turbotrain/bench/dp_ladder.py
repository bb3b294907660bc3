"""The data-parallel benchmark ladder: what each way of exchanging gradients costs, and what it loses.

    turbotrain bench --nproc 2 [--link 1gbit] [--quick] [--configs ddp,fsdp,tp+sp] [--steps 30 --rounds 2]
                     [--max-state-bytes 30M]
    >>> from turbotrain.bench.dp_ladder import DP_ROWS
    >>> list(DP_ROWS)  # doctest: +NORMALIZE_WHITESPACE
    ['ddp', 'ddp+accumulate4', 'ddp+bf16', 'ddp+powersgd', 'ddp+onebit', 'ddp+ps', 'ddp+sparse', 'ddp+hybrid',
     'fsdp', 'fsdp+ckpt', 'tp', 'tp+sp']

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
* **30 measured steps a row, in 2 rounds of alternating order.** Every job is run ``rounds`` times
  (default 2): round 0 runs the jobs in ladder order, round 1 in reverse, and so on, so a slow
  stretch of the machine lands on rows at both ends of the ladder rather than on whichever ran
  then. Each run trains the same 8 untimed + 15 timed optimizer steps from the same seed (so the
  val losses compare after the same steps, and repeat exactly), and a row's figures pool its
  rounds' timed steps: the median, its p20-p80 band, and 95% bootstrap intervals of its step time
  over ddp's and of its comm overhead (``bench.stats.bootstrap_ratio_ci``, step ``i`` of one row
  paired with step ``i`` of the other within a round). The raw per-step times of every round are
  in the JSON. PowerSGD and 1-bit Adam start compressing at step 7
  (DataParallelConfig.warmup_steps = warmup - 1), so the last untimed step absorbs their
  first-compression set-up and every timed step is compressed. Why 8 and not 3: 1-bit Adam freezes
  Adam's variance when compression starts, and frozen after 2 steps it is too noisy: the quick gpt
  at bf16-master went 8.9 -> 333 -> NaN within three compressed steps; after 8 it trains. 8 of 23
  steps (35%) is also within the 1-bit Adam paper's practice of an uncompressed stretch of about
  15-25% of training. 23 steps is a short run: the val-loss deltas say whether compression hurts
  early training, not whether it converges to the same place (the 300-step slow test does that).
* **Bytes on the wire, every row.** Where network namespaces can be made (root, ``ip``), every job
  runs in a private one (``shape-link.sh``, unshaped for plain loopback), and the worker reads its
  loopback's transmit counter around the timed steps: the job's whole traffic, whatever protocol
  sent it (DDP hooks, 1-bit Adam, FSDP2, DTensor). Reported per optimizer step, as a fraction of
  what a ring all-reduce of FP32 gradients moves (2(n-1) x 4 bytes a parameter), and as the
  **floor** it puts under a step on the ladder's link (1 Gbit/s on plain loopback: the time those
  bytes need at that rate, all ranks sharing the one shaped egress). Without namespaces only DDP's
  hooks can say what they sent (their payload, converted as for a ring) and the sharded rows show —.
* **Topologies.** ``ddp`` is the ring (DDP's all-reduce), ``ddp+ps`` the parameter server
  (``DataParallelConfig(strategy='parameter_server')``: each bucket reduced onto rank 0 and
  broadcast back) and ``ddp+hybrid`` the hybrid (``strategy='hybrid'``: dense gradients by DDP's
  all-reduce, ``nn.Embedding(sparse=True)`` rows through the parameter server). The hybrid differs
  from the ring only for sparse embedding gradients, so it trains the gpt with its token embedding
  ``sparse=True`` and the optimizer a user writes for one (SparseAdam for the embedding, the fused
  AdamW for the rest, ``dp_worker.SteppedTogether``), beside its twin ``ddp+sparse``: the same model,
  optimizer and precision with the embedding's touched rows all-gathered (``strategy='ring',
  sparse_embeddings=True``). Both run in fp32 with a local job of their own (``local+sparse@fp32``):
  bf16-master's FP32 masters take dense gradients only. ``ddp+hybrid``'s ``*_vs_twin`` metrics
  isolate the exchange: step time with its interval, val loss, and the relative difference of the
  sum of all parameters (the same sums, so ~0); the server path shows in ``collective_calls``
  (6 a step for the rows on one server, against the all-gather's 3). Their Δval and × ddp against
  ``ddp`` also carry SparseAdam (lazy, no weight decay on the embedding) and fp32.
* ``quick=True``: the bench's quick gpt (d=128, 2 layers, T=64, B=4), 3 + 8 steps in one round,
  2 val batches: start-up dominates, ~90 s for the whole ladder; a smoke test, not a benchmark.
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
    "row_metrics", "shape_link_script", "DEFAULT_PRECISION", "local_key", "DEFAULT_CONFIGS", "DEFAULT_ROUNDS",
    "QUICK_ROUNDS", "namespace_problem", "pool_rounds", "FLOOR_RATE", "run_job",
]

SCHEMA = "turbotrain-dp-bench/2"
#: measured steps per row (over all its rounds), untimed steps per job, rounds
DEFAULT_STEPS, DEFAULT_WARMUP, DEFAULT_ROUNDS = 30, 8, 2
QUICK_STEPS, QUICK_WARMUP, QUICK_ROUNDS = 3, 8, 1
#: the rate plain-loopback ladders state each row's wire floor at
FLOOR_RATE = "1gbit"
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
    strategy: str = "ring"
    """DataParallelConfig.strategy: DDP's all-reduce, the parameter-server exchange, or the hybrid."""
    sparse: bool = False
    """The gpt's token embedding sparse=True, stepped by SparseAdam beside AdamW (LadderSpec.sparse_embedding)."""
    precision: str | None = None
    """The row's (and its local job's) precision; None: the ladder's."""
    twin: str | None = None
    """The row that differs from this one only in the exchange; compared with it alone as well."""

    @property
    def tp(self) -> int:
        return (self.parallel or {}).get("tp", 1)


DP_ROWS = {
    "ddp": DpRow(None, 1, "plain DDP all-reduce in the gradients' dtype"),
    "ddp+accumulate4": DpRow(None, 4, "4 micro-batches per optimizer step, one exchange per step"),
    "ddp+bf16": DpRow("bf16", 1, "gradients cast to bf16 on the wire"),
    "ddp+powersgd": DpRow("powersgd", 1, "rank-4 PowerSGD with error feedback"),
    "ddp+onebit": DpRow("onebit", 1, "1-bit Adam: sign-compressed momentum after warm-up"),
    "ddp+ps": DpRow(None, 1, "parameter server: each bucket reduced onto rank 0 and broadcast back",
                    strategy="parameter_server"),
    # fp32: bf16-master's FP32 masters take dense gradients only, and SparseAdam steps sparse ones
    "ddp+sparse": DpRow(None, 1, "sparse token embedding (SparseAdam + AdamW): its touched rows all-gathered, "
                        "the rest by DDP's all-reduce", sparse=True, precision="fp32"),
    "ddp+hybrid": DpRow(None, 1, "hybrid: ddp+sparse with the embedding's touched rows through a parameter server "
                        "(rank 0)", strategy="hybrid", sparse=True, precision="fp32", twin="ddp+sparse"),
    "fsdp": DpRow(None, 1, "FSDP2 (ZeRO-3): parameters, gradients and Adam state sharded over every rank",
                  parallel={"dp_shard": -1}),
    "fsdp+ckpt": DpRow(None, 1, "FSDP2 with activation checkpointing of every block",
                       parallel={"dp_shard": -1}, checkpoint="blocks"),
    "tp": DpRow(None, 1, "tensor parallel over 2 ranks (the rows shared by the pair)",
                parallel={"dp_shard": -1, "tp": 2}),
    "tp+sp": DpRow(None, 1, "tensor + sequence parallel over 2 ranks (norms and residual split along T)",
                   parallel={"dp_shard": -1, "tp": 2, "sequence_parallel": True}),
}
#: Why the sparse-embedding rows set their own precision.
SPARSE_PRECISION_REASON = (": bf16-master's FP32 masters take dense gradients only, and SparseAdam steps sparse "
                           "ones, so the sparse rows compare with each other, not with ddp")
#: The row val-loss deltas are relative to: uncompressed, no accumulation.
BASELINE_ROW = "ddp"
#: What ``configs=None`` runs: the ways of exchanging DDP's gradients, ring, parameter server and hybrid
#: (the sharded rows are asked for by name: they answer another question, memory).
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


def namespace_problem() -> str | None:
    """Why jobs cannot run in a private network namespace here (None: they can), found by trying one."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    try:
        probe = subprocess.run(["bash", str(shape_link_script()), "--no-shape", "--", "true"], capture_output=True,
                               text=True, timeout=60)
    except (HardwareError, OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if probe.returncode != 0:
        return (probe.stderr.strip().splitlines() or ["no output"])[-1]
    return None


def _job_env(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # one core per rank: the intra-op pool would otherwise oversubscribe the two cores
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), GLOO_SOCKET_IFNAME="lo")
    return env


def _run_job(spec: LadderSpec, nproc: int, link: str | None, workdir: Path, timeout: float, tag: str = "") -> dict:
    """One torchrun job (in a namespace of its own when ``spec.count_wire``, shaped when ``link``); a
    result dict whatever happens."""
    name = spec.row.replace("+", "_").replace("/", "_") + tag  # tune's rows hold 'ckpt:blocks/2'
    spec_path, result_path, log_path = (workdir / f"{name}.{k}" for k in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps(asdict(spec)))
    # one node: the rendezvous store listens on 127.0.0.1 only, on a port it picked itself
    cmd = torchrun_command(nproc, "turbotrain.bench.dp_worker", [str(spec_path), str(result_path)], module=True)
    if link:
        cmd = ["bash", str(shape_link_script()), "--rate", link, "--", *cmd]
    elif spec.count_wire:
        cmd = ["bash", str(shape_link_script()), "--no-shape", "--", *cmd]
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


def run_job(spec: LadderSpec, nproc: int, workdir: Path, timeout: float, *, link: str | None = None,
            tag: str = "") -> dict:
    """One torchrun job of ``nproc`` ranks training ``spec``, as the ladder runs its rows (in a network
    namespace of its own when ``spec.count_wire``, its loopback shaped to ``link`` when given); the
    rank-0 result dict, or ``{"status": "error", "error": ...}`` whatever went wrong. ``turbotrain
    tune --nproc`` measures its data-parallel candidates with it."""
    return _run_job(spec, nproc, link, Path(workdir), timeout, tag=tag)


# --------------------------------------------------------------------------------------- results
def _summary(values: list[float]) -> dict:
    from .stats import summarize

    return summarize(values).to_dict()


def _metric(unit: str, median, p20=None, p80=None) -> dict:
    return {"unit": unit, "median": median, "p20": p20, "p80": p80}


def _wire_per_step(dp: dict, steps: int) -> tuple[float | None, str | None]:
    """(bytes on the wire per optimizer step, how they were counted), or (None, None)."""
    if dp.get("wire_bytes") is not None:
        return dp["wire_bytes"] / steps, "loopback counter"
    if dp.get("hook_bytes"):  # a rank's hook payload; a ring moves 2(n-1)/n of it per rank, n ranks
        n = dp["world_size"]
        return 2 * (n - 1) * dp["hook_bytes"] / steps, "DDP hook payload, as a ring"
    return None, None


def _step_ratio(times: list[float], other: list[float], name: str) -> dict:
    """Median step time over ``other``'s, with its 95% bootstrap interval (paired steps)."""
    from .stats import bootstrap_ratio_ci

    return {**_metric(f"x {name}", _summary(times)["median"] / _summary(other)["median"]),
            "ci": list(bootstrap_ratio_ci(times, other))}


def row_metrics(dp: dict, local: dict | None, baseline: dict | None, *, tp: int = 1,
                floor_rate: str = FLOOR_RATE, twin: tuple[str, dict] | None = None) -> dict[str, dict]:
    """Every metric of one row from its dp result, its local result and the baseline row's dp result.

    ``tp``: the row's tensor-parallel degree; its local step is compared as split over that many ranks,
    and its val loss with its local job's: a tensor-parallel group trains the same rows on every
    rank, so a step sees 1/tp of ddp's tokens and the local job (those rows, one process) is its twin.
    ``floor_rate``: the link rate the row's wire floor is stated at. Intervals are 95% bootstrap
    intervals over the pooled per-step times (``ci``: [low, high]). ``twin``: (name, dp result) of
    the row that differs from this one only in the exchange (DpRow.twin), compared as ``*_vs_twin``.
    """
    from .stats import bootstrap_ratio_ci, relative_change, throughput

    times = dp["step_seconds"]
    t = _summary(times)
    items, unit = dp["items_per_step"], dp["unit"]
    steps = len(times)
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
    wire, source = _wire_per_step(dp, steps)
    if wire is not None:
        n = dp["world_size"]
        out["wire_bytes_per_step"] = {**_metric("bytes/optimizer step, all ranks", wire), "source": source}
        if dp.get("parameters"):
            out["wire_vs_fp32_ring"] = _metric("x a ring all-reduce of fp32 gradients",
                                               wire / (2 * (n - 1) * 4 * dp["parameters"]))
        out["link_floor"] = _metric(f"s/optimizer step at {floor_rate}", wire * 8 / parse_rate(floor_rate))
    if dp.get("state_bytes_peak") is not None:  # parameters + gradients + optimizer state, and the whole process
        out["state_bytes_peak"] = _metric("bytes, largest rank", dp["state_bytes_peak"])
        out["rss_peak"] = _metric("bytes, largest rank", dp["rss_peak_bytes"])
    if local is not None and local.get("status") == "ok":
        lt = _summary(local["step_seconds"])
        out["local_step_time"] = _metric("s", lt["median"], lt["p20"], lt["p80"])
        # overhead = 1 - (local / tp) / dp, so its interval comes from that of local / dp
        lo, hi = bootstrap_ratio_ci(local["step_seconds"], times)
        out["comm_overhead"] = {**_metric("fraction of dp step", comm_overhead(t["median"], lt["median"] / tp)),
                                "ci": [1 - hi / tp, 1 - lo / tp]}
    loss_reference = local if tp > 1 else baseline
    if loss_reference is not None and loss_reference.get("status") == "ok" \
            and None not in (dp["val_loss"], loss_reference.get("val_loss")):
        unit = "% vs the one-process job (the same rows a step)" if tp > 1 else f"% vs {BASELINE_ROW}"
        out["val_loss_delta"] = _metric(unit, relative_change(dp["val_loss"], loss_reference["val_loss"]))
    if baseline is not None and baseline.get("status") == "ok":
        out["step_time_vs_ddp"] = _step_ratio(times, baseline["step_seconds"], BASELINE_ROW)
        if dp.get("state_bytes_peak") and baseline.get("state_bytes_peak"):
            ratio = dp["state_bytes_peak"] / baseline["state_bytes_peak"]
            out["state_bytes_vs_ddp"] = _metric(f"x {BASELINE_ROW}", ratio)
    if twin is not None and twin[1].get("status") == "ok":
        name, other = twin
        out["step_time_vs_twin"] = _step_ratio(times, other["step_seconds"], name)
        if None not in (dp["val_loss"], other["val_loss"]):
            out["val_loss_delta_vs_twin"] = _metric(f"% vs {name}", relative_change(dp["val_loss"], other["val_loss"]))
        if None not in (dp.get("params_checksum"), other.get("params_checksum")):
            out["params_checksum_vs_twin"] = _metric(
                f"relative difference of the sum of all parameters from {name}'s",
                (dp["params_checksum"] - other["params_checksum"]) / abs(other["params_checksum"]))
    return out


_SUMMED = ("exchange_rounds", "collective_calls", "aux_collectives", "hook_bytes", "wire_bytes", "job_seconds")


def pool_rounds(runs: list[dict]) -> dict:
    """One row's result from its rounds' job results: timed steps pooled, counters summed, rounds kept.

    A failed round fails the row (its error is the first failure's).

    >>> r = {"status": "ok", "step_seconds": [1.0, 2.0], "val_loss": 3.0, "wire_bytes": 10, "job_seconds": 5.0}
    >>> pooled = pool_rounds([r, {**r, "step_seconds": [4.0, 5.0]}])
    >>> pooled["step_seconds"], pooled["wire_bytes"], pooled["rounds"]
    ([1.0, 2.0, 4.0, 5.0], 20, 2)
    """
    failed = [r for r in runs if r.get("status") != "ok"]
    per_round = [{k: r.get(k) for k in ("step_seconds", "warmup_step_seconds", "val_loss", "wire_bytes",
                                        "hook_bytes", "job_seconds", "status", "error")} for r in runs]
    if failed:
        return {**failed[0], "rounds": len(runs), "per_round": per_round}
    pooled = {**runs[0], "rounds": len(runs), "per_round": per_round,
              "step_seconds": [x for r in runs for x in r["step_seconds"]],
              "warmup_step_seconds": [r.get("warmup_step_seconds") for r in runs],
              "diverged": any(r.get("diverged") for r in runs),
              "replicas_in_sync": None if any(r.get("replicas_in_sync") is None for r in runs)
              else all(r["replicas_in_sync"] for r in runs)}
    for key in _SUMMED:
        values = [r.get(key) for r in runs]
        pooled[key] = None if any(v is None for v in values) else sum(values)
    for key in ("state_bytes_peak", "rss_peak_bytes"):
        if all(r.get(key) is not None for r in runs):
            pooled[key] = max(r[key] for r in runs)
    return pooled


def local_key(row: DpRow) -> str:
    """Local jobs are named by the only work they vary in: accumulation, checkpointing, the sparse
    embedding, and a precision of the row's own (after '@').

    >>> local_key(DP_ROWS["ddp+accumulate4"]), local_key(DP_ROWS["fsdp+ckpt"]), local_key(DP_ROWS["tp+sp"])
    ('local+accumulate4', 'local+ckpt', 'local')
    >>> local_key(DP_ROWS["ddp+hybrid"])
    'local+sparse@fp32'
    """
    key = "local" if row.accumulate == 1 else f"local+accumulate{row.accumulate}"
    key += ("+ckpt" if row.checkpoint else "") + ("+sparse" if row.sparse else "")
    return key + (f"@{row.precision}" if row.precision else "")


def _local_settings(key: str) -> dict:
    """The LadderSpec fields a local job's key stands for (the inverse of local_key); no precision
    when the key has none (the ladder's)."""
    match = re.fullmatch(r"local(?:\+accumulate(\d+))?(\+ckpt)?(\+sparse)?(?:@(.+))?", key)
    settings = {"accumulate": int(match.group(1) or 1), "checkpoint": "blocks" if match.group(2) else None,
                "sparse_embedding": bool(match.group(3))}
    return settings if match.group(4) is None else {**settings, "precision": match.group(4)}


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


def _ci(m: dict, metric: str, pattern: str, scale: float = 1.0) -> str:
    value = m.get(metric)
    if value is None or value.get("median") is None:
        return "—"
    text = pattern.format(value["median"] * scale)
    if value.get("ci"):
        lo, hi = value["ci"]
        text += f" ({pattern.format(lo * scale)}-{pattern.format(hi * scale)})"
    return text


def _print_table(console, doc: dict) -> None:
    from rich.table import Table

    header = doc["header"]
    link, floor_rate = header["link"], header["floor_rate"]
    table = Table(title=f"data-parallel ladder: {header['workload']['name']}, {header['nproc']} ranks, link {link}, "
                        f"{header['steps']} measured steps a row in {header['rounds']} alternating rounds "
                        f"(intervals: 95% bootstrap)")
    for col in ("config", "step ms (p20-p80)", "× ddp (95%)", "local ms", "overhead (95%)", "wire MB/step",
                "× fp32 ring", f"floor ms {floor_rate}", "val loss", "Δval", "state MiB (× ddp)", "RSS MiB"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for name, row in doc["configs"].items():
        m = row.get("metrics")
        if m is None:
            table.add_row(name, f"[red]error[/]: {escape(str(row.get('error', '?')))}", *[""] * 10)
            continue

        def get(metric, pattern, scale=1.0):
            value = m.get(metric, {}).get("median")
            return "—" if value is None else pattern.format(value * scale)

        st = m["step_time"]
        table.add_row(
            name, f"{st['median'] * 1e3:.0f} ({st['p20'] * 1e3:.0f}-{st['p80'] * 1e3:.0f})",
            _ci(m, "step_time_vs_ddp", "{:.2f}"), get("local_step_time", "{:.0f}", 1e3),
            _ci(m, "comm_overhead", "{:.0%}"), get("wire_bytes_per_step", "{:.1f}", 1e-6),
            get("wire_vs_fp32_ring", "{:.3f}"), get("link_floor", "{:.0f}", 1e3),
            get("val_loss", "{:.4f}"), get("val_loss_delta", "{:+.2f}%"),
            f"{get('state_bytes_peak', '{:.1f}', 2**-20)} ({get('state_bytes_vs_ddp', '{:.2f}')})",
            get("rss_peak", "{:.0f}", 2**-20))
    console.print(table)


def _target_note(doc: dict) -> str | None:
    """Which rows meet issue 5's bar (overhead <= 15%, |Δval| <= 2% vs uncompressed); None when no
    row it applies to ran."""
    met, missed = [], []
    for name, row in doc["configs"].items():
        m = row.get("metrics", {})
        if "comm_overhead" not in m or "val_loss_delta" not in m or name == BASELINE_ROW or DP_ROWS[name].parallel:
            continue  # the bar is for the ways of exchanging DDP's gradients; sharded rows trade memory
        ok = m["comm_overhead"]["median"] <= 0.15 and abs(m["val_loss_delta"]["median"]) <= 2.0
        (met if ok else missed).append(name)
    if not met and not missed:
        return None
    return (f"target (comm overhead <= 15% and |Δval| <= 2% vs {BASELINE_ROW}) on link {doc['header']['link']}: "
            f"met by {', '.join(met) or 'none'}; missed by {', '.join(missed) or 'none'}")


def _header(workload: str, overrides: dict, names, nproc, steps, warmup, precision, link, quick, seed, val_batches,
            max_state_bytes=None, rounds=1, wire_problem=None):
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
        "steps": steps, "rounds": rounds, "warmup": warmup, "comm_warmup": warmup - 1, "seed": seed,
        "val_batches": val_batches, "precision": precision, "link": link or "loopback", "floor_rate": link or FLOOR_RATE,
        "quick": quick, "hardware": hw,
        "versions": hw["versions"], "baseline": BASELINE_ROW,
        "step_time": "per optimizer step (all its micro-batches), slowest rank per step, warm-up excluded; "
                     "a row's timed steps pooled over its rounds (jobs run in ladder order, then reversed, ...)",
        "intervals": "95% percentile bootstrap over the pooled per-step times (bench.stats.bootstrap_ratio_ci)",
        "wire_bytes": "every byte the job's ranks sent each other per optimizer step, read off the loopback "
                      "transmit counter of the job's own network namespace"
                      if wire_problem is None else
                      f"no network namespace here ({wire_problem}): DDP hook payload only, as a ring would move it",
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
                  seed: int = 0, timeout: float = 900.0, max_state_bytes: int | None = None, rounds: int | None = None,
                  console=None) -> dict:
    """Run the ladder, print the environment line and table, write ``out_dir/dp_results.json``; returns it.

    ``steps``: measured steps a row, spread over ``rounds`` runs of every job in alternating order.
    ``max_state_bytes``: every dp job stops when a rank's parameters + gradients + optimizer state
    pass it (see the module docstring); None, no cap.
    """
    from ..precision.config import PRECISIONS
    from .runner import quick_overrides

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
    rounds = rounds or (QUICK_ROUNDS if quick else DEFAULT_ROUNDS)
    check_positive("rounds", rounds)
    if rounds > steps:
        raise ConfigError(f"rounds={rounds} is more than steps={steps}: every round needs a measured step; "
                          f"lower --rounds or raise --steps")
    warmup = warmup if warmup is not None else (QUICK_WARMUP if quick else DEFAULT_WARMUP)
    if warmup < 2:
        raise ConfigError(f"warmup={warmup} must be >= 2: compression starts at step warmup-1, untimed")
    if link:
        check_link(link)
    wire_problem = None if link else namespace_problem()
    precision_note = None
    if precision == "auto":
        from ..precision.policy import resolve_precision

        precision, reason = resolve_precision("auto", torch.device("cpu"))
        precision_note = f"precision 'auto' chose {precision!r}: {reason}"
    overrides = {**(quick_overrides(workload) if quick else {}), **(overrides or {})}
    val_batches = 2 if quick else 4
    doc_header = _header(workload, overrides, names, nproc, steps, warmup, precision, link, quick, seed, val_batches,
                         max_state_bytes, rounds, wire_problem)
    hw = doc_header["hardware"]
    console.print(f"[bold]environment[/] cpu {hw['cpu_model']} ({hw['cpu_count']} logical CPUs), {nproc} ranks x 1 "
                  f"thread, gloo on {'loopback shaped to ' + link if link else 'plain loopback'}; "
                  + ", ".join(f"{k} {v}" for k, v in hw["versions"].items() if v))
    console.print(f"[bold]workload[/] {workload} {doc_header['workload']['settings']}, precision {precision}, "
                  f"{steps} measured steps a row in {rounds} alternating round(s), {warmup} warm-up steps a job")
    if wire_problem is not None:
        doc_header["notes"].append(f"bytes on the wire: no network namespace ({wire_problem}), so only DDP's hooks "
                                   "report what they send; sharded rows show —")
    if quick:
        doc_header["notes"].append("quick mode: tiny model, few steps; a smoke test, not a benchmark")
    for name in names:
        own = DP_ROWS[name].precision
        if own not in (None, precision):
            doc_header["notes"].append(f"{name} and its local job run in {own}, not {precision}"
                                       + (SPARSE_PRECISION_REASON if DP_ROWS[name].sparse else ""))
    if precision_note:
        doc_header["notes"].append(precision_note)
        console.print(f"[yellow]note[/] {escape(precision_note)}")

    from .interleave import split_steps

    common = dict(workload=workload, overrides=overrides, precision=precision, warmup=warmup,
                  comm_warmup=warmup - 1, seed=seed, val_batches=val_batches, threads=1,
                  count_wire=bool(link) or wire_problem is None)
    runs: dict[str, list[dict]] = {}
    jobs = _job_order(names)
    with tempfile.TemporaryDirectory(prefix="turbotrain-dp-") as tmp:
        for r, round_steps in enumerate(split_steps(steps, rounds)):
            for kind, name in (jobs if r % 2 == 0 else jobs[::-1]):
                if runs.get(name) and runs[name][-1]["status"] != "ok":
                    continue  # a row that failed once has failed: do not spend another round on it
                if kind == "local":
                    spec = LadderSpec(row=name, mode="local", steps=round_steps, **{**common, **_local_settings(name)})
                else:
                    row = DP_ROWS[name]
                    spec = LadderSpec(row=name, mode="dp", steps=round_steps, compression=row.compression,
                                      accumulate=row.accumulate, parallel=row.parallel, checkpoint=row.checkpoint,
                                      strategy=row.strategy, sparse_embedding=row.sparse,
                                      max_state_bytes=max_state_bytes,
                                      **{**common, "precision": row.precision or precision})
                with console.status(f"round {r + 1}/{rounds}: {kind} job {name} ..."):
                    result = _run_job(spec, nproc, link, Path(tmp), timeout, tag=f".r{r}")
                runs.setdefault(name, []).append(result)
                ok = result["status"] == "ok"
                state = f"{_summary(result['step_seconds'])['median'] * 1e3:.0f} ms/step" if ok else result["error"]
                console.print(f"  r{r + 1} {kind:5} {name:<20} {escape(str(state))}  "
                              f"[dim]({result['job_seconds']:.0f} s)[/]")
    results = {name: pool_rounds(row_runs) for name, row_runs in runs.items()}
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
                  "checkpoint": row.checkpoint, "local_divisor": row.tp, "strategy": row.strategy,
                  "sparse_embedding": row.sparse, "precision": row.precision or header["precision"], "twin": row.twin,
                  **dp, "local": local}
        if dp.get("status") == "ok":
            if dp.get("diverged"):
                header["notes"].append(f"{name}: training diverged (non-finite loss or weights)")
            elif dp.get("replicas_in_sync") is False:
                header["notes"].append(f"{name}: the ranks' weights differ after training (replicas out of sync)")
            if local is not None and local.get("status") != "ok":
                header["notes"].append(f"{name}: its local job failed ({local.get('error')}), so no overhead")
            twin = (row.twin, results[row.twin]) if row.twin in results else None
            detail["metrics"] = row_metrics(dp, local, baseline, tp=row.tp, floor_rate=header["floor_rate"], twin=twin)
            if twin is not None:
                header["notes"].append(_twin_note(name, detail["metrics"]))
            rows += [{**common, "config": name, "metric": metric, **value}
                     for metric, value in detail["metrics"].items()]
        configs[name] = detail
    if baseline is not None and baseline.get("status") == "ok":
        floor = link_floor_seconds(baseline["gradient_bytes"], baseline["world_size"], header["floor_rate"])
        header["link_floor_seconds"] = floor
        header["notes"].append(
            f"a ring all-reduce of the {baseline['gradient_bytes'] / 1e6:.1f} MB of gradients takes >= "
            f"{floor * 1e3:.0f} ms at {header['floor_rate']} (2(n-1) buffers through one shaped loopback); each "
            "row's floor column is the same arithmetic on the bytes it was measured to send")
    doc = {"schema": SCHEMA, "header": header, "rows": rows, "configs": configs}
    if target := _target_note(doc):
        header["notes"].append(target)
    if any(DP_ROWS[name].tp > 1 for name in configs):
        header["notes"].append("a tensor-parallel row's Δval is against its one-process job: its ranks train the "
                               "same rows, so a step sees 1/tp of the tokens of a ddp step")
    if header.get("max_state_bytes") is not None:
        header["notes"].append(_cap_note(doc))
    return doc


def _twin_note(name: str, m: dict) -> str:
    """One line comparing a row with its twin (DpRow.twin), or saying why it cannot."""
    if "step_time_vs_twin" not in m:
        return f"{name}: its twin {DP_ROWS[name].twin} failed, so no comparison"
    twin = DP_ROWS[name].twin
    return (f"{name} vs {twin} (same model, optimizer and precision; only the exchange differs): step time "
            f"{_ci(m, 'step_time_vs_twin', '{:.2f}')}x, val loss {_ci(m, 'val_loss_delta_vs_twin', '{:+.2f}')}%, "
            f"sum of the parameters {_ci(m, 'params_checksum_vs_twin', '{:+.1e}')} relative")


def _cap_note(doc: dict) -> str:
    """Which rows trained under the state cap and which it stopped."""
    cap = doc["header"]["max_state_bytes"]
    under = [f"{n} ({c['state_bytes_peak'] / 2**20:.2f} MiB)" for n, c in doc["configs"].items()
             if c.get("status") == "ok"]
    over = [n for n, c in doc["configs"].items() if "StateCapExceeded" in str(c.get("error", ""))]
    return (f"state cap {cap / 2**20:.2f} MiB per rank (parameters + gradients + optimizer state, enforced): "
            f"trained under it: {', '.join(under) or 'none'}; stopped by it: {', '.join(over) or 'none'}")

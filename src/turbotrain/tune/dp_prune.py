"""The data-parallel stage's pruning: compression x bucket size for one compute recipe, priced
before anything runs by comm/model.py's alpha-beta model (the one ``turbotrain comm-plan`` prints).

Rules, in order (the first that applies names the candidate's reason; the reference, DDP's
defaults with no compression, is never pruned):

1. known costs and no-ops:
   * a cast of gradients that are already 2 bytes (a ``*-master`` precision keeps low-precision
     gradients): to their own dtype it does nothing, to the other 2-byte dtype it saves no bytes
     and loses precision;
   * fp16 on the wire where bf16 is a candidate: the same 2 bytes a parameter with 5 exponent bits
     to bf16's 8, so small gradients underflow without loss scaling; bf16 is measured in its place;
   * 1-bit Adam where the optimizer cannot become one (``comm.ddp.to_onebit_adam`` needs
     torch.optim.Adam/AdamW; its own error is the reason);
   * 1-bit Adam at a bucket size other than DDP's default: after its warm-up it exchanges inside
     ``optimizer.step``, not in DDP's buckets, so the bucket changes only the warm-up steps;
   * 1-bit Adam with fewer than ONEBIT_MIN_WARMUP uncompressed steps before it freezes the variance
     (tune's jobs are short): the job would diverge or fail the loss check, so it is not run.
2. the model: a candidate whose predicted step is more than PRUNE_MARGIN times the best prediction.

The prediction (DP_MODEL, or dp_model's with the user's fit, printed by every report) takes
comm/model.py's ``predict`` row for the candidate's compressor on N ranks of one link
(``Topology(N nodes x 1)``: every rank behind the link; dp_link: a loopback shaped to ``--link``,
the all_reduce fit of the user's comm-bench JSON from ``--fit-json``, or plain loopback as
comm-bench fitted it here), then prices the bucket size with the same model's ``collective_time``: one collective's
latency per extra bucket, and at least the last bucket exposed after backward. 1-bit Adam is
priced as its warm-up share (ONEBIT_WARMUP_SHARE, steps at the uncompressed cost) plus the rest at
its compressed cost.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from ..comm.config import DataParallelConfig
from ..comm.model import (BACKWARD_SHARE, LINKS, Fit, Link, Topology, collective_time, exposed_seconds, fit_alpha_beta,
                          link_from_fit, predict)
from ..errors import ConfigError, check_number
from .space import DEFAULT_BUCKET_MB, Candidate

__all__ = ["DpFacts", "dp_link", "load_link_fit", "dp_model", "gradient_bytes", "price", "prune_dp", "compute_per_rank",
           "threads_per_rank", "PRUNE_MARGIN", "ONEBIT_WARMUP_SHARE", "ONEBIT_MIN_WARMUP", "LOOPBACK_FIT", "DP_MODEL"]

#: A candidate predicted this many times slower than the best prediction is pruned. Why 1.5: the
#: loopback fit below is off by 31% at its median point and 93% at its worst, and on a CPU the
#: model's compressor work (HBM-style passes at the copy bandwidth) is several times too low
#: (PowerSGD measured ~15% of a loopback step, benchmarks/2026-12-04-avx512-dp-ladder-onebit-hybrid.md,
#: where this model gives a few percent). Only a gap that no error of that size closes is pruned;
#: everything nearer is measured.
PRUNE_MARGIN = 1.5
#: Share of training 1-bit Adam runs uncompressed: comm.onebit.warmup_for's 20% (the paper's 15-25%).
ONEBIT_WARMUP_SHARE = 0.2
#: Uncompressed steps 1-bit Adam needs before it freezes Adam's variance in a job this short: the
#: data-parallel ladder found the quick gpt went 8.9 -> 333 -> NaN frozen after 2 steps and trains
#: after 7 (bench/dp_ladder.py, its warm-up of 8). Fewer, and the job only spends budget on a
#: candidate the loss check must reject; ``--warmup 8`` or more lets tune measure it.
ONEBIT_MIN_WARMUP = 7
#: comm-bench's fit of 2 gloo ranks all-reducing on this project's 2-core VM over plain loopback
#: (docs/comm-plan.md, 2026-12-03: alpha 267 us, 1/beta 1.034 GB/s of buffer, errors 31% median,
#: 93% max): the link of a tune without --link or --fit-json, as comm-plan's fit would read it.
LOOPBACK_FIT = Fit("all_reduce", 2, 267.0e-6, 1 / 1.034e9, 7, 0.313, 0.931)
#: What a shaped loopback's TCP reaches of its rate: comm-plan's preset for TCP on a 10 GbE line.
_TCP = LINKS["10gbe"]
_COMPRESSOR_ROW = {None: ("ring", "none"), "bf16": ("ring", "bf16"), "fp16": ("ring", "bf16"),
                   "onebit": ("all_to_all+all_gather", "onebit")}
_TWO_BYTE = ("bf16", "fp16")


def _model_text(link: str) -> str:
    """The model as every report prints it, ``link`` saying which link it priced."""
    return (
        "Data-parallel model (seconds per optimizer step per rank; it prunes, it is not reported as a speed): "
        "comm/model.py's alpha-beta rows (turbotrain comm-plan) for the candidate's compressor on N ranks behind one "
        "link: ring all-reduce of the gradient (none; bf16 and fp16 at 2 bytes a parameter plus a cast), PowerSGD's "
        "two all-reduces of rank-4 factors, 1-bit Adam's all_to_all and all_gather of signs; compressor work at the "
        "measured copy bandwidth. Each extra DDP bucket adds one collective's latency (two for PowerSGD); the "
        f"exchange overlaps backward ({BACKWARD_SHARE:.2f} of the compute) but the last bucket's is always exposed; "
        f"1-bit Adam is not overlapped and runs its warm-up ({ONEBIT_WARMUP_SHARE:.0%} of training) at the "
        "uncompressed cost. Compute: the compute winner's measured step, scaled from the threads it ran with to a "
        f"rank's (ranks x threads share the cores). Link: {link}. Pruned: a prediction over {PRUNE_MARGIN}x the best."
    )


DP_MODEL = _model_text(
    "--link RATE as a loopback shaped to RATE shared by the N ranks (TCP efficiency of comm-plan's 10gbe preset, "
    "the loopback's per-hop latency); without --link (or --fit-json) the comm-bench fit of 2 gloo ranks on plain "
    "loopback in docs/comm-plan.md, its bandwidth shared by N/2 as many ranks")


def dp_model(fit: Fit | None = None, source: str | None = None) -> str:
    """DP_MODEL, its link told as the user's comm-bench fit (``--fit-json``) when ``fit`` is given;
    ``source`` names the file it came from."""
    if fit is None:
        return DP_MODEL
    return _model_text(f"the user's comm-bench fit in {source} (--fit-json), not the built-in loopback fit: "
                       f"{fit.describe()}; its bandwidth shared by N/{fit.world} as many ranks")


@dataclass(frozen=True)
class DpFacts:
    """What the data-parallel pricing needs to know about the run, all known before a job starts."""

    params: int
    """Parameters of the model."""
    precision: str
    """The compute recipe's precision (its gradients' dtype follows from it)."""
    world: int
    """Ranks of the data-parallel run."""
    compute_s: float
    """Compute seconds of one optimizer step on one rank (compute_per_rank)."""
    bandwidth: float
    """Measured copy bandwidth, bytes/s: what the compressors' passes over the gradient run at."""
    onebit_problem: str | None = None
    """Why 1-bit Adam cannot take this workload's optimizer (to_onebit_adam's error); None: it can."""
    comm_warmup: int | None = None
    """Uncompressed steps of each job before compression starts; None: not known (not checked)."""

    def __post_init__(self):
        check_number("params", self.params, integer=True, minimum=1)
        check_number("world", self.world, integer=True, minimum=2)
        check_number("compute_s", self.compute_s, minimum=0, exclusive=True)
        check_number("bandwidth", self.bandwidth, minimum=0, exclusive=True)


def gradient_bytes(precision: str) -> int:
    """Bytes of one gradient element: 2 where the parameters themselves are low precision (``*-master``:
    DDP reduces bf16/fp16 gradients), 4 where they stay FP32 (fp32, ``*-mixed`` autocast)."""
    return 2 if precision.endswith("-master") else 4


def threads_per_rank(world: int, cores: int | None = None) -> int:
    """Torch threads each rank runs with: the cores shared out, at least one (the ladder's rule)."""
    return max(1, (cores or os.cpu_count() or 1) // world)


def compute_per_rank(step_s: float, threads: int, world: int, cores: int | None = None) -> float:
    """A rank's compute per step, from a step measured alone with ``threads`` threads: taken to scale
    with the threads a rank gets, and to stretch when the ranks' threads outnumber the cores.

    >>> compute_per_rank(1.0, threads=2, world=2, cores=2)   # 2 ranks x 1 thread on 2 cores
    2.0
    """
    cores = cores or os.cpu_count() or 1
    rank_threads = threads_per_rank(world, cores)
    return step_s * threads / rank_threads * max(1.0, world * rank_threads / cores)


def load_link_fit(path, world: int) -> Fit:
    """The all_reduce fit in comm-bench JSON ``path`` (what ``turbotrain comm-bench --out`` writes) that a
    run of ``world`` ranks is priced with: the fit at ``world`` ranks, else the largest world fitted
    (dp_link shares its bandwidth). ConfigError naming the file and the fix for anything else."""
    check_number("world", world, integer=True, minimum=2)
    remedy = f"write one with `turbotrain comm-bench --nproc {world} --ops all_reduce --out FILE`"
    try:
        with open(path) as f:
            rows = json.load(f)
    except OSError as exc:
        raise ConfigError(f"comm-bench JSON {path} cannot be read ({exc.strerror or exc}); {remedy}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not comm-bench JSON ({exc}); {remedy}") from exc
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"{path} is not comm-bench JSON (comm-bench writes a list of row objects); {remedy}")
    try:
        fits = fit_alpha_beta(rows)
    except (ValueError, TypeError) as exc:  # a ConfigError names the row; int()/float() of a non-number
        raise ConfigError(f"{path} is not comm-bench JSON: {exc}; {remedy}") from exc
    # one rank all-reduces with nobody: no hop and no link to read (link_from_fit divides by 2(n-1))
    reduce = [f for (op, n), f in fits.items() if op == "all_reduce" and n >= 2]
    if not reduce:
        raise ConfigError(f"{path} has no all_reduce rows with two or more sizes (on two or more ranks) to fit a "
                          f"link from; {remedy}")
    fit = next((f for f in reduce if f.world == world), None) or max(reduce, key=lambda f: f.world)
    if fit.beta_s_per_byte <= 0:
        raise ConfigError(f"{path}'s all_reduce times on {fit.world} ranks do not grow with size, so they give no "
                          "bandwidth; measure up to larger buffers (comm-bench --max-bytes 16M or more)")
    return fit


def dp_link(world: int, rate: str | None = None, fit: Fit | None = None, source: str | None = None) -> Link:
    """The link the ranks share: a loopback shaped to ``rate`` (a tc rate such as '1gbit') or, without
    one, the all_reduce ``fit`` of the user's comm-bench JSON ``source`` (load_link_fit), else plain
    loopback as comm-bench measured it here (LOOPBACK_FIT).

    All N ranks of a shaped loopback send through its one egress, so each gets rate / N; a fitted
    link's bandwidth is taken to divide the same way beyond the ranks it was fitted on.
    """
    from ..bench.dp_ladder import parse_rate

    check_number("world", world, integer=True, minimum=2)
    if rate is not None and fit is not None:
        raise ConfigError(f"--link {rate} and --fit-json {source} both set the data-parallel link; choose one")
    where = "plain loopback" if fit is None else f"the link fitted in {Path(source or 'comm-bench JSON').name}"
    fit = fit or LOOPBACK_FIT
    fitted = link_from_fit(fit, Link(f"{where} (comm-bench fit)", 0.0, 1.0, 0.0, "ethernet"))
    if rate is None:
        share = fit.world / world
        return Link(f"{where} shared by {world} ranks (comm-bench fit of {fit.world})", fitted.gbps * share, 1.0,
                    fitted.alpha_s, "ethernet")
    gbps = parse_rate(rate) / 1e9
    return Link(f"loopback shaped to {rate} shared by {world} ranks", gbps / world, _TCP.efficiency,
                fitted.alpha_s, "ethernet")


def _model_row(c: Candidate, facts: DpFacts, link: Link) -> dict:
    rank = DataParallelConfig().powersgd_rank
    rows = predict(facts.params, link, nodes=facts.world, gpus_per_node=1, compute_s=facts.compute_s, ranks=(),
                   powersgd_rank=rank, grad_bytes=gradient_bytes(facts.precision), hbm_bytes_per_s=facts.bandwidth)
    algorithm, compressor = _COMPRESSOR_ROW.get(c.compression, ("ring", f"powersgd r={rank}"))
    return next(r for r in rows if r["algorithm"] == algorithm and r["compressor"] == compressor)


def price(c: Candidate, facts: DpFacts, link: Link) -> dict:
    """The model's figures for ``c`` (see DP_MODEL): wire bytes a rank sends, exchange, exposed and
    compressor seconds, and ``step_s``, its predicted seconds per optimizer step."""
    row = _model_row(c, facts, link)
    topo = Topology(facts.world, 1, link)
    if c.compression == "onebit":
        # the same recipe uncompressed (every compute field carried: replace, not a field list to keep up)
        plain = price(replace(c, compression=None, bucket_mb=DEFAULT_BUCKET_MB, data_parallel=True, estimates={},
                              measured={}), facts, link)
        compressed = row["step_s"]
        step = ONEBIT_WARMUP_SHARE * plain["step_s"] + (1 - ONEBIT_WARMUP_SHARE) * compressed
        return {"wire_bytes_per_rank": row["bytes_per_rank"], "exchange_s": row["comm_s"],
                "exposed_s": row["exposed_s"], "compressor_s": row["compressor_s"], "compressed_step_s": compressed,
                "step_s": step, "buckets": None}
    gradient = gradient_bytes(facts.precision) * facts.params
    bucket = c.bucket_mb * 2**20
    buckets = math.ceil(gradient / bucket)
    per_bucket = 2 if c.compression == "powersgd" else 1  # PowerSGD all-reduces P, then Q, per bucket
    latency = collective_time("ring", 0.0, topo)
    exchange = row["comm_s"] + (buckets - 1) * per_bucket * latency
    last = per_bucket * collective_time("ring", row["bytes_per_rank"] / per_bucket * min(1.0, bucket / gradient), topo)
    exposed = exposed_seconds(exchange, facts.compute_s, last)
    return {"wire_bytes_per_rank": row["bytes_per_rank"], "exchange_s": exchange, "exposed_s": exposed,
            "compressor_s": row["compressor_s"], "step_s": facts.compute_s + exposed + row["compressor_s"],
            "buckets": buckets}


def _known_reason(c: Candidate, facts: DpFacts, compressions: set) -> str | None:
    grad = facts.precision.split("-")[0] if gradient_bytes(facts.precision) == 2 else "fp32"
    if c.compression in _TWO_BYTE and grad in _TWO_BYTE:
        if c.compression == grad:
            return (f"{facts.precision} keeps {grad} gradients, so compression={grad!r} casts them to their own dtype: "
                    "a no-op beside the uncompressed job, which sends the same bytes")
        return (f"{facts.precision} keeps 2-byte {grad} gradients; a cast to {c.compression} sends the same bytes "
                "and only loses precision")
    if c.compression == "fp16" and "bf16" in compressions:
        return ("fp16 on the wire sends the same 2 bytes a parameter as bf16 with 5 exponent bits to bf16's 8, so "
                "small gradients underflow without loss scaling; bf16 is measured in its place")
    if c.compression == "onebit" and facts.onebit_problem:
        return f"1-bit Adam replaces the optimizer, and this one cannot become it: {facts.onebit_problem}"
    if c.compression == "onebit" and facts.comm_warmup is not None and facts.comm_warmup < ONEBIT_MIN_WARMUP:
        return (f"1-bit Adam would freeze Adam's variance after {facts.comm_warmup} uncompressed step(s) of the job; "
                f"it needs {ONEBIT_MIN_WARMUP} to train in a run this short, so its job could only fail the loss "
                f"check; give --warmup {ONEBIT_MIN_WARMUP + 1} or more to measure it")
    if c.compression == "onebit" and c.bucket_mb != DEFAULT_BUCKET_MB:
        return ("1-bit Adam exchanges inside optimizer.step after its warm-up, not in DDP's buckets, so the bucket "
                f"size changes only its warm-up steps; the {DEFAULT_BUCKET_MB:g} MiB job stands for it")
    return None


def prune_dp(candidates: list[Candidate], facts: DpFacts, link: Link) -> list[Candidate]:
    """Fill each candidate's ``estimates`` with its price (``predicted_seconds`` among them) and mark
    it pruned (axis 'data_parallel') by the rules above, or leave it a candidate. Returns the
    survivors, the reference first, then by predicted step."""
    reference = [c for c in candidates if c.is_dp_reference]
    if len(reference) != 1:
        raise ConfigError("the data-parallel space needs exactly one reference candidate (no compression, the "
                          f"default {DEFAULT_BUCKET_MB:g} MiB bucket): every ratio is taken against it")
    compressions = {c.compression for c in candidates}
    for c in candidates:
        figures = price(c, facts, link)
        c.estimates.update(figures, predicted_seconds=figures["step_s"])
        if not c.is_dp_reference and (reason := _known_reason(c, facts, compressions)):
            c.status, c.pruned_axis, c.reason = "pruned", "data_parallel", reason
    left = [c for c in candidates if c.status == "candidate"]
    best = min(left, key=lambda c: c.estimates["step_s"])
    for c in left:
        ratio = c.estimates["step_s"] / best.estimates["step_s"]
        if not c.is_dp_reference and ratio > PRUNE_MARGIN:
            c.status, c.pruned_axis = "pruned", "data_parallel"
            c.reason = (f"predicted {c.estimates['step_s']:.3g} s/step, {ratio:.2f}x the best prediction "
                        f"({best.dp_label}, {best.estimates['step_s']:.3g} s) on {link.name}: over the "
                        f"{PRUNE_MARGIN}x margin of the alpha-beta model")
    left = [c for c in candidates if c.status == "candidate"]
    return sorted(left, key=lambda c: (not c.is_dp_reference, c.estimates["step_s"]))

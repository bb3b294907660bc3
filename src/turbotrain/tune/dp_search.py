"""The data-parallel stage of ``turbotrain tune --nproc N``: compression x bucket size for the recipe
the single-process search chose, pruned by the alpha-beta model (dp_prune.py), the survivors measured
as real torchrun jobs.

Every job is the data-parallel ladder's (``bench.dp_ladder.run_job``): N gloo ranks on this machine,
the cores shared out (``threads_per_rank``), each rank its own stream of the workload's batches,
in a network namespace of its own where one can be made (its loopback counter then gives the
bytes on the wire), shaped to ``--link`` when given. Each job trains the recipe as tuned.json will
carry it (precision, fused patterns, compile, checkpointing, the batch split into ``accumulate``
micro-batches) with its compression and bucket size; compression starts after warm-up - 1 steps
(at least one uncompressed step: 1-bit Adam measures the variance it freezes there), so every
timed step is compressed.

Order and rounds, the ladder's idea: round 0 runs the reference (no compression, DDP's 25 MiB bucket)
first, then the survivors by predicted step; round 1 runs them in reverse, and so on, while a whole
round still fits the budget (at most MAX_ROUNDS). Once the reference's first job has shown what a
job costs, the survivors are cut, in predicted order, to as many as two whole rounds can hold (the
rest "not reached", with that reason): a choice needs two rounds (MIN_CHOICE_ROUNDS). A job is started only when its estimate (the
longest job so far) fits; one that does not is "not reached". A row's timed steps pool over its
rounds; its ratio to the reference is median over median with a 95% bootstrap interval over the
pooled steps, step i paired with the reference's step i (bench.stats.bootstrap_ratio_ci).

The choice: the reference, unless a candidate ran at least MIN_CHOICE_ROUNDS rounds (and the
reference too), its interval lies wholly above 1.0 and its val loss is within the tolerance of the
recipe's compute dtype (bench.configs.LOSS_TOLERANCE) of the reference job's; then the fastest such.
Compression changes the training (error feedback, a frozen variance), so it has to pay measurably,
not within the noise; and the interval pairs steps within jobs, so one job each cannot show the
drift between jobs.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..bench.configs import LOSS_TOLERANCE
from ..bench.stats import bootstrap_ratio_ci, relative_change, speed_ratio
from .dp_prune import (PRUNE_MARGIN, DpFacts, compute_per_rank, dp_link, dp_model, load_link_fit, prune_dp,
                       threads_per_rank)
from .space import Candidate, enumerate_dp_space

__all__ = ["DpStage", "run_dp_stage", "check_dp_settings", "choose_dp", "record_dp", "onebit_problem",
           "two_round_capacity", "DP_BUDGET_SHARE", "MAX_ROUNDS", "MIN_JOB_S", "MIN_CHOICE_ROUNDS", "CHOICE_RULE"]

logger = logging.getLogger(__name__)

#: Share of --budget held for the data-parallel stage; the single-process search gets the rest. Its
#: jobs each pay a torchrun start, N imports of torch and a build, so a few survivors measured once
#: take about as long as the compute search's planned rounds; raise --budget for more rounds.
DP_BUDGET_SHARE = 0.4
#: Rounds of every surviving job at most (the ladder runs 2; a budget with time over buys more).
MAX_ROUNDS = 4
#: No job starts with less than this left: torchrun, N torch imports and a build take about this
#: much on the 2-core machine this was written on, before the first step.
MIN_JOB_S = 10.0
#: Rounds a candidate (and the reference) must have run before it can be chosen. The bootstrap
#: interval pairs steps within one job each, which cannot see how much whole jobs differ: the same
#: uncompressed job ran 3855 and 4383 ms a step in two rounds of one ladder
#: (benchmarks/2026-12-05-avx2-dp-1gbit), and one tune round measured bf16 on the wire at 1.29x with
#: a 5 MiB bucket and 0.97x with 25 MiB.
MIN_CHOICE_ROUNDS = 2
CHOICE_RULE = ("the reference (no compression, DDP's 25 MiB bucket) unless a candidate ran at least "
               f"{MIN_CHOICE_ROUNDS} alternating rounds, as the reference did, and its 95% interval of throughput "
               "against it lies wholly above 1.0 with its val loss within the compute dtype's tolerance of the "
               "reference job's; then the fastest such")


@dataclass
class DpStage:
    """What the data-parallel stage decided."""

    candidates: list[Candidate]
    """Every data-parallel candidate, pruned or not, the reference first."""
    winner: Candidate
    section: dict = field(default_factory=dict)
    """tune.json's ``data_parallel`` key: the settings, link and model it ran under."""


def check_dp_settings(world_size: int, link: str | None, workload_spec: dict | None = None,
                      fit_json: str | None = None) -> None:
    """ConfigError (or the ladder's HardwareError) for data-parallel settings that cannot run here,
    before any budget is spent: --link or --fit-json without ranks, both at once, a bad rate, a link
    this machine cannot shape, a comm-bench file no link can be fitted from, a workload the jobs
    cannot load by name."""
    if workload_spec is not None and "payload" in workload_spec:
        raise ConfigError("the data-parallel stage trains a named workload in torchrun jobs; the Python "
                          "turbotrain.tune(...) tunes one process (use `turbotrain tune --workload NAME --nproc N`)")
    if link is not None and world_size < 2:
        raise ConfigError(f"--link {link} shapes the link of a data-parallel run; give --nproc N (N >= 2) with it, "
                          "or drop --link")
    if fit_json is not None and world_size < 2:
        raise ConfigError(f"--fit-json {fit_json} prices the link of a data-parallel run; give --nproc N (N >= 2) "
                          "with it, or drop --fit-json")
    if fit_json is not None and link is not None:
        raise ConfigError(f"--link {link} and --fit-json {fit_json} both set the data-parallel link (a loopback shaped "
                          "to a rate, or the link your comm-bench measured); choose one")
    if fit_json is not None:
        try:
            load_link_fit(fit_json, world_size)
        except ConfigError as exc:
            raise ConfigError(f"--fit-json: {exc}") from exc
    if link is not None:
        from ..bench.dp_ladder import check_link

        check_link(link)


def onebit_problem(workload) -> str | None:
    """Why this workload's optimizer cannot become 1-bit Adam (comm.ddp.to_onebit_adam's own
    refusal), found on a one-element stand-in; None when it can."""
    import torch

    from ..comm.ddp import to_onebit_adam
    from ..bench.configs import make_optimizer

    factory = getattr(workload, "optimizer_fn", None) or make_optimizer
    try:
        to_onebit_adam(factory([torch.nn.Parameter(torch.zeros(1))]), warmup_steps=1)
    except ConfigError as exc:
        return str(exc)
    return None


def record_dp(c: Candidate, runs: list[dict] | None, reference: dict | None, compute_dtype: str,
              floor_rate: str) -> None:
    """Fill ``c.measured`` from its jobs (None: never started) against the reference's pooled result,
    and decide measured / rejected / error / not reached."""
    from ..bench.dp_ladder import pool_rounds, row_metrics

    if not runs:
        c.status = "not reached"
        c.reason = c.reason or "the budget ran out before its job could start; raise --budget"
        return
    pooled = pool_rounds(runs)
    if pooled.get("status") != "ok":
        c.status, c.reason = "error", pooled.get("error", "unknown error")
        if "timed out" in c.reason:  # the ladder's advice names its own --timeout, which tune has not
            c.reason = c.reason.replace(" (raise --timeout)", "") + ("; tune gives a job the time left in its "
                                                                     "budget, so raise --budget")
        return
    if reference is None or reference.get("status") != "ok":
        c.status, c.reason = "error", "the reference job failed, so nothing can be compared"
        return
    ref, mine = reference["step_seconds"], pooled["step_seconds"]
    metrics = row_metrics(pooled, None, reference, floor_rate=floor_rate)
    wire = metrics.get("wire_bytes_per_step", {})
    tolerance = LOSS_TOLERANCE[compute_dtype]
    val, ref_val = pooled.get("val_loss"), reference.get("val_loss")
    delta = relative_change(val, ref_val) if None not in (val, ref_val) else None
    c.measured = {"step_seconds": statistics.median(mine), "steps": len(mine), "rounds": pooled["rounds"],
                  "ratio_vs_reference": speed_ratio(ref, mine), "ratio_ci95": list(bootstrap_ratio_ci(ref, mine)),
                  "val_loss": val, "loss_delta_percent": delta, "loss_tolerance_percent": tolerance,
                  "compute_dtype": compute_dtype, "wire_bytes_per_step": wire.get("median"),
                  "wire_source": wire.get("source"),
                  "wire_vs_fp32_ring": metrics.get("wire_vs_fp32_ring", {}).get("median"),
                  "job_seconds": pooled.get("job_seconds"), "replicas_in_sync": pooled.get("replicas_in_sync"),
                  "engine": pooled.get("engine")}
    c.status = "measured"
    if pooled.get("diverged") or delta is None:
        c.status, c.reason = "rejected", "training diverged (a non-finite loss or weight)"
    elif pooled.get("replicas_in_sync") is False:
        c.status, c.reason = "rejected", "the ranks' weights differ after training (replicas out of sync)"
    elif abs(delta) > tolerance and not c.is_dp_reference:
        c.status = "rejected"
        c.reason = (f"val loss {val:.5f} is {delta:+.3f}% from the uncompressed job's {ref_val:.5f}, outside the "
                    f"{tolerance:g}% tolerance of {compute_dtype}")


def choose_dp(candidates: list[Candidate]) -> Candidate:
    """CHOICE_RULE over recorded candidates; a candidate that pays in fewer rounds is told why it was
    not chosen (its ``reason``)."""
    reference = next(c for c in candidates if c.is_dp_reference)
    reference_rounds = (reference.measured or {}).get("rounds", 0)
    paying = []
    for c in candidates:
        if c.status != "measured" or c.is_dp_reference or c.measured["ratio_ci95"][0] <= 1.0:
            continue
        rounds = min(c.measured["rounds"], reference_rounds)
        if rounds < MIN_CHOICE_ROUNDS:
            c.reason = (f"its interval clears 1.0, but in {rounds} round(s) of the reference and of it; a choice "
                        f"needs {MIN_CHOICE_ROUNDS} (jobs differ by more than one job's steps show); raise --budget")
            continue
        paying.append(c)
    return max(paying, key=lambda c: c.measured["ratio_vs_reference"]) if paying else reference


def two_round_capacity(left_s: float, job_s: float) -> int:
    """How many candidates besides the reference two whole rounds can hold, the reference's first job
    done: 2k of theirs and the reference's second must fit in ``left_s`` at ``job_s`` a job.

    >>> two_round_capacity(100.0, 20.0)   # 5 jobs left: 2 candidates x 2 rounds + the reference once more
    2
    """
    return max(0, int((left_s / job_s - 1) // 2))


def _estimate(runs: dict[str, list[dict]]) -> float | None:
    done = [r["job_seconds"] for rs in runs.values() for r in rs if r.get("status") == "ok"]
    return max(done) if done else None


def _measure(survivors: list[Candidate], base_spec: dict, world: int, link: str | None, end: float,
             say) -> dict[str, list[dict]]:
    """Run the survivors' jobs in alternating rounds while the budget lasts; {name: [result per round]}."""
    from ..bench.dp_ladder import run_job
    from ..bench.dp_worker import LadderSpec

    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="turbotrain-tune-dp-") as tmp:
        for r in range(MAX_ROUNDS):
            order = survivors if r % 2 == 0 else survivors[::-1]
            if r > 0:
                alive = [c for c in order if runs.get(c.name) and runs[c.name][-1]["status"] == "ok"]
                if len(alive) < 2 or time.monotonic() + (_estimate(runs) or 0.0) * len(alive) > end:
                    break  # a round starts only when all of it fits: half a round would unpair the intervals
                order = alive
            queue = list(order)
            while queue:
                c = queue.pop(0)
                left = end - time.monotonic()
                estimate = _estimate(runs)
                if left < max(MIN_JOB_S, estimate or 0.0):
                    if r == 0:
                        c.reason = (f"the budget would be exceeded: a job takes about {estimate or MIN_JOB_S:.0f} s, "
                                    f"{max(left, 0):.0f} s left; raise --budget")
                    continue
                spec = LadderSpec(row=c.name, mode="dp", compression=c.compression, bucket_mb=c.bucket_mb,
                                  **base_spec)
                say(f"dp round {r + 1}: {c.name} ({world} ranks) ...")
                result = run_job(spec, world, Path(tmp), timeout=left, link=link, tag=f".r{r}")
                runs.setdefault(c.name, []).append(result)
                ok = result.get("status") == "ok"
                say(f"dp round {r + 1}: {c.name}: " + (f"{statistics.median(result['step_seconds']):.3f} s/step, "
                                                       f"val loss {result.get('val_loss')}" if ok else result["error"])
                    + f" (job {result['job_seconds']:.0f} s)")
                if r == 0 and c.is_dp_reference and not ok:
                    return runs  # nothing can be compared with a reference that failed
                if r == 0 and c.is_dp_reference:
                    survivors, queue = _fit_two_rounds(survivors, queue, end - time.monotonic(), _estimate(runs))
    return runs


def _fit_two_rounds(survivors: list[Candidate], queue: list[Candidate], left_s: float, job_s: float):
    """Cut the candidates still queued for round 0 to what two rounds can hold (in predicted order);
    where not even one fits twice, keep them all for one informative round."""
    keep = two_round_capacity(left_s, job_s)
    if keep < 1 or keep >= len(queue):
        return survivors, queue
    for c in queue[keep:]:
        c.reason = (f"two rounds hold {keep} candidate(s) besides the reference in the {max(left_s, 0):.0f} s left "
                    f"(a job takes about {job_s:.0f} s), and this one was predicted slower; raise --budget")
    cut = set(id(c) for c in queue[keep:])
    return [c for c in survivors if id(c) not in cut], queue[:keep]


def run_dp_stage(recipe: Candidate, workload, workload_spec: dict, *, params: int, world: int, link: str | None,
                 steps: int, warmup: int, seed: int, val_batches: int, bandwidth: float, threads: int,
                 end: float, say=None, fit_json: str | None = None) -> DpStage:
    """Search compression x bucket size for ``recipe`` (a measured single-process candidate) on
    ``world`` ranks until ``end`` (time.monotonic()); returns the candidates, the winner and the
    report section. ``threads``: the threads ``recipe`` was measured with; ``fit_json``: comm-bench
    JSON whose all_reduce fit prices the link (``--fit-json``) in place of plain loopback's."""
    from ..bench.dp_ladder import FLOOR_RATE, namespace_problem

    say = say or logger.info
    started = time.monotonic()
    check_dp_settings(world, None, workload_spec)  # the fit file is read (and refused) just below
    step_s = recipe.measured.get("step_seconds")
    if not step_s:
        raise ConfigError(f"the data-parallel stage needs the compute recipe's measured step; {recipe.name} has none")
    rank_threads = threads_per_rank(world)
    comm_warmup = max(1, warmup - 1)
    facts = DpFacts(params=params, precision=recipe.precision, world=world,
                    compute_s=compute_per_rank(step_s, threads, world), bandwidth=bandwidth,
                    onebit_problem=onebit_problem(workload), comm_warmup=comm_warmup)
    fit = load_link_fit(fit_json, world) if fit_json is not None else None
    model_link = dp_link(world, link, fit, fit_json)
    if fit is not None:
        say(f"data-parallel link from your comm-bench fit in {fit_json}: {fit.describe()}")
    candidates = enumerate_dp_space(recipe)
    survivors = prune_dp(candidates, facts, model_link)
    say(f"data parallel: {world} ranks x {rank_threads} thread(s) on {model_link.name}; {len(candidates)} candidates, "
        f"{len(candidates) - len(survivors)} pruned, {len(survivors)} measured as torchrun jobs while the budget lasts")
    wire_problem = None if link else namespace_problem()
    base_spec = dict(workload=workload_spec["workload"], overrides=workload_spec.get("overrides") or {},
                     precision=recipe.precision, accumulate=recipe.accumulate, split_batch=True,
                     fuse=tuple(recipe.fusion), compile=recipe.compile != "none", checkpoint=recipe.checkpoint,
                     checkpoint_every=recipe.checkpoint_every,
                     warmup=comm_warmup + 1, comm_warmup=comm_warmup, steps=steps, seed=seed, val_batches=val_batches,
                     threads=rank_threads, count_wire=bool(link) or wire_problem is None)
    runs = _measure(survivors, base_spec, world, link, end, say)
    reference = next(c for c in candidates if c.is_dp_reference)
    from ..bench.dp_ladder import pool_rounds

    ref_result = pool_rounds(runs[reference.name]) if runs.get(reference.name) else None
    dtype = recipe.precision.split("-")[0]
    for c in survivors:
        record_dp(c, runs.get(c.name), ref_result, dtype, link or FLOOR_RATE)
    winner = choose_dp(candidates)
    rounds = max((len(r) for r in runs.values()), default=0)
    section = {
        "nproc": world, "link": link or (f"loopback, priced by the fit in {fit_json}" if fit else "loopback"),
        "threads_per_rank": rank_threads, "link_model": asdict(model_link),
        "link_fit": None if fit is None else {"file": str(fit_json), **asdict(fit), "description": fit.describe()},
        "model": dp_model(fit, fit_json), "prune_margin": PRUNE_MARGIN,
        "compute_recipe": recipe.name, "compute_s_per_rank": facts.compute_s,
        "compute_from": f"{recipe.name}'s measured {step_s:.3f} s/step on {threads} thread(s)",
        "onebit_problem": facts.onebit_problem, "steps_per_job": steps, "warmup": comm_warmup + 1,
        "comm_warmup": comm_warmup, "rounds": rounds, "reference": reference.name, "choice": CHOICE_RULE,
        "wire_bytes": ("the job's loopback transmit counter in its own network namespace, all ranks, per optimizer "
                       "step" if wire_problem is None or link else
                       f"no network namespace here ({wire_problem}): DDP hook payload as a ring would move it"),
        "winner": winner.name, "wall_seconds": time.monotonic() - started,
    }
    if ref_result is None or ref_result.get("status") != "ok":
        why = reference.reason or (ref_result or {}).get("error", "not run")
        logger.warning("the uncompressed data-parallel job did not run (%s): tuned.json carries DDP's defaults, "
                       "unmeasured", why)
    return DpStage(candidates, winner, section)

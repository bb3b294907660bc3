"""The search: analyse, enumerate, prune, order, then measure the survivors within a time budget.

Measurement is the benchmark ladder's (bench/interleave.py): every candidate in its own long-lived
worker on the same seed and batches, built and warmed up one at a time, then measured in rounds
whose order rotates, so drift lands on every candidate alike. The baseline (plain FP32, nothing
on) is always the first row: it is the reference of every ratio and the shadow run every loss is
checked against.

Budget: before each candidate is started, the time it would need (start, build and warm-up, its
share of the rounds, its val loss, and a compiled candidate's eval-mode compile) is estimated from
what has been measured so far (the baseline's
figures scaled by the ordering model; the compile time of a candidate that compiles (its
forward+loss graph, or its fused ops' epilogues) from those measured before it, COMPILE_PRIOR_S
before the first). A candidate that would not fit is "not reached" and the next
is considered. No round starts after ROUNDS_SHARE of the budget, nor once one more round and the
val losses would not fit.

Extra rounds: what is left of the rounds' share after the planned rounds goes to the candidates
the fastest cannot yet be told from (their 95% interval against it holds 1.0), round after
round, dropping each once its interval clears; five rounds of one step cannot separate steps a
few percent apart, and compiling the candidates leaves most budgets with time over.

Data parallel (``world_size > 1``, ``turbotrain tune --nproc N``): the search above gets
1 - DP_BUDGET_SHARE of the budget and picks the compute recipe; then dp_search.py searches
compression x bucket size for that recipe as torchrun jobs of N ranks, in the rest of the budget.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, check_number
from ..hardware import (check_idle_threads_sleep, detect, measure_matmul_peak, measure_memory_bandwidth,
                        resolve_device)
from ..utils import check_output_dir
from ..bench.configs import LOSS_TOLERANCE
from ..bench.interleave import run_interleaved, split_steps
from ..bench.stats import bootstrap_ratio_ci, relative_change, round_times, speed_ratio
from ..bench.worker import WorkerSpec, fixed_batches
from .dp_search import DP_BUDGET_SHARE, check_dp_settings, run_dp_stage
from .facts import analyse
from .prune import hardware_reasons, order, prune
from .row import CONFIG_ROW
from .space import Candidate, enumerate_space

__all__ = ["TuneSettings", "TuneResult", "run_tune", "COMPILE_PRIOR_S", "ROUNDS_SHARE", "EVAL_COMPILE_SHARE",
           "EXTRA_ROUNDS_FACTOR", "parse_duration", "parse_memory"]

logger = logging.getLogger(__name__)

#: Compile time assumed for the first compiled candidate, before one has been measured: torch.compile
#: of the default gpt's forward and loss took 45 s of warm-up on the 2-core CPU this was written on
#: (bench/runner.py). Only admission uses it; the measured figure replaces it.
COMPILE_PRIOR_S = 45.0
#: No interleaved round starts after this share of the budget (the val losses and reports follow).
ROUNDS_SHARE = 0.85
#: After the planned rounds, the candidates not yet told apart from the fastest get up to this many
#: times as many extra rounds again, while the budget lasts (``_Admission.more``).
EXTRA_ROUNDS_FACTOR = 4
#: The val loss takes about this share of a train step per val batch (a forward of the same size).
_VAL_SHARE = 0.5
#: A compiled candidate compiles its eval-mode graph (forward only) at the val loss; taken as this
#: share of its warm-up's compile (seen here: 7-51 s against 85-100 s, the higher under load).
EVAL_COMPILE_SHARE = 0.5


@dataclass(frozen=True)
class TuneSettings:
    budget_s: float = 300.0
    """Wall time the whole tune may take, analysis and reports included."""
    max_memory: int | None = None
    """Bytes a candidate may use (estimate before it runs, measured peak after); None: no limit."""
    steps: int = 5
    """Measured steps per candidate, spread over the rounds."""
    rounds: int = 5
    warmup: int = 2
    """Untimed steps first (compilation happens here)."""
    seed: int = 0
    val_batches: int = 4
    device: str = "auto"
    world_size: int = 1
    """Ranks of the data-parallel run being tuned (``--nproc``); > 1 adds the data-parallel stage:
    compression x bucket size for the chosen recipe, measured as torchrun jobs of this many ranks
    on this machine (dp_search.py)."""
    link: str | None = None
    """tc rate (e.g. '1gbit') the data-parallel jobs' loopback is shaped to (``--link``); None: plain
    loopback. Needs world_size > 1, root and network namespaces."""
    fit_json: str | None = None
    """comm-bench JSON (``turbotrain comm-bench --out``) whose all_reduce fit prices the data-parallel
    candidates' link (``--fit-json``) in place of the built-in loopback fit; the jobs still run on
    plain loopback. Needs world_size > 1; not with ``link``."""
    max_candidates: int | None = None
    """Measure at most this many candidates besides the baseline (None: as many as the budget allows)."""

    def __post_init__(self):
        check_number("budget", self.budget_s, minimum=0, exclusive=True)
        if self.max_memory is not None:
            check_number("max_memory", self.max_memory, integer=True, minimum=1)
        for name in ("steps", "rounds", "val_batches", "world_size"):
            check_number(name, getattr(self, name), integer=True, minimum=1)
        check_number("warmup", self.warmup, integer=True, minimum=0)
        if self.max_candidates is not None:
            check_number("max_candidates", self.max_candidates, integer=True, minimum=0)
        if self.link is not None:
            from ..bench.dp_ladder import parse_rate

            if self.world_size < 2:
                raise ConfigError(f"link={self.link!r} shapes the link of a data-parallel run; it needs world_size "
                                  "(--nproc) of 2 or more, or no link")
            parse_rate(self.link)
        if self.fit_json is not None and self.world_size < 2:
            raise ConfigError(f"fit_json={self.fit_json!r} prices the link of a data-parallel run; it needs "
                              "world_size (--nproc) of 2 or more, or no fit_json")


@dataclass
class TuneResult:
    config: object
    """The winning turbotrain.Config (the baseline's when nothing beat it)."""
    winner: Candidate
    candidates: list[Candidate]
    document: dict
    """What tune.json holds."""
    paths: list[Path] = field(default_factory=list)


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(text, name: str = "--budget") -> float:
    """'300', '300s', '5m', '1.5h' -> seconds; ConfigError otherwise.

    >>> parse_duration("5m"), parse_duration("90s"), parse_duration(20)
    (300.0, 90.0, 20.0)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        raw = str(text).strip().lower()
        unit = raw[-1:] if raw[-1:] in _DURATION_UNITS else "s"
        try:
            value = float(raw[:-1] if raw[-1:] in _DURATION_UNITS else raw) * _DURATION_UNITS[unit]
        except ValueError:
            raise ConfigError(f"{name} {text!r} is not a duration; write seconds or a number with s, m or h, "
                              "e.g. 300, 300s or 5m") from None
    if not value > 0:
        raise ConfigError(f"{name} {text!r} must be more than 0 seconds")
    return value


def parse_memory(value, name: str = "--max-memory") -> int | None:
    """None, a byte count, or a size such as '8G' (binary units) -> bytes."""
    if value is None:
        return None
    from ..bench.comm_bench import parse_size

    if isinstance(value, int) and not isinstance(value, bool):
        return parse_size(str(value), name)
    return parse_size(value, name)


class _Progress:
    """The ``live`` interface of run_interleaved, as lines to ``say``."""

    def __init__(self, say, start: float):
        self.say, self.start = say, start

    def phase(self, row, text):
        self.say(f"[{time.monotonic() - self.start:5.0f} s] {row}: {text}")

    def event(self, row, message):
        pass

    def update(self, results):
        pass


def _kind(c: Candidate) -> tuple[bool, bool]:
    """What a candidate compiles in its warm-up: the forward+loss graph, and (on CPU) the fused ops'
    epilogues (fusion/ops/_kernels.py), each in its own worker process."""
    return c.compile != "none", bool(c.fusion)


class _Admission:
    """Decides, before each candidate starts, whether it still fits in the budget."""

    def __init__(self, by_name: dict[str, Candidate], baseline: str, settings: TuneSettings, end: float,
                 reserve: float, rounds_end: float):
        self.by_name, self.baseline, self.settings = by_name, baseline, settings
        self.end, self.reserve, self.rounds_end = end, reserve, rounds_end
        self.admitted = 0
        self.results: dict = {}
        self.contenders: list[str] | None = None
        """The rows of the extra rounds, once they began (None before)."""

    def more(self, results: dict) -> list[str]:
        """The rows of the next extra round: the fastest candidate so far and every other one whose
        95% interval against it still holds 1.0 (not yet told apart); nothing once the leader stands
        alone. The baseline takes no part (its ratio is then taken unpaired over all rounds)."""
        self.results = results
        times = {n: round_times(r["round_seconds"]) for n, r in results.items()
                 if r.get("status") == "running" and n != self.baseline and r.get("round_seconds")}
        if len(times) < 2:
            self.contenders = []
            return []
        leader = min(times, key=lambda n: statistics.median(times[n]))
        close = [n for n in times if n != leader and bootstrap_ratio_ci(times[leader], times[n])[1] >= 1.0]
        self.contenders = [leader, *close] if close else []
        return self.contenders

    def _step(self, result: dict) -> float:
        steps = result.get("warmup_step_seconds") or []
        return steps[-1] if steps else result["warmup_seconds"] / max(1, self.settings.warmup)

    def _overhead(self, result: dict) -> float:
        return max(0.0, result["setup_wall_seconds"] - self.settings.warmup * self._step(result))

    def _finish(self, row: str, result: dict) -> float:
        """The val loss: a forward per val batch, and for a compiled candidate its eval-mode graph,
        compiled again (EVAL_COMPILE_SHARE of its warm-up's compile); nothing once it was taken."""
        if "val_loss" in result:
            return 0.0
        again = EVAL_COMPILE_SHARE * self._overhead(result) if self.by_name[row].compile != "none" else 0.0
        return self.settings.val_batches * _VAL_SHARE * self._step(result) + again

    def rounds_deadline(self) -> float:
        """No round starts after this: one more round (of the contenders, in the extra rounds) and
        every val loss must still fit."""
        running = {n: r for n, r in self.results.items() if r.get("status") == "running"}
        in_round = running if self.contenders is None else {n: running[n] for n in self.contenders if n in running}
        one_round = max(split_steps(self.settings.steps, self.settings.rounds)) * sum(
            self._step(r) for r in in_round.values())
        finish = sum(self._finish(n, r) for n, r in running.items())
        return min(self.rounds_end, self.end - self.reserve - finish - one_round)

    def setup_limit(self, row: str) -> float:
        """Seconds ``row`` may take to start, build and warm up: what is left before the rounds must
        start, less the rounds of the candidates already set up (a slow compile must not eat the budget)."""
        running = [r for r in self.results.values() if r.get("status") == "running"]
        rounds = self.settings.steps * sum(self._step(r) for r in running)
        return max(10.0, self.rounds_end - time.monotonic() - rounds)

    def __call__(self, row: str, results: dict) -> str | None:
        self.results = results
        if row == self.baseline:
            return None
        base = results.get(self.baseline, {})
        if base.get("status") != "running":
            return f"the baseline did not run ({base.get('error', 'not set up')}), so nothing can be compared"
        cap = self.settings.max_candidates
        if cap is not None and self.admitted >= cap:
            return f"max_candidates={cap} candidates were admitted already"
        c, b = self.by_name[row], self.by_name[self.baseline]
        running = {n: r for n, r in results.items() if r.get("status") == "running"}
        step = self._step(base) * c.estimates["predicted_seconds"] / b.estimates["predicted_seconds"]
        same_kind = [self._overhead(r) for n, r in running.items() if _kind(self.by_name[n]) == _kind(c)]
        compiling = [self._overhead(r) for n, r in running.items() if any(_kind(self.by_name[n]))]
        if same_kind:
            overhead = max(same_kind)
        elif any(_kind(c)):  # the first of its kind to compile something
            overhead = max(compiling) if compiling else self._overhead(base) + COMPILE_PRIOR_S
        else:
            overhead = self._overhead(base)
        per_step = sum(self._step(r) for r in running.values()) + step
        rounds = self.settings.steps * per_step
        finish = sum(self._finish(n, r) for n, r in running.items()) + self.settings.val_batches * _VAL_SHARE * step
        if c.compile != "none":
            finish += EVAL_COMPILE_SHARE * overhead  # its eval-mode graph
        setup = self.settings.warmup * step + overhead
        now = time.monotonic()
        left = self.end - self.reserve - now
        if setup + rounds + finish > left or now + setup + rounds > self.rounds_end:
            return (f"the budget would be exceeded: about {setup + rounds + finish:.0f} s needed (set-up {setup:.0f} s, "
                    f"rounds and val loss of every candidate {rounds + finish:.0f} s), {max(left, 0):.0f} s left")
        self.admitted += 1
        return None


def _specs(ordered: list[Candidate], settings: TuneSettings, device: str, workload_spec: dict,
           threads: int) -> dict[str, WorkerSpec]:
    return {c.name: WorkerSpec(config=CONFIG_ROW, device=device, warmup=settings.warmup, seed=settings.seed,
                               val_batches=settings.val_batches, threads=threads, count_ops=False, profile_steps=False,
                               engine_config=c.config().to_dict(), **workload_spec) for c in ordered}


def _record(c: Candidate, result: dict, base: dict, max_memory: int | None) -> None:
    """Fill ``c.measured`` from its row's result and decide measured / rejected / error / not reached."""
    status = result.get("status")
    if status == "skipped":
        c.status, c.reason = "not reached", result["reason"]
        return
    if status != "ok":
        c.status, c.reason = "error", result.get("error", "unknown error")
        if "timed out" in c.reason and "setup" in c.reason:
            c.reason += "; tune gives a set-up the time left before the rounds must start"
        return
    if not result.get("round_seconds"):
        c.status = "not reached"
        c.reason = ("set up, but the budget ran out before its first measured round (compiling the candidates "
                    "took it); raise --budget")
        return
    # Every round counts: a contender's extra rounds make its median (and so the ranking) firmer; the
    # interval is paired while both sides ran the same rounds and unpaired once they differ.
    ref, mine = round_times(base["round_seconds"]), round_times(result["round_seconds"])
    rounds = len(mine)
    tolerance = LOSS_TOLERANCE[result["compute_dtype"]]
    delta = relative_change(result["val_loss"], base["val_loss"])
    c.measured = {"step_seconds": statistics.median(result["step_seconds"]), "rounds": rounds,
                  "ratio_vs_baseline": speed_ratio(ref, mine), "ratio_ci95": list(bootstrap_ratio_ci(ref, mine)),
                  "val_loss": result["val_loss"], "loss_delta_percent": delta, "loss_tolerance_percent": tolerance,
                  "peak_memory_bytes": result.get("peak_memory_bytes"), "compute_dtype": result["compute_dtype"],
                  "build_seconds": result["build_seconds"], "warmup_seconds": result["warmup_seconds"]}
    peak = result.get("peak_memory_bytes")
    over = max_memory is not None and peak is not None and peak > max_memory
    c.measured["over_memory"] = over
    memory = f"measured peak {peak / 2**20:.0f} MiB > max_memory {max_memory / 2**20:.0f} MiB" if over else None
    c.status = "measured"
    if abs(delta) > tolerance:
        c.status = "rejected"
        c.reason = (f"val loss {result['val_loss']:.5f} is {delta:+.3f}% from the FP32 shadow run's "
                    f"{base['val_loss']:.5f}, outside the {tolerance:g}% tolerance of {result['compute_dtype']}")
    elif over and not c.is_baseline:
        c.status, c.reason = "rejected", memory
    elif over:  # the reference of every ratio stays measured; it is chosen only if nothing else fits
        c.reason = memory + "; kept as the reference"


def _winner(candidates: list[Candidate]) -> Candidate:
    """The fastest measured candidate within the memory budget; the baseline when there is none."""
    baseline = next(c for c in candidates if c.is_baseline)
    if baseline.status != "measured":
        raise ConfigError(f"the baseline (plain FP32) could not be measured: {baseline.reason}; nothing can be "
                          "tuned against it. Run with -v and see the worker's error")
    fits = [c for c in candidates if c.status == "measured" and not c.measured["over_memory"]]
    return max(fits, key=lambda c: (c.measured["ratio_vs_baseline"], c.is_baseline)) if fits else baseline


def run_tune(workload, settings: TuneSettings, out_dir, *, workload_spec: dict, say=None,
             started: float | None = None, space: list[Candidate] | None = None) -> TuneResult:
    """Tune ``workload`` (a Workload; ``workload_spec`` tells the workers how to load it: ``workload``
    and ``overrides``, or ``payload``) and write tuned.json, tune.json, tune.md and tune.html.

    ``space``: the candidates to consider (default: enumerate_space over every compute axis), baseline
    included. With ``settings.world_size > 1`` the data-parallel stage follows (a named workload only:
    ``workload_spec`` must name it), and the winner's Config carries its DataParallelConfig.
    """
    import torch

    from .report import build_document, pruned_axes, write_reports

    started = time.monotonic() if started is None else started
    say = say or logger.info
    out_dir = check_output_dir(out_dir)
    check_idle_threads_sleep()  # before any of the budget is spent: the interleaved rounds could not be trusted
    data_parallel = settings.world_size > 1
    if data_parallel:  # refused before any of the budget is spent
        check_dp_settings(settings.world_size, settings.link, workload_spec, fit_json=settings.fit_json)
    # the single-process search's share: with data parallelism the rest is the dp stage's
    budget = settings.budget_s * (1 - DP_BUDGET_SHARE if data_parallel else 1)
    end = started + budget
    device = resolve_device(settings.device)
    info = detect(device)
    batch = fixed_batches(workload, "train", 1, settings.seed, device)[0]
    say(f"device {device}: {info.cpu_model} ({', '.join(info.cpu_features) or 'no listed CPU features'})"
        + (f", {info.cuda_name}" if info.cuda_name else "") + f"; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads")
    facts = analyse(workload.build_model, workload.loss_fn, batch, device)
    space = enumerate_space(facts.batch_rows) if space is None else list(space)
    if any(c.data_parallel for c in space):
        raise ConfigError("the single-process search takes compute candidates only; data-parallel compression and "
                          "bucket size are searched for its winner when settings.world_size > 1")
    if not any(c.is_baseline for c in space):
        raise ConfigError("the tune space must hold the baseline (plain FP32, nothing on): every ratio and loss "
                          "check is taken against it")
    peaks = _peaks(info, device)
    bandwidth = measure_memory_bandwidth(device)
    survivors = order(prune(space, facts, info, peaks=peaks, max_memory=settings.max_memory), facts, peaks, bandwidth)
    say(f"model: {facts.params / 1e6:.2f} M parameters, {facts.matmul_flops / 1e9:.2f} GFLOP/step, batch of "
        f"{facts.batch_rows} rows; space: {len(space)} candidates, {len(space) - len(survivors)} pruned, "
        f"{len(survivors)} left, measured in the ordering model's order while the budget lasts")
    for group in pruned_axes(space):
        say(f"pruned {group['axis']} {', '.join(group['values'])} ({group['candidates']} candidates): {group['reason']}")
    by_name = {c.name: c for c in survivors}
    baseline = survivors[0].name
    reserve = max(3.0, 0.03 * budget)
    deadline = started + ROUNDS_SHARE * budget
    admit = _Admission(by_name, baseline, settings, end, reserve, deadline)
    specs = _specs(survivors, settings, device, workload_spec, torch.get_num_threads())
    per_round = split_steps(settings.steps, settings.rounds)
    with tempfile.TemporaryDirectory(prefix="turbotrain-tune-") as tmp:
        raw = run_interleaved(specs, per_round, Path(tmp), max(30.0, budget / 2),
                              live=_Progress(say, started), admit=admit, deadline=admit.rounds_deadline,
                              setup_timeout=admit.setup_limit, more=admit.more,
                              max_extra_rounds=EXTRA_ROUNDS_FACTOR * len(per_round))
    base = raw[baseline]
    for c in survivors:
        _record(c, raw[c.name], base, settings.max_memory)
    missed = sum(c.status == "not reached" for c in survivors)
    if missed:
        say(f"{missed} candidates not reached within the budget (tune.md lists them with the estimate that kept "
            "each out)")
    winner = _winner(space)
    dp = None
    if data_parallel:
        dp = run_dp_stage(winner, workload, workload_spec, params=facts.params, world=settings.world_size,
                          link=settings.link, steps=settings.steps, warmup=settings.warmup, seed=settings.seed,
                          val_batches=settings.val_batches, bandwidth=bandwidth, threads=torch.get_num_threads(),
                          end=started + settings.budget_s - max(3.0, 0.03 * settings.budget_s), say=say,
                          fit_json=settings.fit_json)
    chosen = dp.winner if dp is not None else winner
    doc = build_document(space, chosen, facts, info, peaks, bandwidth, settings, workload, per_round,
                         time.monotonic() - started, dp=dp, compute_winner=winner)
    paths = write_reports(doc, chosen, out_dir)
    return TuneResult(chosen.config(), chosen, space + (dp.candidates if dp else []), doc, paths)


def _peaks(info, device: str) -> dict:
    """Measured square-matmul peaks (turbotrain env's, cached per machine) of fp32 and of each
    low-precision dtype the hardware flags leave in; a dtype pruned by its flags is not measured."""
    flagged = hardware_reasons(info)
    return {d: measure_matmul_peak(d, device) for d in ("fp32", "bf16", "fp16") if d == "fp32" or d not in flagged}

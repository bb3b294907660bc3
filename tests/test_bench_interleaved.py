"""The interleaved ladder: round order, the bootstrap interval, FAILED rows, the matmul peak, the
worker protocol, and one tiny end-to-end run through the real CLI."""

import io
import json
import math
import os
import random
import subprocess
import sys
import textwrap

import pytest

from turbotrain.bench import configs as registry
from turbotrain.bench import interleave, peak, runner
from turbotrain.bench.flops import Gemm
from turbotrain.bench.interleave import round_order, run_interleaved, split_steps
from turbotrain.bench.report import SCHEMA, TIMED_METRICS, build_results
from turbotrain.bench.runner import LadderSettings, choose_reference, plan_rows, quick_overrides
from turbotrain.bench.stats import bootstrap_ratio_ci, round_times, speed_ratio
from turbotrain.bench.worker import WorkerSpec
from turbotrain.hardware import detect
from turbotrain.workloads import get_workload

ROW_KEYS = {"workload", "config", "metric", "unit", "median", "p20", "p80", "device", "versions", "timestamp",
            "ratio_vs_ref", "ratio_ci95", "rounds", "status"}

PLUGIN = textwrap.dedent('''
    import time
    from turbotrain.bench.configs import register_config

    def _fails(workload, device):
        raise RuntimeError("feature X is not here yet")

    def _hangs(workload, device):
        time.sleep(600)

    register_config("always-fails", "a row whose feature is missing", _fails, default=False, group="test")
    register_config("hangs", "a row that never finishes", _hangs, default=False, group="test")
''')


def _plugin_env(tmp_path) -> dict:
    (tmp_path / "bench_test_plugin.py").write_text(PLUGIN)
    return {"TURBOTRAIN_BENCH_PLUGINS": "bench_test_plugin",
            "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """Register test-only configs in this process and in every worker it starts."""
    for key, value in _plugin_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("always-fails", "hangs"):
        registry.unregister_config(name)


# ----------------------------------------------------------------------------------- round order
def test_rounds_rotate_the_ladder_order():
    rows = ["a", "b", "c"]
    orders = [round_order(rows, r) for r in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert orders[3:] == orders[:3]
    for position in range(3):  # over n rounds every row runs once in every position
        assert sorted(order[position] for order in orders[:3]) == rows
    assert round_order([], 4) == []


def test_steps_are_spread_evenly_over_rounds():
    assert split_steps(20, 10) == [2] * 10
    assert split_steps(7, 3) == [3, 2, 2]
    assert split_steps(3, 10) == [1, 1, 1]  # never more rounds than steps


class FakeWorker:
    """An in-memory worker: records every command in one shared log, fails where told to."""

    log: list = []
    fail_in_round: dict = {}

    def __init__(self, row, spec, workdir):
        self.row, self.rounds, self.val = row, 0, None

    def wait_ready(self, timeout):
        return {"ok": True}

    def request(self, command, timeout, on_event=None):
        FakeWorker.log.append((self.row, command["cmd"]))
        if command["cmd"] == "setup":
            return {"ok": True, "compute_dtype": "fp32", "build_seconds": 0.1, "warmup_seconds": 0.2, "losses": [9.0]}
        if command["cmd"] == "run":
            self.rounds += 1
            if FakeWorker.fail_in_round.get(self.row) == self.rounds:
                return {"ok": False, "error": "RuntimeError: out of memory"}
            return {"ok": True, "seconds": [0.5] * command["steps"], "losses": [8.0] * command["steps"]}
        if command["cmd"] == "val":  # as the worker: the loss where the run stands, kept for finish
            self.val = 7.0 + self.rounds
            return {"ok": True, "val_loss": self.val}
        return {"ok": True, "val_loss": 7.5 if self.val is None else self.val, "ops_per_step": None, "peak_memory_bytes": 1,
                "rss_baseline_bytes": 0, "rss_peak_bytes": 1}

    def close(self):
        pass


def test_parent_builds_every_row_first_then_alternates_them_round_by_round(monkeypatch, tmp_path):
    monkeypatch.setattr(interleave, "WorkerProcess", FakeWorker)
    FakeWorker.log, FakeWorker.fail_in_round = [], {"c": 2}
    specs = {row: WorkerSpec(workload="gpt", config="fp32-eager", device="cpu", warmup=1) for row in "abc"}
    updates = []
    results = run_interleaved(specs, [2, 1, 1], tmp_path, timeout=5, on_update=lambda r: updates.append(dict(r)))
    assert FakeWorker.log[:3] == [("a", "setup"), ("b", "setup"), ("c", "setup")]
    runs = [row for row, cmd in FakeWorker.log if cmd == "run"]
    # round 0: a b c; round 1: b c a (c fails there); round 2 over the rows left, rotated by 2: a b
    assert runs == ["a", "b", "c", "b", "c", "a", "a", "b"]
    assert [row for row, cmd in FakeWorker.log if cmd == "finish"] == ["a", "b"]
    assert results["a"]["status"] == "ok" and results["a"]["rounds"] == 3
    assert results["a"]["round_seconds"] == [[0.5, 0.5], [0.5], [0.5]] and len(results["a"]["step_seconds"]) == 4
    assert results["a"]["losses"] == [9.0] + [8.0] * 4  # warm-up first, then the measured steps
    assert results["c"]["status"] == "error" and "out of memory" in results["c"]["error"]
    assert len(updates) == 3 + 3 + 1  # after every set-up, every round and the end


def test_extra_rounds_run_only_the_rows_named_and_stop_when_none_are(monkeypatch, tmp_path):
    monkeypatch.setattr(interleave, "WorkerProcess", FakeWorker)
    FakeWorker.log, FakeWorker.fail_in_round = [], {}
    specs = {row: WorkerSpec(workload="gpt", config="fp32-eager", device="cpu", warmup=1) for row in "abc"}
    asked = []

    def more(results):  # b and c for two extra rounds, then nobody
        asked.append(len(results["a"]["round_seconds"]))
        return ["b", "c"] if len(asked) <= 2 else []

    results = run_interleaved(specs, [1, 1], tmp_path, timeout=5, more=more, max_extra_rounds=5,
                              deadline=lambda: float("inf"))
    assert [len(results[r]["round_seconds"]) for r in "abc"] == [2, 4, 4]
    assert asked == [2, 2, 2]  # a ran no extra round
    assert all(results[r]["status"] == "ok" for r in "abc")
    # every val loss was taken after the 2 planned rounds, before any extra one
    assert [results[r]["val_loss"] for r in "abc"] == [9.0, 9.0, 9.0]
    commands = [cmd for _, cmd in FakeWorker.log]
    assert commands[:9] == ["setup"] * 3 + ["run"] * 6 and commands[9:12] == ["val"] * 3
    assert "val" not in commands[12:]
    FakeWorker.log = []
    results = run_interleaved(specs, [1], tmp_path, timeout=5, more=lambda r: ["a"], max_extra_rounds=3,
                              deadline=lambda: float("inf"))
    assert results["a"]["rounds"] == 4 and results["b"]["rounds"] == 1  # bounded by max_extra_rounds
    FakeWorker.log = []
    results = run_interleaved(specs, [1], tmp_path, timeout=5, more=lambda r: ["a"], max_extra_rounds=3)
    assert results["a"]["rounds"] == 1  # no deadline, no extra rounds


# ---------------------------------------------------------------------------------- bootstrap
def _noisy(rng, centre, n, spread=0.05):
    return [centre * (1 + spread * rng.gauss(0, 1)) for _ in range(n)]


def _coverage(true_ratio: float, rounds: int = 10, ladders: int = 40) -> float:
    """Fraction of synthetic ladders (5% noise per round) whose interval contains ``true_ratio``."""
    hits = 0
    for seed in range(ladders):
        rng = random.Random(seed)
        reference, row = _noisy(rng, 1.0, rounds), _noisy(rng, 1.0 / true_ratio, rounds)
        lo, hi = bootstrap_ratio_ci(reference, row, resamples=500)
        assert lo <= speed_ratio(reference, row) <= hi
        hits += lo < true_ratio < hi
    return hits / ladders


def test_bootstrap_interval_contains_a_known_ratio():
    # A percentile bootstrap of medians covers a little under its nominal 95% at 10 rounds (~92%
    # in a 200-ladder simulation, ~89% at 5 rounds, 95% at 20): 85% over 40 ladders has slack.
    assert _coverage(1.5) >= 0.85
    rng = random.Random(0)
    reference, row = _noisy(rng, 1.0, 10), _noisy(rng, 1.0 / 1.5, 10)
    lo, hi = bootstrap_ratio_ci(reference, row)
    assert lo < 1.5 < hi and hi - lo < 0.2
    assert bootstrap_ratio_ci(reference, row) == (lo, hi)  # fixed seed: reproducible


def test_an_a_a_pair_has_an_interval_around_one():
    assert _coverage(1.0) >= 0.85
    rng = random.Random(0)
    first, second = _noisy(rng, 0.8, 10), _noisy(rng, 0.8, 10)
    lo, hi = bootstrap_ratio_ci(first, second)
    assert lo < 1.0 < hi
    assert bootstrap_ratio_ci(first, first) == (1.0, 1.0)


def test_paired_rounds_cancel_drift_that_hits_both_rows():
    rng = random.Random(5)
    drift = [1 + 0.5 * math.sin(i) for i in range(10)]  # the machine slows and recovers, +-50%
    reference = [d * (1 + 0.01 * rng.gauss(0, 1)) for d in drift]
    row = [d / 2 * (1 + 0.01 * rng.gauss(0, 1)) for d in drift]
    lo, hi = bootstrap_ratio_ci(reference, row)
    assert lo < 2.0 < hi and hi - lo < 0.1  # resampled in pairs, the drift divides out
    unpaired = bootstrap_ratio_ci(reference, row[:-1])  # unequal counts: each side resampled alone
    assert unpaired[1] - unpaired[0] > hi - lo


def test_round_times_are_the_median_step_of_each_round():
    assert round_times([[1.0, 3.0, 2.0], [4.0], []]) == [2.0, 4.0]


# -------------------------------------------------------------------------- FAILED and the rows
def _header(reference="fp32-eager", aa_row=None):
    return {"timestamp": "t", "versions": {"torch": "x"}, "flops_per_step": 1e9,
            "workload": {"name": "gpt", "unit": "tokens", "items_per_step": 100},
            "environment": {"matmul_peak_flops": {"fp32": 1e11, "bf16": 4e11}},
            "run": {"device": "cpu", "reference": reference, "aa_row": aa_row}}


def _row(val_loss, seconds=0.5, dtype="fp32", rounds=4):
    return {"status": "ok", "compute_dtype": dtype, "round_seconds": [[seconds]] * rounds,
            "step_seconds": [seconds] * rounds, "losses": [8.0] * rounds, "val_loss": val_loss,
            "peak_memory_bytes": 10, "rounds": rounds}


def test_rows_outside_their_loss_tolerance_are_failed():
    raw = {
        "fp32-eager": _row(4.0, 1.0),
        "fp32-eager#2": _row(4.0, 1.0),
        "torch-amp": _row(4.02, 0.5, "bf16"),      # +0.5%: within bf16's 1%
        "tt-bf16-master": _row(4.1, 0.5, "bf16"),  # +2.5%: outside
        "tt-fp32": _row(4.02, 1.0),                # +0.5%: outside fp32's 0.2%
        "tt-bf16-mixed": _row(math.nan, 0.5, "bf16"),
        "tt-fused": {"status": "error", "error": "boom"},
    }
    results = build_results(_header(aa_row="fp32-eager#2"), raw)
    status = {n: c["status"] for n, c in results["configs"].items()}
    assert status == {"fp32-eager": "ok", "fp32-eager#2": "ok", "torch-amp": "ok", "tt-bf16-master": "FAILED",
                      "tt-fp32": "FAILED", "tt-bf16-mixed": "FAILED", "tt-fused": "error"}
    check = results["configs"]["tt-bf16-master"]["loss_check"]
    assert check["tolerance_pct"] == 1.0 and check["delta_pct"] == pytest.approx(2.5)
    assert "outside its 1% tolerance" in check["message"]
    assert results["configs"]["fp32-eager#2"]["instance_of"] == "fp32-eager"
    rows = results["rows"]
    assert rows and all(set(r) == ROW_KEYS for r in rows)
    assert {r["config"] for r in rows} == set(raw) - {"tt-fused"}  # an error row has no metrics
    by = {(r["config"], r["metric"]): r for r in rows}
    assert by[("tt-bf16-master", "val_loss")]["status"] == "FAILED"
    assert by[("torch-amp", "step_time")]["ratio_vs_ref"] == pytest.approx(2.0)
    assert by[("torch-amp", "throughput")]["ratio_ci95"] == pytest.approx([2.0, 2.0])
    assert by[("torch-amp", "val_loss")]["ratio_vs_ref"] is None  # only the timed metrics carry it
    assert by[("fp32-eager", "step_time")]["rounds"] == 4
    assert {m for (c, m) in by if c == "torch-amp" and by[(c, m)]["ratio_vs_ref"] is not None} <= set(TIMED_METRICS)


def test_without_the_fp32_row_losses_are_not_checked():
    results = build_results(_header(reference="torch-amp"), {"torch-amp": _row(9.0, dtype="bf16")})
    config = results["configs"]["torch-amp"]
    assert config["status"] == "ok" and config["loss_check"]["passed"] is None
    assert "not checked" in config["loss_check"]["message"]


# ------------------------------------------------------------------------------ reference, A/A
def test_the_reference_is_the_compiled_step_and_runs_twice():
    notes = []
    default = registry.default_configs("cpu")
    rows, reference, aa = plan_rows(default, LadderSettings(), notes)
    assert reference == "torch-compile-step" and aa == "torch-compile-step#2"
    assert rows[rows.index(reference) + 1] == aa and len(rows) == len(default) + 1 and not notes
    assert choose_reference(["fp32-eager", "torch-compile-step-fp32"]) == "torch-compile-step-fp32"
    assert choose_reference(["tt-fp32", "torch-amp"]) == "torch-amp"  # the first peer
    assert choose_reference(["tt-fp32"]) == "tt-fp32"
    rows, reference, aa = plan_rows(["tt-fp32"], LadderSettings(reference="torch-compile-step", aa=False), notes)
    assert rows == ["torch-compile-step", "tt-fp32"] and aa is None  # an asked-for reference is added


def test_quick_ladder_keeps_the_reference():
    assert "torch-compile-step" in runner.QUICK_CONFIGS
    small = quick_overrides("gpt")
    assert small and all(quick_overrides(w) == small for w in ("user-gpt", "hf-llama", "hf-gpt2", "hf-bert", "hf:qwen2"))
    assert quick_overrides("resnet") == {} and quick_overrides("mlp") == {}  # not text models: left as they are


# --------------------------------------------------------------------------------- matmul peak
@pytest.fixture
def fake_gemms(monkeypatch, tmp_path):
    """measure_gemm returns scripted FLOP/s: {'probe': x, 'shape': [trials...]} set by the test."""
    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))
    monkeypatch.delenv("TURBOTRAIN_REMEASURE", raising=False)
    figures = {"probe": 100.0, "trials": [50.0, 120.0, 80.0], "calls": 0}

    def measure(g, dtype, device, trials, trial_seconds, shape_seconds=math.inf):
        if trials == peak.PeakSettings().probe_trials and g == peak.square_gemms(dtype, device)[0] and \
                trial_seconds == peak.PeakSettings().trial_seconds and shape_seconds == math.inf:
            return [figures["probe"]]
        figures["calls"] += 1
        return list(figures["trials"])

    monkeypatch.setattr(peak, "measure_gemm", measure)
    return figures


def test_peak_is_the_maximum_over_trials_and_shapes(fake_gemms):
    model = [Gemm(64, 32, 128, b_transposed=True)]
    result = peak.matmul_peak("fp32", "cpu", model)
    assert result["value"] == 120.0 and result["source"] == "measured"  # the max, not the median (80)
    assert set(result["per_gemm"]) == {g.label for g in [*model, *peak.square_gemms("fp32", "cpu")]}
    assert len(result["loadavg"]) == 3 and result["probe"] == 100.0


def test_cached_peak_is_reused_unless_a_fresh_probe_disagrees_by_over_ten_percent(fake_gemms):
    model = [Gemm(64, 32, 128)]
    peak.matmul_peak("fp32", "cpu", model)
    measured = fake_gemms["calls"]
    fake_gemms["probe"] = 108.0  # +8%: the cache describes this machine
    again = peak.matmul_peak("fp32", "cpu", model)
    assert again["source"] == "cached" and fake_gemms["calls"] == measured and again["probe_now"] == 108.0
    fake_gemms["probe"], fake_gemms["trials"] = 130.0, [140.0]  # +30%: the cached figure was taken busy
    fresh = peak.matmul_peak("fp32", "cpu", model)
    assert fresh["source"] == "measured" and fresh["value"] == 140.0 and "+30%" in fresh["reason"]
    assert peak.matmul_peak("fp32", "cpu", model)["source"] == "cached"  # the new figure was cached


def test_a_busy_re_measurement_does_not_lower_the_cached_peak(fake_gemms):
    model = [Gemm(64, 32, 128)]
    assert peak.matmul_peak("fp32", "cpu", model)["value"] == 120.0
    fake_gemms["probe"], fake_gemms["trials"] = 80.0, [90.0]  # -20%: measured again, and slower: busy now
    busy = peak.matmul_peak("fp32", "cpu", model)
    assert busy["value"] == 120.0 and busy["source"] == "cached"
    assert "below the cached maximum" in busy["reason"]
    fake_gemms["trials"] = [150.0]  # still a low probe, but the shapes ran faster: the higher figure wins
    assert peak.matmul_peak("fp32", "cpu", model)["value"] == 150.0
    fake_gemms["trials"] = [90.0]
    assert peak.matmul_peak("fp32", "cpu", model, force=True)["value"] == 90.0  # forced: the maximum is dropped


def test_a_new_workloads_peak_is_at_least_the_square_maximum_an_earlier_ladder_measured(fake_gemms):
    assert peak.matmul_peak("fp32", "cpu", [Gemm(64, 32, 128)])["value"] == 120.0  # squares at 120 too
    fake_gemms["probe"], fake_gemms["trials"] = 80.0, [90.0]  # another model's shapes, on a slow moment
    other = [Gemm(64, 32, 256)]
    first = peak.matmul_peak("fp32", "cpu", other)
    assert first["value"] == 120.0 and first["per_gemm"][other[0].label] == 90.0
    assert first["best_gemm"] in {g.label for g in peak.square_gemms("fp32", "cpu")}
    assert "earlier ladder on this machine" in first["reason"]
    again = peak.matmul_peak("fp32", "cpu", other)  # from the cache (the probe agrees): still raised
    assert again["source"] == "cached" and again["value"] == 120.0
    assert peak.matmul_peak("fp32", "cpu", other, force=True)["value"] == 90.0


# ------------------------------------------------------------------------- real worker processes
def test_failing_and_hanging_rows_become_errors(plugin, tmp_path):
    specs = {name: WorkerSpec(workload="gpt", config=name, device="cpu", warmup=0, val_batches=1,
                              overrides=quick_overrides("gpt"), threads=1) for name in ("always-fails", "hangs")}
    results = run_interleaved(specs, [1], tmp_path, timeout=10)
    assert results["always-fails"]["status"] == "error"
    assert "RuntimeError: feature X is not here yet" in results["always-fails"]["error"]
    assert "Traceback" in results["always-fails"]["traceback"]
    assert results["hangs"]["status"] == "error" and "timed out after 10 s in setup" in results["hangs"]["error"]


def test_row_error_with_rich_markup_is_shown_literally_and_results_are_kept(tmp_path, monkeypatch):
    from rich.console import Console

    error = "RuntimeError: shape [/] mismatch in [bold]x"
    seen_on_disk = []

    def fake_run(specs, per_round, workdir, timeout, live=None, on_update=None):
        results = {}
        for row in specs:
            results[row] = {"status": "error", "error": error}
            live.update(results)
            on_update(results)
            seen_on_disk.append(list(json.loads((tmp_path / "out" / "results.json").read_text())["configs"]))
        return results

    env = {"hardware": detect("cpu").to_dict(), "matmul_peak_flops": {"fp32": 1e11, "bf16": 1e11},
           "matmul_peak_method": "not measured (test)", "memory_bandwidth_bytes_per_s": 1e10,
           "recommended_precision": "fp32", "recommended_precision_reason": "test"}
    monkeypatch.setattr(runner, "_environment", lambda device: env)
    monkeypatch.setattr(runner, "matmul_peaks", lambda dtypes, device, gemms: {
        "flops": {d: 1e11 for d in dtypes}, "method": "test",
        "detail": {d: {"value": 1e11, "best_gemm": "1x1 @ 1x1", "source": "measured", "reason": "test",
                       "loadavg": [0.0, 0.0, 0.0]} for d in dtypes}})
    monkeypatch.setattr(runner, "run_interleaved", fake_run)
    console = Console(file=io.StringIO(), width=240)
    settings = LadderSettings(workload="mlp", configs=("fp32-eager", "torch-amp"), steps=1, warmup=0, device="cpu")
    results = runner.run_ladder(settings, tmp_path / "out", console=console)
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["configs"]["torch-amp"]["error"] == error == results["configs"]["fp32-eager"]["error"]
    assert seen_on_disk[0] == ["fp32-eager"]  # written after every update, before the next row
    assert list(results["configs"]) == ["fp32-eager", "fp32-eager#2", "torch-amp"]
    assert error in console.file.getvalue()  # escaped: neither a MarkupError nor bold


# ------------------------------------------------------------------------------ end to end (CLI)
QUICK_PAIR = ("fp32-eager", "torch-amp")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `turbotrain bench --quick` through the real CLI: two peer rows, the A/A twin of the first
    (the reference here) and a failing row, 4 measured steps in 2 interleaved rounds."""
    tmp = tmp_path_factory.mktemp("quick")
    env = {**os.environ, **_plugin_env(tmp)}
    out = tmp / "out"
    proc = subprocess.run([sys.executable, "-m", "turbotrain.cli", "bench", "--quick", "--configs",
                           ",".join((*QUICK_PAIR, "always-fails")), "--steps", "4", "--rounds", "2", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    return proc, out


def test_quick_run_writes_reports(quick_run):
    proc, out = quick_run
    assert proc.returncode == 0, proc.stderr  # one failed row does not fail the ladder
    assert "always-fails" in proc.stderr
    for name in ("results.json", "report.html", "throughput.png", "vs_ref.png", "memory.png", "loss.png"):
        assert (out / name).stat().st_size > 0
    html = (out / "report.html").read_text()
    assert html.count("<img") == 4 and "fp32-eager#2" in html and "feature X is not here yet" in html
    assert proc.stdout.index("matmul peak") < proc.stdout.index("fp32-eager")  # environment first


def test_quick_results_schema(quick_run):
    _, out = quick_run
    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == SCHEMA
    header, run = results["header"], results["header"]["run"]
    assert header["workload"]["overrides"] == quick_overrides("gpt") and run["quick"]
    assert run["reference"] == "fp32-eager" and run["aa_row"] == "fp32-eager#2"
    assert run["rounds"] == 2 and run["steps_per_round"] == [2, 2] and run["optimizer"]["fused"] is True
    assert set(header["peak"]["detail"]) >= {"fp32", "bf16"}
    assert all(len(d["loadavg"]) == 3 for d in header["peak"]["detail"].values())
    assert header["environment"]["matmul_peak_flops"] == header["peak"]["flops"]
    floor = header["ceiling"]["floors"]["fp32"]  # the GEMM floor, in every dtype a row computes in natively
    assert floor["seconds"] == pytest.approx(sum(g["calls"] * g["seconds_each"] for g in floor["gemms"]))
    assert floor["seconds"] > 0 and results["targets"] is None  # peers only: no turbotrain row to judge
    assert list(results["configs"]) == ["fp32-eager", "fp32-eager#2", "torch-amp", "always-fails"]
    assert results["configs"]["always-fails"]["status"] == "error"
    rows = results["rows"]
    assert rows and all(set(r) == ROW_KEYS for r in rows)
    by = {(r["config"], r["metric"]): r for r in rows}
    for config in ("fp32-eager", "fp32-eager#2", "torch-amp"):
        detail = results["configs"][config]
        assert detail["status"] == "ok" and detail["rounds"] == 2
        assert [len(r) for r in detail["round_seconds"]] == [2, 2] and len(detail["step_seconds"]) == 4
        assert len(detail["losses"]) == run["warmup"] + run["steps"]
        assert by[(config, "step_time")]["ratio_vs_ref"] > 0 and len(by[(config, "step_time")]["ratio_ci95"]) == 2
        assert detail["loss_check"]["passed"] is True
        # a CPU row's tensor peak: at least the weights, gradients and AdamW moments (16 bytes a
        # parameter in fp32), and below the resident memory, which holds them too
        params = sum(p.numel() for p in get_workload("gpt", **quick_overrides("gpt")).build_model().parameters())
        assert 16 * params <= detail["tensor_peak_bytes"] < detail["peak_memory_bytes"]
        assert by[(config, "tensor_peak")]["median"] == detail["tensor_peak_bytes"]
        split = detail["step_split"]  # a few more steps profiled: a GEMM model's step is mostly GEMMs
        assert split["gemm"] > 0 and split["optimizer"] > 0 and split["step"] >= split["gemm"] + split["optimizer"]
        assert detail["page_faults_per_step"] >= 0
    assert "max_memory_allocated" in header["tensor_memory_method"]
    assert by[("fp32-eager", "throughput")]["ratio_vs_ref"] == pytest.approx(1.0)
    assert by[("fp32-eager", "throughput")]["ratio_ci95"] == pytest.approx([1.0, 1.0])
    # the A/A twin is the same config in another process: the same seed, batches and kernels
    assert results["configs"]["fp32-eager#2"]["losses"] == pytest.approx(results["configs"]["fp32-eager"]["losses"],
                                                                         abs=1e-6)
    # bf16 autocast of the same weights on the same first batch: ~3 significant digits of ~9 nats
    assert results["configs"]["torch-amp"]["losses"][0] == pytest.approx(results["configs"]["fp32-eager"]["losses"][0],
                                                                         abs=0.05)


def test_the_tuned_row_is_compared_with_the_fastest_other_turbotrain_row():
    def row(seconds, group="turbotrain", ratio=1.0, jitter=(1.0, 1.02, 0.99, 1.01)):
        return {"status": "ok", "group": group, "ratio_vs_ref": ratio,
                "round_seconds": [[seconds * j] for j in jitter]}

    configs = {"torch-compile-step": row(1.0, "peer"), "tt-fused": row(0.9, ratio=1.11),
               "tt-bf16-master": row(1.2, ratio=0.83), "tt-tuned": row(0.9, jitter=(1.02, 0.99, 1.0, 1.01))}
    (note,) = runner.tuned_row_notes({"configs": configs})
    assert "tt-fused:" in note and "not distinguishable" in note  # same median, rounds that disagree
    configs["tt-tuned"] = row(0.6)
    (note,) = runner.tuned_row_notes({"configs": configs})
    assert "1.500x" in note and note.endswith("faster")
    configs["tt-tuned"] = row(1.2)
    (note,) = runner.tuned_row_notes({"configs": configs})
    assert "0.750x" in note and note.endswith("slower")
    del configs["tt-tuned"]
    assert runner.tuned_row_notes({"configs": configs}) == []  # no tuned row: nothing to say


def test_the_peak_memory_cell_adds_the_tensor_peak_only_where_there_is_one():
    from turbotrain.bench.report import TABLE_COLUMNS, table_cells

    def config(**memory):
        metrics = {"step_time": {"median": 1.0, "p20": 0.9, "p80": 1.1}}
        metrics.update({k: {"median": v} for k, v in memory.items()})
        return {"status": "ok", "compute_dtype": "fp32", "metrics": metrics}

    column = TABLE_COLUMNS.index("peak mem")
    assert table_cells("cpu", config(peak_memory=3 * 2**20, tensor_peak=2**20), "tokens")[column] == "3 MiB (tensors 1)"
    assert table_cells("cuda", config(peak_memory=3 * 2**20), "tokens")[column] == "3 MiB"  # no stray mark


def test_a_failed_row_shows_one_line_of_its_error_and_keeps_the_whole_text():
    from turbotrain.bench.report import table_cells

    compiler = "\n".join(["In file included from vec.h:1:", "vec.h:243: warning: overflow [-Woverflow]"] * 2000)
    error = f"InductorError: CppCompileError: C++ compile error\n{compiler}\nk.cpp:34:30: error: conflicting declaration"
    config = {"status": "error", "error": error}
    cell = table_cells("tt-fused-compile", config, "tokens")[2]
    assert cell == "InductorError: CppCompileError: C++ compile error | k.cpp:34:30: error: conflicting declaration"
    assert config["error"] == error  # results.json keeps every line
    assert len(table_cells("row", {"status": "error", "error": "x" * 5000}, "tokens")[2]) == 240
    assert table_cells("row", {"status": "error", "error": "worker died: exit 9"}, "tokens")[2] == "worker died: exit 9"

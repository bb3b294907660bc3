import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from turbotrain.bench import configs as registry
from turbotrain.bench.flops import count_step_flops
from turbotrain.bench.report import SCHEMA, config_metrics, train_loss_window
from turbotrain.bench.runner import BASELINE, QUICK_OVERRIDES, _fit_to_hardware, _implausible_mfu, run_worker, slow_dtypes
from turbotrain.bench.stats import mfu, percentile, summarize
from turbotrain.bench.worker import RssSampler, WorkerSpec, fixed_batches, load_workload
from turbotrain.errors import ConfigError, UnknownWorkloadError

ROW_KEYS = {"workload", "config", "metric", "unit", "median", "p20", "p80", "device", "versions", "timestamp"}
QUICK_PAIR = ("fp32-eager", "torch-amp")

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


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """Register test-only configs in this process and in every worker it starts."""
    (tmp_path / "bench_test_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TURBOTRAIN_BENCH_PLUGINS", "bench_test_plugin")
    yield
    for name in ("always-fails", "hangs"):
        registry.unregister_config(name)


# ------------------------------------------------------------------------------------- registry
def test_builtin_rows_are_registered_in_ladder_order():
    names = [c.name for c in registry.list_configs()]
    expected = ["fp32-eager", "torch-amp", "torch-compile", "torch-compile-fp32", "tt-fp32", "tt-bf16-mixed",
                "tt-bf16-master", "tt-fp16-master", "tt-fused", "tt-fused-compile", "tt-fused-fp32",
                "tt-fused-compile-fp32"]
    assert names[: len(expected)] == expected
    assert {c.name for c in registry.list_configs(group="peer")} == {"fp32-eager", "torch-amp", "torch-compile",
                                                                      "torch-compile-fp32"}


def test_default_set_depends_on_device():
    # fp16 matmul on CPU is emulated, so the fp16 row is opt-in there and default on CUDA
    assert "tt-fp16-master" not in registry.default_configs("cpu")
    assert "tt-fp16-master" in registry.default_configs("cuda")
    assert registry.default_configs("cpu")[0] == BASELINE


def _env(**gflops):
    return {"matmul_peak_flops": {d: v * 1e9 for d, v in gflops.items()}}


def test_rows_declare_their_matmul_dtype():
    assert registry.get_config("fp32-eager").dtype_on("cpu") == "fp32"
    assert registry.get_config("torch-amp").dtype_on("cpu") == "bf16"
    assert registry.get_config("torch-amp").dtype_on("cuda") == "fp16"
    assert registry.get_config("tt-bf16-master").dtype_on("cuda") == "bf16"
    assert registry.get_config("tt-fused-compile-fp32").dtype_on("cpu") == "fp32"
    with pytest.raises(ConfigError, match="dtype 'int8'"):
        registry.register_config("bad-dtype", "bad", lambda w, d: None, dtype="int8")


def test_emulated_bf16_swaps_default_rows_for_fp32_twins():
    # a CPU without native bf16 (seen here: bf16 4 GFLOP/s, fp32 164): bf16 rows would take ~40x longer
    env = _env(fp32=164.0, bf16=4.1)
    assert slow_dtypes(env) == pytest.approx({"bf16": 40.0})
    notes = []
    names = _fit_to_hardware(registry.default_configs("cpu"), env, "cpu", default=True, notes=notes)
    assert names == ["fp32-eager", "torch-compile-fp32", "tt-fp32", "tt-fused-fp32", "tt-fused-compile-fp32"]
    assert all(registry.get_config(n).dtype_on("cpu") == "fp32" for n in names)
    assert "40x slower" in notes[0] and "torch-amp" in notes[0] and "tt-fused -> tt-fused-fp32" in notes[0]


def test_rows_named_explicitly_run_on_slow_bf16_with_a_note():
    notes = []
    names = _fit_to_hardware(["fp32-eager", "torch-amp"], _env(fp32=164.0, bf16=4.1), "cpu", default=False,
                             notes=notes)
    assert names == ["fp32-eager", "torch-amp"]
    assert "torch-amp run as asked" in notes[0]


def test_fast_bf16_keeps_the_default_ladder():
    notes = []
    default = registry.default_configs("cpu")
    assert _fit_to_hardware(default, _env(fp32=195.0, bf16=864.0), "cpu", default=True, notes=notes) == default
    assert notes == []


def test_register_decorator_duplicate_and_bad_names():
    @registry.register_config("test-row", "a test row", default=("cuda",), group="test")
    def build(workload, device):
        return None

    try:
        config = registry.get_config("test-row")
        assert config.build is build and config.group == "test"
        assert not config.is_default_on("cpu") and config.is_default_on("cuda")
        with pytest.raises(ConfigError, match="already registered"):
            registry.register_config("test-row", "again", build)
        registry.register_config("test-row", "replaced", build, replace=True)
        assert registry.get_config("test-row").description == "replaced"
    finally:
        registry.unregister_config("test-row")
    for bad in ("has space", "a,b", ""):
        with pytest.raises(ConfigError):
            registry.register_config(bad, "bad", build)
    with pytest.raises(ConfigError, match="'cpu' or 'cuda'"):
        registry.register_config("bad-device", "bad", build, default=("tpu",))


def test_unknown_config_lists_valid_names():
    with pytest.raises(UnknownWorkloadError, match="fp32-eager, torch-amp"):
        registry.get_config("fp64-eager")


def test_make_optimizer_uses_the_shared_settings():
    opt = registry.make_optimizer(nn.Linear(2, 2).parameters())
    group = opt.param_groups[0]
    for key, value in registry.OPTIMIZER_SETTINGS.items():
        assert group[key] == value


# ---------------------------------------------------------------------------------------- stats
@pytest.mark.parametrize("n", [1, 2, 5, 20, 123])
def test_percentiles_match_numpy(n):
    values = torch.rand(n, generator=torch.Generator().manual_seed(n)).tolist()
    for q in (0, 20, 50, 80, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)
    s = summarize(values)
    assert (s.p20, s.median, s.p80, s.n) == pytest.approx(tuple(np.percentile(values, [20, 50, 80])) + (n,))


def test_stats_reject_bad_input():
    with pytest.raises(ConfigError, match="--steps"):
        summarize([])
    with pytest.raises(ConfigError):
        percentile([1.0], 120)
    with pytest.raises(ConfigError):
        mfu(1.0, 0.0, 1.0)


# ----------------------------------------------------------------------------------- flops / MFU
def test_flop_count_of_a_linear_layer():
    n, d_in, d_out = 8, 16, 4
    batch = (torch.randn(n, d_in), torch.randn(n, d_out))
    flops = count_step_flops(lambda: nn.Linear(d_in, d_out, bias=False), lambda out, t: (out - t).pow(2).mean(), batch)
    # forward x @ W.T, backward dW only (inputs need no grad): 2 matmuls of 2*n*d_in*d_out FLOPs
    assert flops == 2 * (2 * n * d_in * d_out)


def test_mfu_and_derived_metrics_on_known_numbers():
    header = {
        "workload": {"unit": "tokens", "items_per_step": 1000},
        "flops_per_step": 4e9,
        "environment": {"matmul_peak_flops": {"fp32": 1e10, "bf16": 4e10}},
    }
    steps = [1.0, 2.0, 3.0, 4.0, 5.0]
    row = {"step_seconds": steps, "losses": [9.0, 8.0, 7.0, 6.0, 5.0, 4.0], "val_loss": 4.4,
           "peak_memory_bytes": 123, "compute_dtype": "fp32"}
    base = {"status": "ok", "step_seconds": [6.0], "val_loss": 4.0}
    m = config_metrics(header, row, base)
    assert m["step_time"]["median"] == 3.0
    assert m["mfu"]["median"] == pytest.approx(4e9 / 3.0 / 1e10)
    assert m["mfu_bf16"]["median"] == pytest.approx(4e9 / 3.0 / 4e10)
    # where bf16 is emulated (slower than fp32) a fraction of its peak means nothing: left out
    slow_bf16 = dict(header, environment={"matmul_peak_flops": {"fp32": 1e10, "bf16": 1e9}})
    assert "mfu_bf16" not in config_metrics(slow_bf16, row, base)
    # a rate's p20 comes from the step time's p80 (slower steps, fewer tokens/s)
    assert m["throughput"]["p20"] == pytest.approx(1000 / np.percentile(steps, 80))
    assert m["throughput"]["p80"] == pytest.approx(1000 / np.percentile(steps, 20))
    assert m["speedup"]["median"] == pytest.approx(2.0)
    assert m["val_loss_delta"]["median"] == pytest.approx(10.0)
    window = train_loss_window(len(steps))
    assert m["train_loss"]["median"] == pytest.approx(sum(row["losses"][-window:]) / window)
    assert m["peak_memory"]["median"] == 123


def test_mfu_above_one_is_flagged():
    results = {"configs": {"fast": {"compute_dtype": "bf16", "metrics": {"mfu": {"median": 1.4}}},
                           "fine": {"compute_dtype": "fp32", "metrics": {"mfu": {"median": 0.4}}},
                           "failed": {"status": "error"}}}
    notes = _implausible_mfu(results)
    assert len(notes) == 1 and "fast" in notes[0] and "--remeasure" in notes[0]


# --------------------------------------------------------------------------------------- worker
def test_fixed_batches_are_identical_across_calls():
    workload = load_workload("gpt", QUICK_OVERRIDES["gpt"])
    first, second = (fixed_batches(workload, "val", 2, seed=0, device="cpu") for _ in range(2))
    for (x1, y1), (x2, y2) in zip(first, second):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_rss_sampler_sees_an_allocation():
    size = 64 * 2**20
    with RssSampler(interval=0.001) as rss:
        block = torch.ones(size // 4)  # fp32: touches every page
        del block
    assert rss.peak - rss.baseline >= 0.9 * size


def _spec(config: str) -> WorkerSpec:
    return WorkerSpec(workload="gpt", config=config, device="cpu", steps=1, warmup=0, val_batches=1,
                      overrides=QUICK_OVERRIDES["gpt"], threads=1)


def test_failing_row_reports_its_message(plugin, tmp_path):
    result = run_worker(_spec("always-fails"), tmp_path, timeout=120)
    assert result["status"] == "error"
    assert "RuntimeError: feature X is not here yet" in result["error"]


def test_hanging_row_is_killed_at_timeout(plugin, tmp_path):
    result = run_worker(_spec("hangs"), tmp_path, timeout=6)
    assert result["status"] == "error" and "timed out after 6 s" in result["error"]


# ------------------------------------------------------------------------------------------ CLI
def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "turbotrain.cli", *args], capture_output=True, text=True,
                          env=env, timeout=240)


@pytest.mark.parametrize("flag, value, listed", [("--configs", "fp32-eager,nope", "tt-fp32"),
                                                 ("--workload", "nope", "gpt")])
def test_unknown_names_fail_in_one_line(flag, value, listed, tmp_path):
    proc = _cli("bench", flag, value, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'nope'" in lines[0] and listed in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `turbotrain bench --quick` with two peer rows and one failing row, via the real CLI."""
    tmp = tmp_path_factory.mktemp("quick")
    (tmp / "bench_test_plugin.py").write_text(PLUGIN)
    env = {**os.environ, "TURBOTRAIN_BENCH_PLUGINS": "bench_test_plugin",
           "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
    out = tmp / "out"
    proc = _cli("bench", "--quick", "--configs", ",".join((*QUICK_PAIR, "always-fails")), "--out", str(out), env=env)
    return proc, out


def test_quick_run_writes_reports(quick_run):
    proc, out = quick_run
    assert proc.returncode == 0, proc.stderr  # one failed row does not fail the ladder
    assert "always-fails" in proc.stderr
    for name in ("results.json", "report.html", "throughput.png", "speedup.png", "memory.png", "loss.png"):
        assert (out / name).stat().st_size > 0
    html = (out / "report.html").read_text()
    assert html.count("<img") == 4 and "fp32-eager" in html and "feature X is not here yet" in html
    assert proc.stdout.index("matmul peak") < proc.stdout.index("fp32-eager")  # environment first


def test_quick_results_schema(quick_run):
    _, out = quick_run
    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == SCHEMA
    header = results["header"]
    assert {"timestamp", "workload", "run", "environment", "versions", "flops_per_step", "flop_conventions",
            "notes"} <= set(header)
    assert header["workload"]["overrides"] == QUICK_OVERRIDES["gpt"] and header["run"]["quick"]
    assert any("quick mode" in n for n in header["notes"])
    assert list(results["configs"]) == [*QUICK_PAIR, "always-fails"]
    assert results["configs"]["always-fails"]["status"] == "error"
    rows = results["rows"]
    assert rows and all(set(r) == ROW_KEYS for r in rows)
    assert {r["config"] for r in rows} == set(QUICK_PAIR)
    by = {(r["config"], r["metric"]): r for r in rows}
    for config in QUICK_PAIR:
        for metric in ("step_time", "throughput", "speedup", "peak_memory", "mfu", "train_loss",
                       "val_loss", "val_loss_delta", "achieved_flops"):
            assert (config, metric) in by, (config, metric)
        assert ((config, "mfu_bf16") in by) == ("bf16" not in slow_dtypes(header["environment"]))
        detail = results["configs"][config]
        assert len(detail["losses"]) == header["run"]["warmup"] + header["run"]["steps"]
        assert len(detail["step_seconds"]) == header["run"]["steps"]
        assert detail["peak_memory_bytes"] > 0
    assert by[(BASELINE, "speedup")]["median"] == pytest.approx(1.0)
    assert by[(BASELINE, "val_loss_delta")]["median"] == pytest.approx(0.0)
    assert results["configs"]["torch-amp"]["compute_dtype"] == "bf16"
    # same seed and batches: the first step's loss (before any update) agrees up to bf16 autocast
    # rounding of the logits (~3 significant digits of a ~9-nat loss)
    first = [results["configs"][c]["losses"][0] for c in QUICK_PAIR]
    assert first[0] == pytest.approx(first[1], abs=0.05)

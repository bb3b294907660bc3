import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

from turbotrain.bench import configs as registry
from turbotrain.bench.flops import Gemm, GemmRecorder, count_step_flops, profile_step
from turbotrain.bench.report import config_metrics, train_loss_window
from turbotrain.bench.runner import BASELINE, _fit_to_hardware, quick_overrides, _implausible_mfu, slow_dtypes
from turbotrain.bench.stats import mfu, percentile, summarize
from turbotrain.bench.worker import RssSampler, fixed_batches, load_workload
from turbotrain.errors import ConfigError, UnknownWorkloadError


# ------------------------------------------------------------------------------------- registry
def test_builtin_rows_are_registered_in_ladder_order():
    names = [c.name for c in registry.list_configs()]
    expected = ["fp32-eager", "torch-amp", "torch-compile", "torch-compile-fp32", "torch-compile-step",
                "torch-compile-step-fp32", "tt-fp32", "tt-bf16-mixed", "tt-bf16-master", "tt-fp16-master", "tt-fused",
                "tt-fused-compile", "tt-fused-fp32", "tt-fused-compile-fp32"]
    assert names[: len(expected)] == expected
    assert {c.name for c in registry.list_configs(group="peer")} == {
        "fp32-eager", "torch-amp", "torch-compile", "torch-compile-fp32", "torch-compile-step", "torch-compile-step-fp32"}
    reference = registry.get_config(registry.REFERENCE)
    assert reference.group == "peer" and reference.is_default_on("cpu") and reference.is_default_on("cuda")
    assert reference.dtype_on("cuda") == reference.dtype_on("cpu") == "bf16"
    assert registry.get_config(reference.fp32_twin).dtype_on("cpu") == "fp32"


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
    assert names == ["fp32-eager", "torch-compile-fp32", "torch-compile-step-fp32", "tt-fp32", "tt-fused-fp32",
                     "tt-fused-compile-fp32"]
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
    for bad in ("has space", "a,b", "", "a#2"):
        with pytest.raises(ConfigError):
            registry.register_config(bad, "bad", build)
    with pytest.raises(ConfigError, match="loss_tolerance"):
        registry.register_config("bad-tolerance", "bad", build, loss_tolerance=0)
    with pytest.raises(ConfigError, match="'cpu' or 'cuda'"):
        registry.register_config("bad-device", "bad", build, default=("tpu",))


def test_unknown_config_lists_valid_names():
    with pytest.raises(UnknownWorkloadError, match="fp32-eager, torch-amp"):
        registry.get_config("fp64-eager")


def test_make_optimizer_uses_the_shared_settings():
    opt = registry.make_optimizer(nn.Linear(2, 2).parameters())
    group = opt.param_groups[0]
    for key, value in {**registry.OPTIMIZER_SETTINGS, **registry.OPTIMIZER_IMPLEMENTATION}.items():
        assert group[key] == value
    assert group["fused"] is True


def _tiny_workload():
    return load_workload("gpt", dict(d=32, n_layer=1, n_head=2, T=16, B=2))


@pytest.mark.parametrize("name", [c.name for c in registry.list_configs() if c.group in ("peer", "turbotrain")])
def test_every_row_steps_the_ladders_one_optimizer(name, tmp_path, monkeypatch):
    """No row is credited with another's optimizer: peers and Engine rows alike step a fused AdamW
    with the shared settings (building is cheap: compilation waits for the first step)."""
    from turbotrain import Config
    from turbotrain.tune.row import TUNED_ENV, TUNED_ROW

    if name == TUNED_ROW:  # the row of `bench --config-file`: a Config from a file
        (tmp_path / "tuned.json").write_text(json.dumps(Config(precision="fp32", accumulate=2).to_dict()))
        monkeypatch.setenv(TUNED_ENV, str(tmp_path / "tuned.json"))
    trainer = registry.get_config(name).build(_tiny_workload(), "cpu")
    optimizer = trainer.optimizer
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["fused"] is True and optimizer.defaults["foreach"] is None
    for key, value in registry.OPTIMIZER_SETTINGS.items():
        assert optimizer.defaults[key] == value


def test_rows_declare_a_val_loss_tolerance_by_dtype():
    assert registry.get_config("fp32-eager").tolerance_on("cpu") == registry.LOSS_TOLERANCE["fp32"]
    assert registry.get_config("tt-bf16-master").tolerance_on("cpu") == registry.LOSS_TOLERANCE["bf16"] == 1.0
    registry.register_config("loose-row", "a row with its own tolerance", lambda w, d: None, loss_tolerance=3.0,
                             group="test")
    try:
        assert registry.get_config("loose-row").tolerance_on("cuda") == 3.0
    finally:
        registry.unregister_config("loose-row")


def test_an_instance_row_names_its_config():
    assert registry.config_of("torch-compile-step#2") == "torch-compile-step"
    assert registry.get_config("torch-compile-step#2").name == "torch-compile-step"
    assert registry.resolve_names(["fp32-eager", "fp32-eager#2"]) == ["fp32-eager"]


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


def test_step_gemms_are_recorded_with_their_layouts():
    n, d_in, d_out = 8, 16, 4
    batch = (torch.randn(n, d_in), torch.randn(n, d_out))
    profile = profile_step(lambda: nn.Linear(d_in, d_out, bias=False), lambda out, t: (out - t).pow(2).mean(), batch)
    # forward: x (n x d_in) @ W.T (W is d_out x d_in, contiguous); backward dW = grad.T @ x
    assert set(profile.gemms) == {Gemm(n, d_in, d_out, b_transposed=True), Gemm(d_out, n, d_in, a_transposed=True)}
    assert profile.flops == sum(g.flops for g in profile.gemms)
    with GemmRecorder() as rec:
        torch.bmm(torch.randn(3, 5, 7), torch.randn(3, 7, 2))
    assert list(rec.calls) == [Gemm(5, 7, 2, batch=3)] and Gemm(5, 7, 2, batch=3).flops == 2 * 3 * 5 * 7 * 2


def test_flops_of_a_dict_batch_use_the_models_own_loss():
    class OwnLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(6, 3, bias=False)

        def forward(self, input_ids, labels):
            return type("Out", (), {"loss": (self.proj(input_ids) - labels).pow(2).mean()})()

    batch = {"input_ids": torch.randn(4, 6), "labels": torch.randn(4, 3)}
    assert count_step_flops(OwnLoss, None, batch) == 2 * (2 * 4 * 6 * 3)


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
    assert len(notes) == 1 and "fast" in notes[0] and "TURBOTRAIN_REMEASURE=1" in notes[0]


# --------------------------------------------------------------------------------------- worker
def test_fixed_batches_are_identical_across_calls():
    workload = load_workload("gpt", quick_overrides("gpt"))
    first, second = (fixed_batches(workload, "val", 2, seed=0, device="cpu") for _ in range(2))
    for (x1, y1), (x2, y2) in zip(first, second):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_rss_peak_sees_an_allocation_freed_before_it_is_read():
    size = 64 * 2**20
    with RssSampler() as rss:
        assert rss.kernel_peak, "this Linux kernel should keep a resettable high-water mark"
        block = torch.ones(size // 4)  # fp32: touches every page
        del block  # glibc unmaps a block this large at once: only the high-water mark remembers it
        assert rss.rss() - rss.baseline < 0.5 * size
    assert rss.peak - rss.baseline >= 0.9 * size


def test_paused_rss_peak_ignores_what_happened_before_resume():
    with RssSampler() as rss:
        rss.pause()
        before = rss.peak
        block = torch.ones(2**24)  # 64 MiB while paused ...
        del block  # ... and gone before resume: not this command's memory
        assert rss.peak == before
        rss.resume()  # resets the kernel's mark to what is resident now
        assert rss.peak - rss.baseline < 32 * 2**20
        block = torch.ones(2**24)
        assert rss.peak - rss.baseline >= 0.9 * block.numel() * 4


def test_rss_sampler_thread_where_the_kernel_keeps_no_resettable_mark(monkeypatch):
    from turbotrain.bench import worker

    monkeypatch.setattr(worker, "_kernel_peak_available", lambda: False)
    with RssSampler(interval=0.001) as rss:
        assert rss.method == "1 ms sampling"
        block = torch.ones(2**24)
        # held until sampled (at most 5 s: a loaded machine may not schedule the sampler at once)
        deadline = time.monotonic() + 5
        while rss.peak - rss.baseline < 0.9 * block.numel() * 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert rss.peak - rss.baseline >= 0.9 * block.numel() * 4
        rss.pause()
        peak = rss.peak
        more = torch.ones(2**25)  # 128 MiB while paused: not sampled
        time.sleep(0.02)
        assert rss.peak == peak
        del block, more


def test_count_step_ops_counts_every_aten_call_with_the_shared_counter():
    from turbotrain.bench.worker import count_step_ops

    class Trainer:
        def __init__(self):
            self.model = nn.Linear(4, 3)

        def step(self, batch):
            self.model(batch).sum().backward()

    class Every(torch.utils._python_dispatch.TorchDispatchMode):  # the plainest counter: one per dispatch
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Every.calls += 1
            return func(*args, **(kwargs or {}))

    batch, trainer = torch.randn(2, 4), Trainer()
    with Every():
        trainer.step(batch)
    assert count_step_ops(Trainer(), batch) == Every.calls > 0


# ------------------------------------------------------------------------------------------ CLI
def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "turbotrain.cli", *args], capture_output=True, text=True,
                          env=env, timeout=240)


@pytest.mark.parametrize("flag, value, listed", [("--configs", "fp32-eager,nope", "tt-fp32"),
                                                 ("--reference", "nope", "torch-compile-step"),
                                                 ("--workload", "nope", "gpt")])
def test_unknown_names_fail_in_one_line(flag, value, listed, tmp_path):
    proc = _cli("bench", flag, value, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'nope'" in lines[0] and listed in lines[0]
    assert lines[0].startswith("turbotrain bench: error: ")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written

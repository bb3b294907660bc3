import contextlib
import doctest
import json
import os

import pytest
import torch

from turbotrain import hardware
from turbotrain.errors import ConfigError, HardwareError
from turbotrain.hardware import (
    CPU_FEATURES,
    HardwareInfo,
    detect,
    measure_matmul_peak,
    measure_memory_bandwidth,
    parse_cpuinfo,
    recommend_precision,
)

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile
processor\t: 1
model name\t: some other model
flags\t\t: fpu
"""


def _info(**changes) -> HardwareInfo:
    base = dict(device="cpu", cpu_model="test", cpu_count=2, torch_threads=2, cpu_features=())
    return HardwareInfo(**{**base, **changes})


def test_parse_cpuinfo_reads_first_processor():
    model, flags = parse_cpuinfo(CPUINFO)
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"amx_bf16", "amx_tile", "avx512_bf16", "avx2"} <= flags
    assert parse_cpuinfo("") == (None, frozenset())


def test_detect_cpu_describes_this_machine():
    info = detect("cpu")
    assert info.device == "cpu" and info.cuda_capability is None
    assert set(info.cpu_features) <= set(CPU_FEATURES)
    assert info.torch_threads == torch.get_num_threads()
    assert {"python", "torch", "rich", "tokenizers"} <= set(info.versions)
    assert json.loads(json.dumps(info.to_dict()))["device"] == "cpu"


@pytest.mark.parametrize(
    "changes, precision, named",
    [
        ({"device": "cuda", "cuda_capability": (9, 0)}, "bf16-master", "9.0"),
        ({"device": "cuda", "cuda_capability": (8, 0)}, "bf16-master", "8.0"),
        ({"device": "cuda", "cuda_capability": (7, 5)}, "fp16-master", "7.5"),
        ({"device": "cuda", "cuda_capability": (6, 1)}, "fp32", "6.1"),
        ({"cpu_features": ("amx_bf16", "amx_tile", "avx512f")}, "bf16-master", "amx_bf16"),
        ({"cpu_features": ("avx512_bf16", "avx512f", "avx2")}, "bf16-master", "avx512_bf16"),
        ({"cpu_features": ("avx512f", "avx2")}, "fp32", "avx512_bf16"),
    ],
)
def test_recommend_precision_rule(changes, precision, named):
    got, reason = recommend_precision(_info(**changes))
    assert got == precision
    assert named in reason


def _fake_cuda(monkeypatch, capability, *, has_switch=True):
    """torch.cuda as seen on a GPU of ``capability`` where bf16 works emulated below 8.0."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext(current.append(d)))

    def is_bf16_supported(including_emulation=True):
        return including_emulation or capability >= (8, 0)

    def old_is_bf16_supported():  # a torch without the including_emulation switch
        return True

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported if has_switch else old_is_bf16_supported)
    return current


@pytest.mark.parametrize("capability, native", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
@pytest.mark.parametrize("has_switch", [True, False])
def test_cuda_bf16_native_refuses_emulated_bf16(monkeypatch, capability, native, has_switch):
    _fake_cuda(monkeypatch, capability, has_switch=has_switch)
    assert torch.cuda.is_bf16_supported()  # torch's own answer counts emulation: True everywhere
    assert hardware.cuda_bf16_native() is native


def test_cuda_bf16_native_asks_the_given_device_and_needs_cuda(monkeypatch):
    current = _fake_cuda(monkeypatch, (8, 6))
    assert hardware.cuda_bf16_native("cuda:1") and current == ["cuda:1"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not hardware.cuda_bf16_native()


def scripted_trials(monkeypatch, *per_layout):
    """hardware.timed_trials returns the given per-call seconds, one list per call (layout)."""
    script = iter(per_layout)
    monkeypatch.setattr(hardware, "timed_trials", lambda fn, device, trials, trial_seconds, *a: list(next(script)))


def test_matmul_peak_is_the_fastest_trial_of_either_layout_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))
    monkeypatch.delenv("TURBOTRAIN_REMEASURE", raising=False)
    # the faster layout's fastest trial counts, not a median (a busy trial only slows the median)
    scripted_trials(monkeypatch, [0.9, 0.5, 3.0], [0.7, 0.6, 0.8], [0.3, 0.4], [2.0, 0.25])
    n = 64
    assert measure_matmul_peak("fp32", "cpu", size=n) == 2 * n**3 / 0.5
    assert measure_matmul_peak(torch.float32, "cpu", size=n) == 2 * n**3 / 0.5  # from the cache
    assert measure_matmul_peak("fp32", "cpu", size=n, force=True) == 2 * n**3 / 0.25
    assert (tmp_path / "peaks.json").exists()


def test_timed_trials_reports_seconds_per_call_of_each_trial():
    calls = []
    trials = hardware.timed_trials(lambda: calls.append(1), "cpu", trials=3, trial_seconds=0.0)
    assert len(trials) == 3 and all(t >= 0 for t in trials)
    assert len(calls) == 2 + 3  # a warm-up call, a sizing call, then one call per trial (0 s to fill)


def test_remeasure_env_forces_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))
    scripted_trials(monkeypatch, [1.0], [1.5], [2.0], [2.5])
    first = measure_matmul_peak("bf16", "cpu", size=32)
    monkeypatch.setenv("TURBOTRAIN_REMEASURE", "1")
    assert measure_matmul_peak("bf16", "cpu", size=32) == first / 2


def test_peak_cache_is_per_cpu_feature_set(tmp_path, monkeypatch):
    # two machines with the same model name, one with native bf16 matmul, must not share a bf16 peak
    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))
    monkeypatch.delenv("TURBOTRAIN_REMEASURE", raising=False)
    monkeypatch.setattr(hardware, "timed_trials", lambda *a: [1.0])
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("AMD EPYC", frozenset({"avx2", "avx512f", "avx512_bf16"})))
    measure_matmul_peak("bf16", "cpu", size=16)
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("AMD EPYC", frozenset({"avx2"})))
    measure_matmul_peak("bf16", "cpu", size=16)
    keys = json.loads((tmp_path / "peaks.json").read_text())
    assert len(keys) == 2
    assert any("avx512_bf16" in k for k in keys) and any("|avx2|" in k for k in keys)


def test_real_measurements_are_positive(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))
    peak = measure_matmul_peak("fp32", "cpu", size=64, seconds=0.01, use_cache=False)
    assert 0 < peak < float("inf")
    bandwidth = measure_memory_bandwidth("cpu", nbytes=2**20, seconds=0.01)
    assert 0 < bandwidth < float("inf")


def test_bandwidth_counts_read_and_write(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(hardware, "_median_seconds", lambda fn, device, seconds: 0.5)
    assert measure_memory_bandwidth("cpu", nbytes=2**20, force=True) == 2 * 2**20 / 0.5


def test_bad_dtype_and_device_raise():
    with pytest.raises(ConfigError, match="fp32"):
        measure_matmul_peak("int8", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(HardwareError, match="--device cpu"):
            detect("cuda")


def fast_measures(monkeypatch):
    monkeypatch.setattr(hardware, "_median_seconds", lambda fn, device, seconds: 1e-3)
    monkeypatch.setattr(hardware, "timed_trials", lambda *a: [1e-3])


def test_env_cli_json(tmp_path, monkeypatch, capsys):
    from turbotrain.cli import main

    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))
    fast_measures(monkeypatch)
    assert main(["env", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["matmul_peak_flops"]) == {"fp32", "bf16", "fp16"}
    assert (report["recommended_precision"], report["recommended_precision_reason"]) == recommend_precision(detect("cpu"))
    assert report["memory_bandwidth_bytes_per_s"] > 0


def test_env_cli_text_names_precision_and_reason(tmp_path, monkeypatch, capsys):
    from turbotrain.cli import main

    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))
    fast_measures(monkeypatch)
    assert main(["env", "--device", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    precision, reason = recommend_precision(detect("cpu"))
    assert f"recommended precision {precision}: {reason}" in out
    assert "matmul peak" in out and "bandwidth" in out


def test_env_remeasure_drops_the_ladder_peak_cache(tmp_path, monkeypatch, capsys):
    from turbotrain.bench.peak import CACHE_FILE
    from turbotrain.cli import main

    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))
    fast_measures(monkeypatch)
    (tmp_path / CACHE_FILE).write_text("{}")
    assert main(["env", "--json", "--device", "cpu"]) == 0
    assert (tmp_path / CACHE_FILE).exists()  # without --remeasure the ladder's cache stays
    assert main(["env", "--json", "--device", "cpu", "--remeasure"]) == 0
    assert not (tmp_path / CACHE_FILE).exists()


def test_malloc_env_is_in_the_environment_report(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))
    fast_measures(monkeypatch)
    for key in hardware.TUNED_MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    assert hardware.environment_report("cpu", dtypes=("fp32",))["malloc_env"] == {}
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # set by hand in the shell: recorded too
    assert hardware.environment_report("cpu", dtypes=("fp32",))["malloc_env"] == {"MALLOC_ARENA_MAX": "2"}


def test_bench_malloc_tuned_sets_what_every_worker_inherits(monkeypatch):
    from turbotrain.bench import runner
    from turbotrain.cli import main

    for key in hardware.TUNED_MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    seen = {}

    def fake_ladder(settings, out):  # workers are started with the parent's environment (Popen's default)
        seen.update(hardware.malloc_env())
        return {"configs": {"row": {"status": "ok"}}}

    monkeypatch.setattr(runner, "run_ladder", fake_ladder)
    monkeypatch.setattr(os, "environ", os.environ.copy())  # the CLI's update stays inside this test
    assert main(["bench", "--malloc-tuned", "--configs", "fp32-eager"]) == 0
    assert seen == hardware.TUNED_MALLOC_ENV


_CHURN = """
import resource, sys, torch
from turbotrain.hardware import tune_malloc

def faults_of_churn():  # a 48 MiB buffer (above glibc's largest mmap threshold) allocated, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        buffer = torch.ones(48 * 2**20 // 4)
        del buffer
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

untuned = faults_of_churn()
applied = tune_malloc()
faults_of_churn()  # the first one after tuning comes from the heap, faulted in once
print(untuned, applied, faults_of_churn())
"""


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="glibc's mallopt: Linux")
def test_tune_malloc_keeps_freed_buffers_mapped_in_the_running_process():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # an untuned process to start from
    out = subprocess.run([sys.executable, "-c", _CHURN], env=env, capture_output=True, text=True, check=True).stdout
    untuned, applied, tuned = out.split()
    pages = 48 * 2**20 // 4096
    assert applied == "True"
    assert int(untuned) >= 5 * pages // 2  # each allocation is a fresh mapping: its pages fault in again
    assert int(tuned) < pages // 4  # the same churn reuses the pages the heap kept


def test_docstring_examples_run():
    assert doctest.testmod(hardware).failed == 0


@pytest.mark.parametrize("environ, spinning", [
    ({"OMP_WAIT_POLICY": "active"}, True), ({"OMP_WAIT_POLICY": " Active "}, True),
    ({"OMP_WAIT_POLICY": "passive"}, False), ({}, False),
    ({"GOMP_SPINCOUNT": "300000"}, False), ({"GOMP_SPINCOUNT": "301k"}, True), ({"GOMP_SPINCOUNT": "1M"}, True),
    ({"GOMP_SPINCOUNT": "INFINITY"}, True), ({"GOMP_SPINCOUNT": "100"}, False), ({"GOMP_SPINCOUNT": "lots"}, False),
    ({"KMP_BLOCKTIME": "1"}, False), ({"KMP_BLOCKTIME": "0"}, False), ({"KMP_BLOCKTIME": "500us"}, False),
    ({"KMP_BLOCKTIME": "200"}, True), ({"KMP_BLOCKTIME": "2ms"}, True), ({"KMP_BLOCKTIME": "1s"}, True),
    ({"KMP_BLOCKTIME": "infinite"}, True),
])
def test_spinning_omp_env_names_what_keeps_idle_threads_spinning(environ, spinning):
    assert hardware.spinning_omp_env({**environ, "OMP_NUM_THREADS": "2"}) == (environ if spinning else {})


@pytest.mark.parametrize("runtime, environ, spinning", [
    ("intel", {}, {"KMP_BLOCKTIME": "unset (intel OpenMP's default, 200 ms)"}),
    ("llvm", {}, {"KMP_BLOCKTIME": "unset (llvm OpenMP's default, 200 ms)"}),
    ("intel", {"KMP_BLOCKTIME": "1"}, {}), ("gnu", {}, {}), (None, {}, {}),
])
def test_an_unset_blocktime_spins_under_intel_and_llvm_openmp(runtime, environ, spinning):
    assert hardware.spinning_omp_env(environ, runtime=runtime) == spinning


def test_openmp_runtime_names_the_one_torch_loaded():
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc/self/maps on this OS")
    assert hardware.openmp_runtime() in ("gnu", "intel", "llvm")  # torch's CPU build links one


def test_the_interleaved_rounds_refuse_spinning_idle_threads(tmp_path, monkeypatch):
    # the one place every ladder (bench, compare, tune) starts its waiting workers
    from turbotrain.bench.interleave import run_interleaved

    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    with pytest.raises(ConfigError, match="OMP_WAIT_POLICY=active keeps idle OpenMP threads spinning"):
        run_interleaved({}, [1], tmp_path, 1.0)
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert run_interleaved({}, [1], tmp_path, 1.0) == {}


def test_turbotrain_env_says_when_idle_openmp_threads_spin(tmp_path, monkeypatch, capsys):
    from turbotrain.cli import main

    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))
    fast_measures(monkeypatch)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert main(["env", "--device", "cpu"]) == 0
    assert "OpenMP idle threads" not in capsys.readouterr().out
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert main(["env", "--device", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "OpenMP idle threads spin (OMP_WAIT_POLICY=active): turbotrain bench and tune refuse" in out
    assert hardware.environment_report("cpu", dtypes=("fp32",))["spinning_omp_env"] == {"OMP_WAIT_POLICY": "active"}

"""The targets verdict and the GEMM-floor ceiling every ladder prints (bench/ceiling.py)."""

from __future__ import annotations

import pytest

from turbotrain.bench import ceiling, peak
from turbotrain.bench.ceiling import TARGETS, check_targets, measure_floor, target_lines
from turbotrain.bench.flops import Gemm, profile_step
from turbotrain.bench.report import build_results


def _header(T=256, floors=None):
    return {"timestamp": "t", "versions": {"torch": "x"}, "flops_per_step": 1e11,
            "workload": {"name": "gpt", "unit": "tokens", "items_per_step": 100, "settings": {"T": T}},
            "environment": {"matmul_peak_flops": {"fp32": 1e11, "bf16": 4e11}},
            "run": {"device": "cpu", "reference": "torch-compile-step-fp32", "aa_row": None},
            "ceiling": {"floors": floors if floors is not None else {"fp32": {"seconds": 1.0, "gemms": []}}}}


def _row(seconds, val_loss=4.0, tensors=100, rounds=6, jitter=(1.0, 1.01, 0.99, 1.02, 0.98, 1.0)):
    return {"status": "ok", "compute_dtype": "fp32", "round_seconds": [[seconds * j] for j in jitter[:rounds]],
            "step_seconds": [seconds * j for j in jitter[:rounds]], "losses": [8.0] * rounds, "val_loss": val_loss,
            "peak_memory_bytes": 10 * tensors, "tensor_peak_bytes": tensors, "rounds": rounds}


def _verdict(raw, **header):
    results = build_results(_header(**header), raw)
    return check_targets(results), results


def _checks(verdict):
    return {c["name"]: c for c in verdict["checks"]}


def test_a_row_that_meets_every_target_is_met():
    # 1e11 FLOPs in 1.2 s at a 1e11 peak: 83% MFU; 1.6 / 1.2 = 1.33x the reference
    verdict, _ = _verdict({"fp32-eager": _row(2.0), "torch-compile-step-fp32": _row(1.6, tensors=100),
                           "tt-fused-compile-fp32": _row(1.2, tensors=60)}, T=1024)
    checks = _checks(verdict)
    assert verdict["row"] == "tt-fused-compile-fp32"
    assert [checks[n]["met"] for n in ("speed", "mfu", "loss", "memory")] == [True, True, True, True]
    assert checks["memory"]["value"].startswith("0.60x (tensor peak)")


def test_the_speed_target_needs_the_ratio_and_an_interval_above_one():
    verdict, _ = _verdict({"torch-compile-step-fp32": _row(1.6), "tt-fused-compile-fp32": _row(1.4)})
    checks = _checks(verdict)
    assert checks["speed"]["met"] is False and checks["speed"]["value"].startswith("1.14x")
    assert checks["mfu"]["met"] is False  # 1e11 / 1.4 s = 71% of the peak
    assert checks["loss"]["met"] is None  # no fp32 row ran: not judged, and not passed either


def test_a_row_that_failed_its_loss_check_is_not_the_best_row():
    raw = {"fp32-eager": _row(2.0, val_loss=4.0), "torch-compile-step-fp32": _row(1.6),
           "tt-bf16-mixed": _row(0.5, val_loss=5.0), "tt-fused-compile-fp32": _row(1.5)}
    raw["tt-bf16-mixed"]["compute_dtype"] = "bf16"
    verdict, results = _verdict(raw)
    assert results["configs"]["tt-bf16-mixed"]["status"] == "FAILED"
    assert verdict["row"] == "tt-fused-compile-fp32"
    assert any("tt-bf16-mixed" in n for n in verdict["notes"])


def test_memory_is_judged_only_at_long_sequences_and_names_a_row_that_meets_it():
    raw = {"torch-compile-step-fp32": _row(1.6, tensors=100), "tt-fused-compile-fp32": _row(1.4, tensors=90),
           "tt-ckpt-blocks-fused-ce-compile-fp32": _row(1.7, tensors=50)}
    short = _checks(_verdict(raw, T=256)[0])["memory"]
    assert short["met"] is None and "T=1024" in short["why"] and short["value"].startswith("0.90x")
    long = _checks(_verdict(raw, T=1024)[0])["memory"]
    assert long["met"] is False and "tt-ckpt-blocks-fused-ce-compile-fp32 meets it (0.50x)" in long["why"]


def test_the_memory_verdict_names_the_lean_row_to_add_when_none_ran():
    raw = {"torch-compile-step-fp32": _row(1.6, tensors=100), "tt-fused-compile-fp32": _row(1.4, tensors=90)}
    short = _checks(_verdict(raw, T=256)[0])["memory"]
    assert "--set T=1024 --configs tt-ckpt-selective-fused-ce-compile-fp32," in short["why"]
    long = _checks(_verdict(raw, T=1024)[0])["memory"]
    assert long["met"] is False and "add tt-ckpt-selective-fused-ce-compile-fp32 with --configs" in long["why"]
    # it ran and still missed: nothing to add
    raw["tt-ckpt-selective-fused-ce-compile-fp32"] = _row(1.5, tensors=80)
    assert _checks(_verdict(raw, T=1024)[0])["memory"]["why"] == ""


def test_the_ceiling_is_the_reference_step_over_the_gemm_floor():
    raw = {"torch-compile-step-fp32": _row(1.6), "tt-fused-compile-fp32": _row(1.5)}
    verdict, _ = _verdict(raw, floors={"fp32": {"seconds": 1.4, "gemms": []}})
    rows = verdict["ceiling"]["rows"]
    assert rows["tt-fused-compile-fp32"]["ceiling_vs_ref"] == pytest.approx(1.6 / 1.4)
    assert rows["torch-compile-step-fp32"]["rest_seconds"] == pytest.approx(0.2)
    text = "\n".join(target_lines(verdict))
    assert "ceiling: 1.14x" in text and "out of reach of any schedule" in text
    # a floor low enough: the target is not ruled out, and the lines say what the rest may cost
    verdict, _ = _verdict(raw, floors={"fp32": {"seconds": 1.0, "gemms": []}})
    text = "\n".join(target_lines(verdict))
    assert "out of reach" not in text and f"needs a step of {1.6 / TARGETS.speed:.3f} s: 0.280 s" in text


def test_no_turbotrain_row_means_no_verdict():
    assert _verdict({"torch-compile-step-fp32": _row(1.6), "torch-amp": _row(1.0)})[0] is None


@pytest.fixture
def scripted_gemms(monkeypatch, tmp_path):
    """peak.measure_gemm returns the FLOP/s trials the test scripts, by shape label."""
    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))
    monkeypatch.delenv("TURBOTRAIN_REMEASURE", raising=False)
    speeds = {}
    monkeypatch.setattr(peak, "measure_gemm", lambda g, *a: speeds[g.label])
    return speeds


def test_the_floor_sums_every_shape_times_its_calls(scripted_gemms):
    a, b = Gemm(8, 4, 2), Gemm(4, 4, 4, b_transposed=True)
    scripted_gemms.update({a.label: [10.0, 40.0, 20.0], b.label: [64.0]})
    floor = measure_floor([(a, 3), (b, 2)], "fp32", "cpu", probe=100.0)
    assert floor["seconds"] == pytest.approx(3 * 128 / 40.0 + 2 * 128 / 64.0)  # the best trial of each
    assert [g["calls"] for g in floor["gemms"]] == [3, 2]


def test_a_busy_run_cannot_raise_the_floor_but_a_faster_machine_resets_it(scripted_gemms, monkeypatch):
    a = Gemm(8, 4, 2)
    scripted_gemms[a.label] = [40.0]
    assert measure_floor([(a, 1)], "fp32", "cpu", probe=100.0)["gemms"][0]["flops_per_s"] == 40.0
    scripted_gemms[a.label] = [25.0]  # something else shared the CPU this time
    assert measure_floor([(a, 1)], "fp32", "cpu", probe=95.0)["gemms"][0]["flops_per_s"] == 40.0
    scripted_gemms[a.label] = [30.0]  # the probe is 20% above the cached one: the machine changed
    assert measure_floor([(a, 1)], "fp32", "cpu", probe=120.0)["gemms"][0]["flops_per_s"] == 30.0
    scripted_gemms[a.label] = [20.0]
    monkeypatch.setenv("TURBOTRAIN_REMEASURE", "1")  # asked to forget the cache
    assert measure_floor([(a, 1)], "fp32", "cpu", probe=120.0)["gemms"][0]["flops_per_s"] == 20.0


def test_a_row_faster_than_the_floor_is_flagged():
    verdict, _ = _verdict({"torch-compile-step-fp32": _row(1.6), "tt-fused-compile-fp32": _row(1.5)},
                          floors={"fp32": {"seconds": 1.55, "gemms": []}})
    assert any("faster than the GEMM floor" in n and "tt-fused-compile-fp32" in n for n in verdict["notes"])


def test_the_step_profile_keeps_every_gemm_with_its_calls(monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("TURBOTRAIN_CACHE", str(tmp_path))

    torch.manual_seed(0)
    model = lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    batch = (torch.randn(5, 8), torch.randint(0, 4, (5,)))
    step = profile_step(model, torch.nn.functional.cross_entropy, batch, max_gemms=1)
    assert len(step.gemms) == 1 and step.gemms[0] == step.gemm_calls[0][0]
    # two Linears: forward (addmm) and the weight gradients; the input gradient only for the second
    assert sum(calls for _, calls in step.gemm_calls) == 5
    real = measure_floor(step.gemm_calls, "fp32", "cpu", settings=ceiling.PeakSettings(trials=2, trial_seconds=0.001))
    assert real["seconds"] > 0 and len(real["gemms"]) == len(step.gemm_calls)

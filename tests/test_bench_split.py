"""Where a row's step goes inside the step (bench/split.py), and how the verdict prints it."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from turbotrain.bench.ceiling import check_targets, target_lines
from turbotrain.bench.report import build_results
from turbotrain.bench.runner import _ratio_notes
from turbotrain.bench.split import profile_split, split_events
from turbotrain.hardware import page_faults


@dataclass
class Event:
    name: str
    self_cpu_time_total: float  # microseconds, as torch.profiler's FunctionEvent
    cpu_parent: "Event | None" = None


def test_events_fall_into_their_buckets_and_the_rest_is_what_they_leave():
    step = Event("Optimizer.step#AdamW.step", 1_000)
    events = [Event("aten::mm", 300_000), Event("aten::addmm", 100_000, Event("AddmmBackward0", 5)),
              Event("aten::_scaled_dot_product_flash_attention_for_cpu_backward", 50_000), step,
              Event("aten::_fused_adamw_", 20_000, step), Event("aten::mul_", 9_000, Event("x", 1, step)),
              Event("aten::gelu", 40_000)]
    split = split_events(events, wall_seconds=1.2, steps=2)
    assert split["gemm"] == pytest.approx(0.2)  # 0.4 s over two steps
    assert split["attention"] == pytest.approx(0.025)
    assert split["optimizer"] == pytest.approx(0.015)  # every op under Optimizer.step, however deep
    assert split["step"] == pytest.approx(0.6)
    assert split["rest"] == pytest.approx(0.6 - 0.2 - 0.025 - 0.015)


def test_a_real_step_is_split_into_its_gemms_attention_and_optimizer():
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(layer.parameters())
    x = torch.randn(4, 64, 256)

    def step():
        h = layer(x).view(4, 64, 4, 64).transpose(1, 2)
        loss = F.scaled_dot_product_attention(h, h, h, is_causal=True).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    split = profile_split(step, steps=2)
    assert split["gemm"] > 0 and split["attention"] > 0 and split["optimizer"] > 0
    measured = split["gemm"] + split["attention"] + split["optimizer"]
    assert measured < split["step"] and split["rest"] == pytest.approx(split["step"] - measured)


def test_page_faults_count_the_pages_a_fresh_mapping_touches():
    size = 64 * 2**20
    with mmap.mmap(-1, size) as fresh:  # anonymous: not one page of it is mapped until written
        fresh.madvise(mmap.MADV_NOHUGEPAGE)  # a fault a 4 KiB page, whatever the machine's THP setting
        before = page_faults()
        for offset in range(0, size, 4096):
            fresh[offset] = 1
        after = page_faults()
    assert after - before >= size // 4096 // 2  # 16k pages; a fault may map a few pages around it


def _results(split, faults, malloc_env=None):
    header = {"timestamp": "t", "versions": {"torch": "x"}, "flops_per_step": 1e11,
              "workload": {"name": "gpt", "unit": "tokens", "items_per_step": 100, "settings": {"T": 256}},
              "environment": {"matmul_peak_flops": {"fp32": 1e11}, "malloc_env": malloc_env or {}},
              "run": {"device": "cpu", "reference": "torch-compile-step-fp32", "aa_row": None},
              "ceiling": {"floors": {"fp32": {"seconds": 1.0, "gemms": []}}}}
    rows = {}
    for name, seconds in (("torch-compile-step-fp32", 1.6), ("tt-fused-fp32", 1.5)):
        rows[name] = {"status": "ok", "compute_dtype": "fp32", "round_seconds": [[seconds]] * 4,
                      "step_seconds": [seconds] * 4, "losses": [8.0] * 4, "val_loss": 4.0, "peak_memory_bytes": 1,
                      "tensor_peak_bytes": 1, "rounds": 4, "step_split": split, "page_faults_per_step": faults}
    return build_results(header, rows)


SPLIT = {"gemm": 1.3, "attention": 0.15, "optimizer": 0.01, "rest": 0.2, "step": 1.66}


def test_the_verdict_sets_the_gemms_in_the_step_against_their_floor():
    verdict = check_targets(_results(SPLIT, 30_000.0))
    assert verdict["ceiling"]["rows"]["tt-fused-fp32"]["split"] == SPLIT
    text = "\n".join(target_lines(verdict))
    assert "GEMMs 1.300 s (1.30x their floor), attention kernels 0.150 s" in text
    assert "30,000 page faults a measured step" in text and "--malloc-tuned" in text


def test_no_allocator_hint_when_it_is_already_tuned_or_the_faults_are_few():
    tuned = check_targets(_results(SPLIT, 30_000.0, malloc_env={"MALLOC_MMAP_MAX_": "0"}))
    few = check_targets(_results(SPLIT, 200.0))
    for verdict in (tuned, few):
        text = "\n".join(target_lines(verdict))
        assert "GEMMs 1.300 s" in text and "--malloc-tuned" not in text


def test_without_a_split_the_verdict_says_it_was_not_measured():
    text = "\n".join(target_lines(check_targets(_results(None, None))))
    assert "measured on CPU rows only" in text and "GEMMs 1.300" not in text


def _aa_results(faults, aa_faults, malloc_env=None):
    header = {"timestamp": "t", "versions": {"torch": "x"}, "flops_per_step": 1e11,
              "workload": {"name": "gpt", "unit": "tokens", "items_per_step": 100, "settings": {"T": 256}},
              "environment": {"matmul_peak_flops": {"fp32": 1e11}, "malloc_env": malloc_env or {}},
              "run": {"device": "cpu", "reference": "torch-compile-step-fp32", "aa_row": "torch-compile-step-fp32#2",
                      "rounds": 10}}
    rows = {}
    for name, seconds, count in (("torch-compile-step-fp32", 1.6, faults), ("torch-compile-step-fp32#2", 1.8, aa_faults)):
        rows[name] = {"status": "ok", "compute_dtype": "fp32", "round_seconds": [[seconds]] * 10,
                      "step_seconds": [seconds] * 10, "losses": [8.0] * 10, "val_loss": 4.0, "peak_memory_bytes": 1,
                      "tensor_peak_bytes": 1, "rounds": 10, "step_split": None, "page_faults_per_step": count}
    return build_results(header, rows)


def test_an_aa_pair_apart_in_page_faults_is_told_why():
    notes = _ratio_notes(_aa_results(24_596.0, 84_246.0))
    assert any("excludes 1.0" in n for n in notes)  # 1.6 s against 1.8 s in every round
    assert any("24,596 and 84,246 pages" in n and "--malloc-tuned" in n for n in notes)
    for quiet in (_aa_results(24_596.0, 30_000.0), _aa_results(300.0, 900.0),
                  _aa_results(24_596.0, 84_246.0, malloc_env={"MALLOC_MMAP_MAX_": "0"})):
        notes = _ratio_notes(quiet)
        assert any("excludes 1.0" in n for n in notes) and not any("pages a measured step" in n for n in notes)

"""Profiler: categories add up to the step, FLOPs are exact, the trace is valid, advice follows the data."""

import json
import math
import mmap
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from turbotrain.memory import apply_checkpointing
from turbotrain.profile import CATEGORIES, category_of_name, profile
from turbotrain.profile.advice import recommend

# Given rather than measured, so the tests do not benchmark the machine; the values only scale MFU.
PEAK_FLOPS, PEAK_BW = 1e11, 1e10


class StandInEngine:
    """What profile() needs of an Engine: .step(batch) and .model (engine.py is written elsewhere)."""

    def __init__(self, model, autocast_dtype=None, optimizer=torch.optim.AdamW):
        self.model = model
        self.optimizer = optimizer(model.parameters(), lr=1e-3)
        self.autocast_dtype = autocast_dtype

    def step(self, batch):
        x, y = batch
        ctx = torch.autocast("cpu", dtype=self.autocast_dtype) if self.autocast_dtype else torch.autocast("cpu", enabled=False)
        with ctx:
            out = self.model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


class Blocks(nn.Module):
    def __init__(self, d=32, hidden=64, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
                                    for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def batches(b=8, d=32):
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(b, d, generator=g), torch.randn(b, d, generator=g)


def test_categories_sum_to_step_time_and_outputs_are_valid(tmp_path):
    torch.manual_seed(0)
    report = profile(StandInEngine(Blocks()), batches(), steps=3, warmup=1, peak_flops=PEAK_FLOPS,
                     peak_bandwidth=PEAK_BW, out_dir=tmp_path)
    assert list(report.categories) == list(CATEGORIES)
    assert all(v >= 0 for v in report.categories.values())
    total = sum(report.categories.values())
    # idle/overhead is the remainder, so the sum can only miss when op self times overlap (double count).
    assert abs(total - report.step_time_s) <= 0.05 * report.step_time_s, report.categories
    assert report.categories["matmul"] > 0 and report.categories["optimizer"] > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["traceEvents"]
    page = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in page and "aten::addmm" in page
    assert json.loads((tmp_path / "profile.json").read_text())["steps"] == 3
    assert "2 FLOPs per multiply-add" in report.mfu_conventions and 0 < report.mfu < math.inf


def _mlp_flops(b, d, hidden, n):
    # Per Linear (in -> out): forward 2*b*in*out, grad of weight 2*b*in*out, grad of input 2*b*in*out,
    # except the very first Linear, whose input is the batch (no grad wanted, so no grad-input matmul).
    per_block = 3 * (2 * b * d * hidden + 2 * b * hidden * d)
    return n * per_block - 2 * b * d * hidden


@pytest.mark.parametrize("mode", [None, "blocks"])
def test_flops_are_exact_and_exclude_recompute(mode):
    model = Blocks()
    if mode:
        apply_checkpointing(model, mode)
    report = profile(StandInEngine(model), batches(), steps=1, warmup=0, peak_flops=PEAK_FLOPS,
                     peak_bandwidth=PEAK_BW)
    assert report.flops_per_step == _mlp_flops(8, 32, 64, 2)
    # Each block re-runs only its first Linear: checkpoint's early stop ends the replay once the
    # tensors backward needs exist, and the second Linear's output is not one of them.
    forward = 2 * (2 * 8 * 32 * 64)
    assert report.recompute_flops_per_step == (forward if mode else 0)
    addmm = next(r for r in report.ops if r.name == "aten::addmm")
    assert addmm.bytes > 0 and addmm.bound in ("compute", "memory")
    assert addmm.calls == 4 if mode is None else addmm.calls > 4  # the profiler sees recompute calls too


def test_autocast_weight_casts_are_measured_as_casts():
    # Autocast casts every Linear weight to bf16 each forward: the profile must find that time,
    # in the casts category, from the recorded _to_copy ops. How large a share it is depends on
    # the machine (bf16 matmul is emulated on AVX2-only CPUs), so the advice rule is tested
    # separately on given shares below.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    engine = StandInEngine(model, autocast_dtype=torch.bfloat16, optimizer=torch.optim.SGD)
    report = profile(engine, batches(b=1, d=512), steps=2, warmup=1, peak_flops=PEAK_FLOPS, peak_bandwidth=PEAK_BW)
    assert report.shares["casts"] > 0.0, report.categories
    copies = [r for r in report.ops if r.name == "aten::_to_copy"]
    assert copies and all(r.category == "casts" for r in copies)
    assert copies[0].calls >= 4  # at least one cast per weight per profiled step


def _given_report(**shares):
    return SimpleNamespace(shares={**dict.fromkeys(CATEGORIES, 0.0), **shares}, ops=[],
                           matmul_dtypes=("bfloat16",), mfu=0.5)


@pytest.mark.parametrize("casts, precision, expected", [
    (0.12, "bf16-mixed", True),     # over the 10% threshold: advise keeping the weights in bf16
    (0.08, "bf16-mixed", False),    # under it: not worth the change
    (0.30, "bf16-master", False),   # already on
])
def test_cast_advice_follows_the_share(casts, precision, expected):
    recs = recommend(_given_report(casts=casts), SimpleNamespace(precision=precision))
    advised = any(r.config == "Config(precision='bf16-master')" for r in recs)
    assert advised == expected, recs


def test_fp32_model_is_not_told_about_casts():
    report = profile(StandInEngine(Blocks()), batches(), steps=2, warmup=1, peak_flops=PEAK_FLOPS,
                     peak_bandwidth=PEAK_BW)
    assert not any("bf16-master" in r.config and "casts" in r.finding for r in report.recommendations)
    assert report.matmul_dtypes == ("float32",)


@pytest.mark.parametrize("name, category", [
    ("aten::addmm", "matmul"),
    ("autograd::engine::evaluate_function: MmBackward0", "matmul"),
    ("aten::native_layer_norm_backward", "norm"),
    ("aten::_log_softmax_backward_data", "loss"),
    ("aten::_to_copy", "casts"),
    ("Optimizer.step#AdamW.step", "optimizer"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::gelu_backward", "elementwise"),
    ("aten::_foreach_mul_", "elementwise"),
    ("gloo:all_reduce", "comm"),
    ("aten::view", None),
])
def test_category_of_name(name, category):
    assert category_of_name(name) == category


FRESH_BYTES = 48 * 2**20


class FreshBufferEngine(StandInEngine):
    """A step that also writes a freshly mapped 48 MiB buffer and unmaps it, what glibc does with a large
    tensor when untuned. (A torch tensor of that size would do it only in a young process: in a test run
    that has grown its heap, malloc may serve it from pages already mapped.)"""

    def step(self, batch):
        with mmap.mmap(-1, FRESH_BYTES) as fresh:
            fresh.madvise(mmap.MADV_NOHUGEPAGE)  # a fault a 4 KiB page, whatever the machine's THP setting
            for offset in range(0, FRESH_BYTES, mmap.PAGESIZE):
                fresh[offset] = 1
        return super().step(batch)


def test_page_faults_a_step_are_counted_and_advised_on():
    report = profile(FreshBufferEngine(Blocks()), batches(), steps=2, warmup=1, peak_flops=PEAK_FLOPS,
                     peak_bandwidth=PEAK_BW)
    assert report.page_faults_per_step >= FRESH_BYTES // mmap.PAGESIZE // 2  # the buffer's pages, every step
    assert "page faults/step" in str(report)
    assert any(r.config == "turbotrain.hardware.tune_malloc()" for r in report.recommendations)


@pytest.mark.parametrize("faults, advised", [(30_000, True), (300, False), (None, False)])
def test_page_fault_advice_follows_their_cost_against_the_step(faults, advised):
    report = _given_report()
    report.page_faults_per_step, report.step_time_s = faults, 1.6  # 30k faults at ~2 us: 60 ms, 3.8%
    recs = recommend(report, SimpleNamespace(precision="bf16-master"))
    assert any("tune_malloc" in r.config for r in recs) == advised, recs


@pytest.mark.parametrize("flags, advised", [(("avx2", "avx512_bf16"), "bf16-master"), (("avx2",), None)])
def test_fp32_matmul_advice_names_a_dtype_only_where_it_is_native(monkeypatch, flags, advised):
    from turbotrain import hardware

    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("test CPU", frozenset(flags)))
    report = _given_report(matmul=0.8)
    report.matmul_dtypes, report.device = ("float32",), "cpu"
    recs = [r for r in recommend(report, SimpleNamespace(precision="fp32")) if "matmuls run in FP32" in r.finding]
    assert [r.config for r in recs] == ([f"Config(precision='{advised}')"] if advised else [])


class CappedLM(nn.Module):
    """An LM whose loss sees soft-capped logits (as Gemma 2's does), or the head's output as it is."""

    def __init__(self, softcap: bool, vocab=64, d=16):
        super().__init__()
        self.softcap = softcap
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids))
        if self.softcap:
            logits = torch.tanh(logits / 30.0) * 30.0
        return SimpleNamespace(loss=nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits=logits)

    def get_output_embeddings(self):  # as transformers models name their head
        return self.head


def lm_batches(vocab=64):
    g = torch.Generator().manual_seed(0)
    while True:
        ids = torch.randint(0, vocab, (4, 8), generator=g)
        yield {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("softcap", [False, True])
def test_fused_loss_advice_only_where_the_fused_head_would_compute_the_models_loss(monkeypatch, softcap):
    """Where the loss transforms the logits before cross-entropy, the fused head cannot replace it:
    the profile says so instead of advising it, and the model and the random stream are left as they were."""
    from turbotrain import Config, Engine
    from turbotrain.profile import advice

    monkeypatch.setitem(advice.THRESHOLDS, "loss", 0.0)  # the advice's rule, whatever the loss's share here
    torch.manual_seed(0)
    model = CappedLM(softcap)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), config=Config(device="cpu"))
    report = profile(engine, lm_batches(), steps=1, warmup=1, peak_flops=PEAK_FLOPS, peak_bandwidth=PEAK_BW)
    advised = any("linear_cross_entropy" in r.config for r in report.recommendations)
    assert advised is not softcap, report.recommendations
    assert any("before the loss's log-softmax" in n for n in report.notes) is softcap, report.notes
    assert engine.module.head.__class__ is nn.Linear  # nothing was swapped in for the check


def test_fused_loss_advice_names_what_the_engine_rolled_back(monkeypatch):
    from turbotrain import Config, Engine
    from turbotrain.profile import advice

    monkeypatch.setitem(advice.THRESHOLDS, "loss", 0.0)
    model = CappedLM(softcap=True)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    config=Config(device="cpu", fuse=("linear_cross_entropy",)))
    report = profile(engine, lm_batches(), steps=1, warmup=1, peak_flops=PEAK_FLOPS, peak_bandwidth=PEAK_BW)
    assert any("not advised: the logits pass through Mul" in n for n in report.notes), report.notes


def test_no_lone_forward_is_run_for_the_advice_when_ranks_profile_together(monkeypatch):
    """Each rank decides from its own timings whether to check the head; a forward on one rank alone
    would hang on a sharded model's collectives, so across processes the check is not made."""
    from turbotrain import Config, Engine
    from turbotrain.fusion import loss_head
    from turbotrain.profile import advice, core

    monkeypatch.setitem(advice.THRESHOLDS, "loss", 0.0)
    model = CappedLM(softcap=True)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), config=Config(device="cpu"))
    monkeypatch.setattr(core, "_processes", lambda: 2)
    monkeypatch.setattr(loss_head, "loss_head_refusal", lambda *a, **k: pytest.fail("ran a forward on one rank"))
    report = profile(engine, lm_batches(), steps=1, warmup=1, peak_flops=PEAK_FLOPS, peak_bandwidth=PEAK_BW)
    assert not any("not advised" in n or "checking it failed" in n for n in report.notes), report.notes


def test_the_profile_command_profiles_the_ladders_optimizer_and_fuse_true(tmp_path, capsys):
    """``turbotrain profile`` steps the ladder's AdamW (fused), so its figures are of the step the
    bench times, and --fuse is Config(fuse=True) as the Engine resolves it."""
    import json

    from turbotrain.cli import main

    out = tmp_path / "prof"
    assert main(["-q", "profile", "--workload", "mlp", "--steps", "2", "--warmup", "1", "--fuse", "--out", str(out)]) == 0
    ops = {op["name"] for op in json.loads((out / "profile.json").read_text())["ops"]}
    assert "aten::_fused_adamw_" in ops
    assert (out / "report.html").exists() and "Profile on cpu: 2 steps" in capsys.readouterr().out

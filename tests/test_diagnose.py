"""The NaN finder names the module and cause of injected faults; the precision audit flags fragile layers."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from turbotrain.diagnose import find_nonfinite, nonfinite_flag
from turbotrain.diagnose import precision_audit


class LogFeatures(nn.Module):
    """log of a ReLU: -inf wherever the ReLU is 0 (the classic missing eps)."""

    def forward(self, x):
        return torch.log(F.relu(x))


class SqrtFeatures(nn.Module):
    """Finite forward, infinite derivative at 0: NaN appears only in backward."""

    def forward(self, x):
        # A multiplicative mask (not relu, whose backward selects) so the inf meets a 0: inf * 0 = NaN.
        return (x * (x > 0)).sqrt()


class TinyScale(nn.Module):
    """Scales down hard enough to underflow fp16, then takes a log: finite in FP32."""

    def forward(self, x):
        return torch.log((x * 1e-4) * (x * 1e-4) + 1e-30)


class Net(nn.Module):
    def __init__(self, middle: nn.Module | None = None, d=16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.act = nn.Tanh()
        self.middle = middle if middle is not None else nn.Identity()
        self.hidden = nn.Linear(d, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        return self.out(F.gelu(self.hidden(self.middle(self.act(self.inp(x))))))


def batch(d=16, n=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g).to(dtype), torch.randint(0, 4, (n,), generator=g)


def ce(logits, targets):
    return F.cross_entropy(logits.float(), targets)


def test_clean_model_reports_nothing_and_leaves_grads_alone():
    torch.manual_seed(0)
    net = Net()
    report = find_nonfinite(net, ce, batch())
    assert not report and "No inf/NaN" in str(report)
    assert all(p.grad is None for p in net.parameters())
    assert all(not p._backward_hooks for p in net.parameters())  # no hooks left behind


def test_inf_weight_is_found_before_running():
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.hidden.weight[3, 5] = float("inf")
    report = find_nonfinite(net, ce, batch())
    assert (report.phase, report.module_path, report.cause) == ("parameters", "hidden", "nonfinite-weights")
    assert report.nonfinite_parameters == ("hidden.weight",)
    assert "learning rate" in report.fix


def test_log_of_zero_names_the_module_and_op():
    torch.manual_seed(0)
    report = find_nonfinite(Net(LogFeatures()), ce, batch())
    assert (report.phase, report.module_path, report.module_class) == ("forward", "middle", "LogFeatures")
    assert report.cause == "log-of-zero" and report.op == "aten.log"
    assert report.inputs.frac_nonfinite == 0 and report.outputs.frac_nonfinite > 0
    assert "eps" in report.fix and "middle" in str(report)


def test_fp16_overflow_in_one_layer():
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.hidden.weight.mul_(2e5)  # weights stay < 65504 (max ~5e4) but the outputs reach ~1.7e5
    net = net.half()  # runs on CPU: fp16 matmuls are slow there but this model is tiny
    report = find_nonfinite(net, ce, batch(dtype=torch.float16))
    assert (report.phase, report.module_path, report.dtype) == ("forward", "hidden", "float16")
    assert report.cause == "fp16-overflow"
    assert report.fp32_max_abs > 65504 and report.inputs.frac_nonfinite == 0
    assert "FP32" in report.fix and "bf16" in report.fix


def test_fp16_underflow_then_log():
    report = find_nonfinite(Net(TinyScale()).half(), ce, batch(dtype=torch.float16))
    assert (report.module_path, report.cause) == ("middle", "underflow")


def test_nan_only_in_backward():
    torch.manual_seed(0)
    net = Net(SqrtFeatures())
    report = find_nonfinite(net, ce, batch())
    assert (report.phase, report.module_path, report.module_class) == ("backward", "middle", "SqrtFeatures")
    assert report.cause == "division-by-zero" and report.outputs.frac_nonfinite == 0
    assert report.grad_outputs.frac_nonfinite == 0 and report.grad_inputs.frac_nonfinite > 0
    assert report.inputs.frac_zero == 0 and "clamp" in report.fix


def test_functional_code_in_parent_is_blamed_on_the_parent():
    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return self.b(self.a(x) / torch.zeros(()))  # no child module did the division

    report = find_nonfinite(nn.Sequential(Parent()), ce_like_mse, (torch.randn(4, 16), torch.randn(4, 16)))
    assert (report.module_path, report.cause) == ("0", "division-by-zero")


def ce_like_mse(out, target):
    return F.mse_loss(out, target)


def test_loss_fn_is_blamed_when_the_model_is_finite():
    def bad_loss(out, targets):
        return torch.log(out - out).mean()

    report = find_nonfinite(Net(), bad_loss, batch())
    assert (report.phase, report.module_path, report.cause) == ("loss", "<loss_fn>", "log-of-zero")


def test_nonfinite_batch():
    x, y = batch()
    x[0, 0] = float("nan")
    report = find_nonfinite(Net(), ce, (x, y))
    assert (report.phase, report.cause) == ("input", "nonfinite-input")


@pytest.mark.parametrize("bad", [None, "loss", "fp32-grad", "bf16-grad"])
def test_nonfinite_flag(bad):
    loss = torch.tensor(float("inf") if bad == "loss" else 2.0)
    grads = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16), None]
    if bad == "fp32-grad":
        grads[0][1] = float("nan")
    if bad == "bf16-grad":
        grads[1][0] = float("-inf")
    flag = nonfinite_flag(loss, grads)
    assert flag.shape == () and flag.dtype == torch.bool
    assert bool(flag) is (bad is not None)


# precision audit ---------------------------------------------------------------------------


class OffsetCentering(nn.Module):
    """x + 4096 - 4096: exact in FP32 for small x, but bf16 keeps only 8 bits, so at 4096 the spacing
    is 32 and x is wiped out (catastrophic cancellation)."""

    def forward(self, x):
        return (x + 4096.0) - 4096.0


class OffsetLinear(nn.Module):
    """A Linear fed a large common offset, removed afterwards: under autocast the matmul rounds
    its bf16 input (spacing 2 near 256) and the small signal is lost."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x + 256.0) - self.lin(torch.full_like(x, 256.0))


class AuditNet(nn.Module):
    def __init__(self, fragile, d=32):
        super().__init__()
        self.first = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.fragile = fragile
        self.last = nn.Linear(d, d)

    def forward(self, x):
        return self.last(self.fragile(self.norm(self.first(x))))


@pytest.mark.parametrize("precision, fragile", [
    ("bf16-master", OffsetCentering()),
    ("bf16-mixed", OffsetLinear(32)),
])
def test_precision_audit_flags_only_the_fragile_layer(precision, fragile):
    torch.manual_seed(0)
    model = AuditNet(fragile)
    report = precision_audit(model, torch.randn(16, 32), precision)
    flagged = {row.path for row in report.rows if row.flagged}
    fragile_path = "fragile"  # OffsetLinear's child Linear is fine alone: the cancellation is the parent's
    assert flagged == {fragile_path}, str(report)
    # Normal layers: bf16 keeps ~8 bits, a single rounding gives ~45-55 dB; 30 leaves headroom.
    normal = [row for row in report.rows if not row.flagged and not row.contains_flagged]
    assert normal and all(row.sqnr_db > 30 for row in normal), str(report)
    assert report.keep_fp32 == [fragile_path]
    assert fragile_path in str(report) and "keep FP32" in str(report)
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is untouched


def test_precision_audit_fp32_is_exact():
    torch.manual_seed(0)
    report = precision_audit(AuditNet(OffsetCentering()), torch.randn(4, 32), "fp32")
    assert not report.keep_fp32 and all(row.rel_error == 0 for row in report.rows)

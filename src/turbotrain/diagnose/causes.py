"""Why a module went non-finite: replay it op by op, find the first bad op, name the cause and fix.

A module is replayed under a dispatch mode that looks at every aten op: the first op whose inputs
are all finite and whose output is not is where the inf/NaN is born. That op's name, its inputs
(zeros? negatives?) and its output recomputed in FP32 decide the cause.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .stats import FP16_MAX, all_finite, floating_tensors, map_floating

__all__ = ["FirstNonfiniteOp", "Diagnosis", "diagnose_op", "CAUSES"]

#: Every cause code a NonFiniteReport can carry.
CAUSES = ("nonfinite-weights", "nonfinite-input", "fp16-overflow", "underflow", "log-of-zero",
          "division-by-zero", "sqrt-of-negative", "overflow", "unknown")

_LOG_OPS = {"log", "log2", "log10", "log1p", "xlogy", "special_xlog1py", "log_"}
_DIV_OPS = {"div", "div_", "reciprocal", "reciprocal_", "rsqrt", "rsqrt_", "true_divide", "floor_divide"}
_POW_OPS = {"pow", "pow_"}
_SQRT_OPS = {"sqrt", "sqrt_"}
_CAST_OPS = {"_to_copy", "to", "copy_", "_convert_element_type", "clone"}
_LOW = (torch.float16, torch.bfloat16)


class FirstNonfiniteOp(TorchDispatchMode):
    """Records the first op that turns finite inputs into a non-finite output."""

    def __init__(self):
        super().__init__()
        self.func = None
        self.args = self.kwargs = self.out = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.func is None and floating_tensors(out) and not all_finite(out) and all_finite((args, kwargs)):
            self.func, self.args, self.kwargs, self.out = func, args, kwargs, out
        return out

    @property
    def name(self) -> str | None:
        return None if self.func is None else self.func.overloadpacket.__name__


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    explanation: str
    fix: str
    op: str | None = None
    fp32_max_abs: float | None = None


def _has(tensor, predicate) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and bool(predicate(tensor).any())


def _fp32_counterpart_max(mode: FirstNonfiniteOp) -> float | None:
    """Max |output| of the bad op recomputed in FP32, or None when that is not finite either."""
    if mode.name in _CAST_OPS:
        # A cast to fp16 overflows when its (finite) source is past fp16's range.
        ins = floating_tensors(mode.args)
        return max(float(t.detach().abs().max()) for t in ins) if ins else None
    widen = lambda t: t.detach().float()  # noqa: E731
    kwargs = {k: (torch.float32 if v in _LOW else v) for k, v in mode.kwargs.items()}
    try:
        with torch.no_grad():
            out = mode.func(*map_floating(mode.args, widen), **map_floating(kwargs, widen))
    except Exception:  # an op without an FP32 kernel for these arguments: no counterpart to show
        return None
    outs = floating_tensors(out)
    if not outs or not all_finite(outs):
        return None
    return max(float(t.abs().max()) for t in outs if t.numel())


def module_finite_in_fp32(module, args, kwargs) -> bool:
    """Whether the module's forward stays finite when run entirely in FP32 (no autocast)."""
    try:
        wide = copy.deepcopy(module).float()
        device_type = next((p.device.type for p in wide.parameters()), "cpu")
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            out = wide(*map_floating(args, lambda t: t.detach().float()),
                       **map_floating(kwargs, lambda t: t.detach().float()))
    except Exception:  # a module that cannot run in FP32 (dtype-specific code): no counterpart
        return False
    return all_finite(out)


def diagnose_op(mode: FirstNonfiniteOp, where: str, phase: str, fp32_module_finite: bool = False) -> Diagnosis:
    """Cause and fix for the op ``mode`` caught, inside the module called ``where``."""
    if mode.func is None:
        return Diagnosis("unknown", f"no single op in {where} turned finite inputs into inf/NaN on replay "
                         "(the fault may depend on randomness, e.g. dropout, or on in-place updates)",
                         f"replay the step with a fixed seed and inspect {where}; set Config(nan_check=True)")
    name, args = mode.name, mode.args
    out_dtype = next((t.dtype for t in floating_tensors(mode.out)), None)
    dtype_name = str(out_dtype).removeprefix("torch.")
    low = out_dtype in _LOW or any(t.dtype in _LOW for t in floating_tensors(args))
    fp32_max = _fp32_counterpart_max(mode)
    first = args[0] if args else None
    second = args[1] if len(args) > 1 else None
    op = f"aten.{name}"
    grad_note = " in backward: its derivative is infinite there" if phase == "backward" else ""

    def zero_cause(what, fix):
        if phase == "forward" and low and fp32_module_finite:
            return Diagnosis("underflow", f"values in {where} underflow to 0 in {dtype_name} and then reach "
                             f"{op} ({what}); in FP32 the module stays finite",
                             f"keep {where} in FP32, or {fix}", op, fp32_max)
        cause = "log-of-zero" if name in _LOG_OPS else "division-by-zero"
        return Diagnosis(cause, f"{op} in {where} receives {what}{grad_note}", fix, op, fp32_max)

    if name in _LOG_OPS and (_has(first, lambda t: t <= 0)):
        return zero_cause("zeros or negatives", "add an eps before the log: torch.log(x.clamp_min(1e-6)), or "
                          "use a log-space op (log_softmax, logsumexp) instead of log(softmax(x))")
    if name in _DIV_OPS:
        denominator = second if name in ("div", "div_", "true_divide", "floor_divide") else first
        if _has(denominator, lambda t: t == 0):
            return zero_cause("a zero denominator", "add an eps to the denominator (x / (y + 1e-6)) or "
                              "clamp it: y.clamp_min(1e-6)"
                              + ("; for sqrt/pow/log, clamp the module input away from 0" if phase == "backward" else ""))
    if name in _POW_OPS and _has(first, lambda t: t == 0):
        exponent = second if isinstance(second, (int, float)) else None
        if exponent is None or exponent < 0 or phase == "backward":
            return zero_cause("0 raised to a negative power", "clamp the base away from 0: x.clamp_min(1e-6).pow(p)")
    if name in _SQRT_OPS and _has(first, lambda t: t < 0):
        return Diagnosis("sqrt-of-negative", f"{op} in {where} receives negative values",
                         "clamp to >= 0 before the sqrt (x.clamp_min(0).sqrt()) or find why the value is negative",
                         op, fp32_max)
    if out_dtype == torch.float16 and fp32_max is not None and fp32_max > FP16_MAX:
        if phase == "backward":
            fix = ("scale the loss less: use dynamic loss scaling (precision='fp16-mixed') with a lower "
                   "LossScaleConfig(init_scale=...), or train in bf16 (precision='bf16-mixed')")
        else:
            fix = (f"keep {where} in FP32 (run it outside autocast, or keep its weights FP32), train in bf16 "
                   "(precision='bf16-mixed' or 'bf16-master'), or normalise its input so values stay small")
        return Diagnosis("fp16-overflow", f"{op} in {where} produces values up to {fp32_max:.4g} in FP32, "
                         f"past fp16's largest finite value {FP16_MAX:g}, so fp16 rounds them to inf", fix, op, fp32_max)
    if low and fp32_max is not None:
        return Diagnosis("overflow", f"{op} in {where} overflows in {dtype_name} but stays finite in FP32 "
                         f"(max |x| {fp32_max:.4g})", f"keep {where} in FP32", op, fp32_max)
    return Diagnosis("overflow", f"{op} in {where} overflows even in FP32 (finite inputs, inf/NaN output)",
                     "clamp its input, normalise before it (LayerNorm), use a stable form (logsumexp, "
                     "log_softmax), or lower the learning rate if the weights have grown", op, fp32_max)

"""The fusion transform: structural fused sites, and the fused linear+cross-entropy loss head."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ..config import FUSION_PATTERNS
from ..plan import ApplyContext, ModelPlan, Transform

__all__ = ["FusionTransform", "patterns_for"]

#: Why ``fuse=True`` fuses only the linear+cross-entropy head, by whether the step is compiled.
#: Measured on gpt (benchmarks/2026-12-02-gpt-ladder.md, fusion ablation, bf16 eager on a CPU;
#: benchmarks/2026-12-07-fuse-true.md, under compile).
_LEFT_OUT_WHY = {
    True: "Inductor fuses the elementwise work around each GEMM itself, a hand-fused op is opaque to it and "
          "the QKV slices break the graph; gpt on a CPU: every pattern 0.83x of the head alone",
    False: "one QKV GEMM is no faster than three and PyTorch's own elementwise kernels beat the fused "
           "epilogues; gpt in bf16: QKV 0.93x, Linear+GELU 0.95x of the unfused step",
}


def patterns_for(fuse, device: torch.device, compiled: bool) -> tuple[tuple[str, ...], Optional[str]]:
    """The fusion patterns ``Config(fuse=...)`` asks for on ``device``, and what ``fuse=True`` left out.

    A tuple is taken as given. True is every pattern for an eager step on a GPU (the Triton kernels)
    and the linear+cross-entropy head alone elsewhere, where the other patterns measured slower
    than leaving the step to PyTorch or Inductor; the second value says so (None when nothing was
    left out).

    >>> patterns_for(True, torch.device("cpu"), compiled=False)[0]
    ('linear_cross_entropy',)
    >>> patterns_for(("qkv",), torch.device("cpu"), compiled=True)
    (('qkv',), None)
    """
    if fuse is not True:
        return tuple(fuse), None
    if device.type == "cuda" and not compiled:
        return FUSION_PATTERNS, None
    kept = ("linear_cross_entropy",)
    left = ", ".join(p for p in FUSION_PATTERNS if p not in kept)
    where = "under torch.compile" if compiled else "on a CPU"
    return kept, (f"fuse=True {where}: linear_cross_entropy only; {left} left out ({_LEFT_OUT_WHY[compiled]}); "
                  "Config(fuse='all') or a tuple of pattern names fuses them anyway")


class FusionTransform(Transform):
    """``Config(fuse=...)``: every site of the named patterns, found from the first batch's data flow
    and verified in the run's precision before it is installed."""

    name = "fusion"
    needs_example = True

    def __init__(self, patterns: tuple[str, ...], left_out: Optional[str] = None):
        self.patterns = patterns
        self.left_out = left_out
        """What ``fuse=True`` left out on this device and why (patterns_for), or None."""
        self.report = None
        self.loss_head = None
        """LossHeadResult of the linear+cross-entropy head (None when that pattern is off)."""

    def apply(self, model: nn.Module, plan: ModelPlan, ctx: ApplyContext) -> None:
        from .loss_head import install_loss_head, linear_with_own_forward
        from .rewrite import fuse

        example = ctx.example
        context = ctx.forward_context or contextlib.nullcontext
        with context():
            self.report = fuse(model, patterns=self.patterns, verify=True, dtype=ctx.dtype,
                               example=(example.args, example.kwargs))
        plan.fused_from.update(self.report.param_map)
        # The plan has the map now; the report kept for describe() must not hold the stock tensors.
        self.report.param_map.clear()
        if "linear_cross_entropy" in self.patterns:
            if plan.head_path is None or linear_with_own_forward(plan.head):  # its F.linear call is answered
                self.loss_head, fused = self._functional_head(model, plan, ctx, context)
                plan.loss_head = fused
                if fused is not None and plan.head_path is None and plan.head is not None:
                    plan.head = fused  # keep_fp32_head's hook goes on the fused head
                # A Linear subclass stays plan.head: keep_fp32_head's hook hands its forward FP32 inputs, so
                # a cast of its weight to the input's dtype (CastedLinear) leaves the weight the call answered.
            else:
                self.loss_head, fused = install_loss_head(model, plan.head_path, ctx.loss_contract, example,
                                                          ctx.dtype, context)
                if fused is not None:
                    plan.loss_head = plan.head = fused
        plan.record_norms(model)  # fused LayerNorm+act modules hold norm parameters too

    def verify(self, model: nn.Module, plan: ModelPlan, ctx: ApplyContext) -> None:
        """A master-weight mode cast the model after apply() checked the fused head in FP32: check it
        again as it will run, and roll it back with the reason if it no longer matches."""
        fused = plan.loss_head
        if fused is None or self.loss_head is None or fused.weight.dtype == self.loss_head.checked_in:
            return
        from .loss_head import recheck_loss_head

        self.loss_head = recheck_loss_head(model, fused, self.loss_head, ctx.loss_contract, ctx.example,
                                           ctx.forward_context or contextlib.nullcontext)
        if not self.loss_head.fused:
            plan.loss_head = None
            if plan.head is fused:
                plan.head = fused.__dict__["_stock"]

    @staticmethod
    def _functional_head(model: nn.Module, plan: ModelPlan, ctx: ApplyContext, context):
        """The fused head for logits the model computes with ``F.linear`` on a Parameter no Linear holds, or
        in the forward of a Linear subclass that has its own (the FunctionalHead keep_fp32_head already
        found in ``plan.head``, else found here)."""
        from .loss_head import (NO_HEAD, LossHeadResult, functional_head_of, install_functional_loss_head,
                                own_forward_unanswered)

        head = plan.head if getattr(plan.head, "site", None) is not None else functional_head_of(model, ctx.example,
                                                                                                 context)
        if head is None:
            if plan.head_path is not None:
                return LossHeadResult(plan.head_path, False, own_forward_unanswered(plan.head)), None
            return LossHeadResult("<none>", False, NO_HEAD), None
        return install_functional_loss_head(model, head, ctx.loss_contract, ctx.example, ctx.dtype, context)

    def describe(self) -> str:
        note = "" if self.left_out is None else "\n" + self.left_out
        if self.report is None:
            return "fusion (not applied yet: it is applied at the first step, from that batch)" + note
        extra = ()
        if self.loss_head is not None:
            lh = self.loss_head
            grad = "head grad" if lh.grad_of == "weight" else "head input grad"
            dtype = f" in {str(lh.checked_in).removeprefix('torch.')}" if lh.checked_in is not None else ""
            how = "causal shift, " if lh.shift else "the loss's own cross-entropy call, " if lh.through_loss else ""
            detail = (f"{how}loss rel err {lh.loss_rel_error:.1e}, "
                      f"{grad} sqnr {lh.grad_sqnr_db:.1f} dB{dtype}" if lh.fused else lh.reason)
            extra = ((lh.path, "linear_cross_entropy", "fused" if lh.fused else "rolled back", detail),)
        return self.report.format(extra) + note

"""The fusion transform: structural fused sites, and the fused linear+cross-entropy loss head."""

from __future__ import annotations

import contextlib
import logging

from torch import nn

from ..plan import ApplyContext, ModelPlan, Transform

__all__ = ["FusionTransform"]

logger = logging.getLogger(__name__)


class FusionTransform(Transform):
    """``Config(fuse=...)``: every site of the named patterns, found from the first batch's data flow
    and verified in the run's precision before it is installed."""

    name = "fusion"
    needs_example = True

    def __init__(self, patterns: tuple[str, ...]):
        self.patterns = patterns
        self.report = None
        self.loss_head = None
        """LossHeadResult of the linear+cross-entropy head (None when that pattern is off)."""

    def apply(self, model: nn.Module, plan: ModelPlan, ctx: ApplyContext) -> None:
        from .loss_head import install_loss_head
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
            if plan.head_path is None:
                from .loss_head import NO_HEAD, LossHeadResult

                self.loss_head = LossHeadResult("<none>", False, NO_HEAD)
            else:
                self.loss_head, fused = install_loss_head(model, plan.head_path, ctx.loss_contract, example,
                                                          ctx.dtype, context)
                if fused is not None:
                    plan.loss_head = plan.head = fused
        plan.record_norms(model)  # fused LayerNorm+act modules hold norm parameters too
        logger.info("%s", self.describe())

    def describe(self) -> str:
        if self.report is None:
            return "fusion (not applied yet: it is applied at the first step, from that batch)"
        extra = ()
        if self.loss_head is not None:
            lh = self.loss_head
            detail = (f"{'causal shift, ' if lh.shift else ''}loss rel err {lh.loss_rel_error:.1e}, "
                      f"head grad sqnr {lh.grad_sqnr_db:.1f} dB" if lh.fused else lh.reason)
            extra = ((lh.path, "linear_cross_entropy", "fused" if lh.fused else "rolled back", detail),)
        return self.report.format(extra)

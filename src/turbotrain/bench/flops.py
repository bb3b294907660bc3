"""FLOPs of one training step, counted once per workload, the numerator of every MFU figure.

Conventions (printed in every report header): one fp32 forward + backward of a freshly built model
on one batch under torch.utils.flop_counter.FlopCounterMode; 2 FLOPs per multiply-add; only the ops
the counter knows (matmuls, convolutions, attention) are counted, elementwise ops and the optimizer
step are not; causal attention is counted as full attention (the counter does not discount the
masked half); recomputation (activation checkpointing) is excluded because the count is taken on
the plain model, so a row that recomputes does more work than it is credited with.
"""

from __future__ import annotations

from torch.utils.flop_counter import FlopCounterMode

__all__ = ["count_step_flops", "FLOP_CONVENTIONS"]

FLOP_CONVENTIONS = (
    "FlopCounterMode over one fp32 forward+backward; 2 FLOPs per multiply-add; matmul/conv/attention "
    "only; causal attention counted as full; recomputation excluded; optimizer step excluded"
)


def count_step_flops(build_model, loss_fn, batch) -> int:
    """FLOPs of forward + backward of ``build_model()`` on ``batch`` (on the batch's device, fp32)."""
    inputs, targets = batch
    model = build_model().to(inputs.device).float()
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(inputs), targets).backward()
    return int(counter.get_total_flops())

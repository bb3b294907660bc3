"""FLOPs of one training step, counted once per workload, the numerator of every MFU figure; and the
step's GEMM shapes, at which the denominator (the matmul peak, bench/peak.py) is measured.

Conventions (printed in every report header): one fp32 forward + backward of a freshly built model
on one batch under turbotrain.profile's OpCounter (torch.utils.flop_counter's formulas, the same
total FlopCounterMode gives); 2 FLOPs per multiply-add; only the ops
the counter knows (matmuls, convolutions, attention) are counted, elementwise ops and the optimizer
step are not; causal attention is counted as full attention (the counter does not discount the
masked half); recomputation (activation checkpointing) is excluded because the count is taken on
the plain model, so a row that recomputes does more work than it is credited with.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..profile.counting import OpCounter
from ..workloads.base import user_loss

__all__ = ["count_step_flops", "profile_step", "StepProfile", "Gemm", "GemmRecorder", "FLOP_CONVENTIONS"]

FLOP_CONVENTIONS = (
    "torch.utils.flop_counter formulas over one fp32 forward+backward; 2 FLOPs per multiply-add; matmul/conv/attention "
    "only; causal attention counted as full; recomputation excluded; optimizer step excluded"
)

_aten = torch.ops.aten


@dataclass(frozen=True)
class Gemm:
    """One matrix multiply shape: (batch of) (m x k) @ (k x n), with each operand's layout."""

    m: int
    k: int
    n: int
    batch: int = 1
    a_transposed: bool = False
    """The left operand is a transposed view of a contiguous (k x m) tensor."""
    b_transposed: bool = False
    """The right operand is a transposed view of a contiguous (n x k) tensor (nn.Linear's weight)."""

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n

    @property
    def label(self) -> str:
        lead = f"{self.batch}x" if self.batch > 1 else ""
        return (f"{lead}{self.m}x{self.k}{'.T' if self.a_transposed else ''}"
                f" @ {self.k}x{self.n}{'.T' if self.b_transposed else ''}")

    def to_dict(self) -> dict:
        return {"m": self.m, "k": self.k, "n": self.n, "batch": self.batch, "a_transposed": self.a_transposed,
                "b_transposed": self.b_transposed}


def _transposed(t: torch.Tensor) -> bool:
    return t.dim() >= 2 and t.shape[-1] > 1 and t.stride(-2) == 1 and t.stride(-1) == t.shape[-2]


class GemmRecorder(TorchDispatchMode):
    """Counts the GEMMs (mm, addmm, bmm, baddbmm) dispatched while it is active, by shape and layout."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[Gemm] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func._overloadpacket
        if packet in (_aten.mm, _aten.bmm):
            self._record(args[0], args[1])
        elif packet in (_aten.addmm, _aten.baddbmm):
            self._record(args[1], args[2])
        return func(*args, **(kwargs or {}))

    def _record(self, a: torch.Tensor, b: torch.Tensor) -> None:
        batch = a.shape[0] if a.dim() == 3 else 1
        self.calls[Gemm(a.shape[-2], a.shape[-1], b.shape[-1], batch, _transposed(a), _transposed(b))] += 1

    def largest(self, count: int) -> list[Gemm]:
        """The ``count`` shapes that account for the most FLOPs per step (shape FLOPs x calls)."""
        return sorted(self.calls, key=lambda g: (-g.flops * self.calls[g], g.label))[:count]


@dataclass(frozen=True)
class StepProfile:
    flops: int
    """FLOPs of one forward + backward (FLOP_CONVENTIONS)."""
    gemms: tuple[Gemm, ...]
    """The step's heaviest GEMM shapes, most FLOPs first (the peak is measured at these)."""
    gemm_calls: tuple[tuple[Gemm, int], ...] = ()
    """Every GEMM shape the step dispatched, with its number of calls, most FLOPs first (the
    ceiling's GEMM floor, bench/ceiling.py, times all of them)."""


def profile_step(build_model, loss_fn, batch, max_gemms: int = 4) -> StepProfile:
    """FLOPs and the ``max_gemms`` heaviest GEMM shapes of forward + backward of ``build_model()`` on
    ``batch`` (a pair with a loss_fn, or a dict batch with the model's own loss), fp32, on the
    batch's device."""
    device = _device_of(batch)
    model = build_model().to(device).float()
    with OpCounter() as counter, GemmRecorder() as gemms:
        user_loss(model, loss_fn, batch).backward()
    every = gemms.largest(len(gemms.calls))
    return StepProfile(int(counter.counts.flops), tuple(every[:max_gemms]),
                       tuple((g, gemms.calls[g]) for g in every))


def count_step_flops(build_model, loss_fn, batch) -> int:
    """FLOPs of forward + backward of ``build_model()`` on ``batch`` (on the batch's device, fp32)."""
    return profile_step(build_model, loss_fn, batch).flops


def _device_of(batch) -> torch.device:
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return first.device

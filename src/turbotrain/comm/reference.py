"""Plain single-process twins of every exchange in comm/, the oracles tests compare against.

Each function takes the per-rank inputs as a list (index = rank) and returns what every rank
should end up with, written as directly from the papers as possible: no buckets, no packing,
no collectives.
"""

from __future__ import annotations

import math

import torch

from .powersgd import matrix_shape, orthonormalise, should_compress

__all__ = ["exact_mean", "cast_mean", "ReferencePowerSGD", "reference_onebit_mean"]


def exact_mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The uncompressed data-parallel average, in fp64 so it is the ground truth."""
    return torch.stack([t.double() for t in tensors]).mean(0)


def cast_mean(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The bf16/fp16 hook's result: each rank's g/n rounded to ``dtype``, summed in ``dtype``."""
    n = len(tensors)
    total = torch.zeros_like(tensors[0], dtype=dtype)
    for t in tensors:
        total = total + (t / n).to(dtype)
    return total.float()


class ReferencePowerSGD:
    """PowerSGD over n simulated ranks for one parameter: warm-started Q, local error feedback."""

    def __init__(self, n: int, rank: int, warmup_steps: int, q0: torch.Tensor | None = None):
        self.n, self.rank, self.warmup_steps = n, rank, warmup_steps
        self.steps = 0
        self.q = q0
        self.errors: list[torch.Tensor] | None = None

    def step(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The averaged gradient every rank receives this step."""
        self.steps += 1
        shape = grads[0].shape
        if self.steps <= self.warmup_steps or not should_compress(shape, self.rank):
            return exact_mean(grads).float()
        rows, cols = matrix_shape(shape)
        ms = [g.reshape(rows, cols).float() for g in grads]
        if self.errors is not None:
            ms = [m + e for m, e in zip(ms, self.errors)]
        assert self.q is not None, "pass q0 (the hook's seeded Q) to compare step by step"
        p = orthonormalise(sum(m @ self.q for m in ms))
        q_locals = [m.t() @ p for m in ms]
        self.errors = [m - p @ q.t() for m, q in zip(ms, q_locals)]
        self.q = sum(q_locals)
        return (p @ self.q.t() / self.n).view(shape)


def _sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


def reference_onebit_mean(buffers: list[torch.Tensor], sizes: list[int], worker_errors: list[torch.Tensor],
                          server_errors: list[torch.Tensor]) -> torch.Tensor:
    """Error-compensated 1-bit mean (1-bit Adam, Alg. 1), updating the error lists in place.

    Worker i sends sign(x_i) * (||x_i|| / sqrt(numel)) per tensor of ``sizes``; server j (one
    per rank) averages chunk j, adds its error, and sends sign * one chunk scale.
    """
    n, total = len(buffers), buffers[0].numel()
    chunk = math.ceil(total / (n * 8)) * 8
    sent = []
    for i, buf in enumerate(buffers):
        x = buf + worker_errors[i]
        c = torch.cat([_sign(s) * (s.norm() / math.sqrt(s.numel())) for s in x.split(sizes)])
        worker_errors[i] = x - c
        sent.append(torch.cat([c, c.new_zeros(chunk * n - total)]))
    avg = torch.stack(sent).mean(0)
    valid = torch.arange(chunk * n) < total
    out = []
    for j in range(n):
        part = slice(j * chunk, (j + 1) * chunk)
        z, ok = avg[part] + server_errors[j], valid[part]
        scale = z[ok].norm() / math.sqrt(int(ok.sum())) if ok.any() else z.new_zeros(())
        c = torch.where(ok, _sign(z) * scale, 0.0)
        server_errors[j] = torch.where(ok, z - c, 0.0)
        out.append(c)
    return torch.cat(out)[:total]

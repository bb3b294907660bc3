"""Plain single-process twins of every exchange in comm/, the oracles tests compare against.

Each function takes the per-rank inputs as a list (index = rank) and returns what every rank
should end up with, written as directly from the papers as possible: no buckets, no packing,
no collectives, and nothing imported from the implementations they check.
"""

from __future__ import annotations

import math

import torch

__all__ = ["exact_mean", "cast_mean", "ReferencePowerSGD", "reference_onebit_mean", "ReferenceOneBitAdam"]


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
    """PowerSGD (Vogels et al. 2019, Alg. 1) over n simulated ranks for one parameter: warm-started
    Q, local error feedback. A tensor is compressed when it has >= 2 dims and its rank-r factors,
    viewed as rows x rest, hold fewer numbers than it does."""

    def __init__(self, n: int, rank: int, warmup_steps: int, q0: torch.Tensor | None = None):
        self.n, self.rank, self.warmup_steps = n, rank, warmup_steps
        self.steps = 0
        self.q = q0
        self.errors: list[torch.Tensor] | None = None

    def step(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The averaged gradient every rank receives this step."""
        self.steps += 1
        shape = grads[0].shape
        rows = shape[0] if len(shape) else 0
        cols = grads[0].numel() // rows if rows else 0
        r = min(self.rank, rows, cols)
        if self.steps <= self.warmup_steps or len(shape) < 2 or (rows + cols) * r >= rows * cols:
            return exact_mean(grads).float()
        ms = [g.reshape(rows, cols).float() for g in grads]
        if self.errors is not None:
            ms = [m + e for m, e in zip(ms, self.errors)]
        assert self.q is not None, "pass q0 (the hook's seeded Q) to compare step by step"
        p = torch.linalg.qr(sum(m @ self.q for m in ms)).Q
        q_locals = [m.t() @ p for m in ms]
        self.errors = [m - p @ q.t() for m, q in zip(ms, q_locals)]
        self.q = sum(q_locals)
        return (p @ self.q.t() / self.n).view(shape)


def _sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)  # the paper's sign with sign(0) = +1: every value gets a bit


def _compress_pieces(x: torch.Tensor, pieces: list[tuple[int, int]], keep: torch.Tensor) -> torch.Tensor:
    """C[x] = sign(x) * ||x|| / sqrt(d) on each piece separately, over the kept elements only."""
    out = torch.zeros_like(x)
    for a, b in pieces:
        part, ok = x[a:b], keep[a:b]
        d = int(ok.sum())
        scale = part[ok].norm() / math.sqrt(d) if d else part.new_zeros(())
        out[a:b] = torch.where(ok, _sign(part) * scale, 0.0)
    return out


def reference_onebit_mean(buffers: list[torch.Tensor], sizes: list[int], worker_errors: list[torch.Tensor],
                          server_error: torch.Tensor, masked: torch.Tensor | None = None) -> torch.Tensor:
    """Error-compensated 1-bit mean (1-bit Adam, Alg. 1), updating the errors in place.

    Worker i sends C[x_i], x_i = buffer_i + e_i, with one scale per tensor of ``sizes``. Server j
    owns positions [j c, (j+1) c) of the flat buffer (c: N / n rounded up to a multiple of 32), and
    sends C[z] of its average z (+ its error) with one scale per tensor piece in its chunk. The
    servers' chunks are disjoint, so ``server_error`` is one flat tensor. Positions in ``masked``
    are left out of everything and come back 0.
    """
    n, total = len(buffers), buffers[0].numel()
    keep = torch.ones(total, dtype=torch.bool)
    if masked is not None:
        keep[masked] = False
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    tensors = [(a, a + s) for a, s in zip(starts, sizes)]
    sent = []
    for i, buf in enumerate(buffers):
        x = torch.where(keep, buf + worker_errors[i], 0.0)
        c = _compress_pieces(x, tensors, keep)
        worker_errors[i] = x - c
        sent.append(c)
    z = torch.where(keep, torch.stack(sent).mean(0) + server_error, 0.0)
    chunk = math.ceil(total / (32 * n)) * 32
    pieces = [(max(a, j * chunk), min(b, (j + 1) * chunk)) for j in range(n) for a, b in tensors
              if max(a, j * chunk) < min(b, (j + 1) * chunk)]
    out = _compress_pieces(z, pieces, keep)
    server_error.copy_(z - out)
    return out


class ReferenceOneBitAdam:
    """1-bit Adam (Tang et al. 2021) over n simulated ranks, from the paper, parameter update included.

    Steps 1..warmup_steps: Adam (torch's bias corrections, decoupled weight decay) on the mean
    gradient. Then v is frozen with its bias correction at the last warm-up step, each rank's
    momentum takes its own gradient, and the momenta are averaged by ``reference_onebit_mean``.
    Specified choices the implementation has to match: tensors with < 2 dims or < ``min_numel``
    elements, and elements with v = 0 at the freeze, keep plain Adam on the exact mean gradient;
    every step of a compressed tensor after the freeze is clipped at the most Adam can step: by Cauchy-Schwarz on
    m = (1-b1) sum b1^k g and v = (1-b2) sum b2^k g^2, |m| / sqrt(v) <= (1-b1) / sqrt((1-b2)(1-b1^2/b2)).
    """

    def __init__(self, params: list[torch.Tensor], n: int, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, warmup_steps: int = 10, min_numel: int = 4096):
        self.params = [p.detach().float().clone() for p in params]
        self.n, self.lr, self.betas, self.eps, self.wd = n, lr, betas, eps, weight_decay
        self.warmup_steps, self.min_numel = warmup_steps, min_numel
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0
        self.compressed = [p.dim() >= 2 and p.numel() >= min_numel for p in self.params]
        self.masked_of: list[torch.Tensor] | None = None  # per parameter, set at the freeze
        total = sum(p.numel() for p, c in zip(self.params, self.compressed) if c)
        self.worker_errors = [torch.zeros(total) for _ in range(n)]
        self.server_error = torch.zeros(total)

    def step(self, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """``grads[i][k]``: rank i's gradient of parameter k. Returns the parameters after the step."""
        b1, b2 = self.betas
        self.t += 1
        t, tw = self.t, self.warmup_steps
        mean = [exact_mean([g[k] for g in grads]).float() for k in range(len(self.params))]
        frozen = t > tw
        comp = [k for k, c in enumerate(self.compressed) if c and frozen]
        for k in range(len(self.params)):
            if k not in comp:
                self.m[k] = b1 * self.m[k] + (1 - b1) * mean[k]
                self.v[k] = b2 * self.v[k] + (1 - b2) * mean[k] ** 2
        if comp:
            flat_mask = torch.cat([self.masked_of[k] for k in comp])
            locals_ = [torch.cat([(b1 * self.m[k] + (1 - b1) * g[k]).reshape(-1) for k in comp]) for g in grads]
            synced = reference_onebit_mean(locals_, [self.params[k].numel() for k in comp], self.worker_errors,
                                           self.server_error, torch.nonzero(flat_mask).reshape(-1))
            at = 0
            for k in comp:
                size = self.params[k].numel()
                exact_m = b1 * self.m[k] + (1 - b1) * mean[k]
                mask = self.masked_of[k].view_as(self.m[k])
                self.m[k] = torch.where(mask, exact_m, synced[at:at + size].view_as(self.m[k]))
                self.v[k] = torch.where(mask, b2 * self.v[k] + (1 - b2) * mean[k] ** 2, self.v[k])
                at += size
        for k, p in enumerate(self.params):
            bc2 = torch.full_like(p, 1 - b2 ** t)
            if k in comp:
                bc2 = torch.where(self.masked_of[k].view_as(p), bc2, 1 - b2 ** tw)
            denom = self.v[k].sqrt() / bc2.sqrt() + self.eps
            step = self.m[k] / (1 - b1 ** t) / denom
            if k in comp and b1 * b1 < b2:
                bound = (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))
                step = step.clamp(-bound, bound)  # a no-op for the masked (plain Adam) elements
            p.mul_(1 - self.lr * self.wd)
            p.sub_(self.lr * step)
        if t == tw:
            self.masked_of = [(v == 0).reshape(-1) if c else torch.zeros(v.numel(), dtype=torch.bool)
                              for v, c in zip(self.v, self.compressed)]
        return [p.clone() for p in self.params]

"""PowerSGD (Vogels et al., 2019): rank-r gradient compression with error feedback, on gloo and NCCL.

Each matrix gradient M (conv kernels are flattened to rows x rest) is sent as two thin factors:
P = M Q (rows x r) and Q' = M^T P (cols x r), one all-reduce each for the whole bucket. Q' is kept
and reused as the next step's Q ("warm start"), which turns the per-step work into one step of
power iteration that tracks the gradient's top-r subspace across steps. What the factors miss is
kept per rank as an error and added to the next step's gradient, so nothing is lost, only delayed.

1-D tensors (biases, norms) and matrices too small to save anything are all-reduced exactly, in
the same collective as P. For the first ``warmup_steps`` rounds the whole bucket is all-reduced
exactly, since early gradients change direction too fast for a warm-started subspace.

The hook waits for its two collectives itself and returns a completed future: a second collective
launched from inside a gloo future's callback is what crashes torch's own PowerSGD hook on gloo.
On NCCL ``wait()`` only orders the CUDA streams, so the CPU does not block.
"""

import zlib
from dataclasses import dataclass, field

import torch

from .hooks import HookState, _completed, allreduce_hook

__all__ = ["PowerSGDState", "powersgd_hook", "initial_q", "orthonormalise", "should_compress", "matrix_shape"]


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """How an N-d gradient is viewed as a matrix: first dim x everything else."""
    rows = shape[0]
    return rows, (torch.Size(shape).numel() // rows) if rows else 0


def should_compress(shape: torch.Size, rank: int) -> bool:
    """Compress only matrices whose two rank-r factors are smaller than the matrix itself."""
    if len(shape) < 2:
        return False
    rows, cols = matrix_shape(shape)
    r = min(rank, rows, cols)
    return (rows + cols) * r < rows * cols


def orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning P. Householder QR cannot divide by zero on a rank-deficient P."""
    return torch.linalg.qr(p, mode="reduced").Q


def initial_q(name: str, cols: int, r: int, seed: int = 0) -> torch.Tensor:
    """The first Q of parameter ``name``: seeded by name, so every rank has it without a broadcast."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(cols, r, generator=gen)


@dataclass
class PowerSGDState(HookState):
    """Hook state: rank, warm-up, and per-parameter Q and error keyed by parameter name."""

    rank: int = 4
    warmup_steps: int = 10
    seed: int = 0
    names: dict = field(default_factory=dict)
    """id(parameter) -> its name in the model, so state survives DDP's bucket rebuild."""
    qs: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)

    def q_for(self, name: str, cols: int, r: int, device) -> torch.Tensor:
        q = self.qs.get(name)
        if q is None:
            q = initial_q(name, cols, r, self.seed).to(device)
            self.qs[name] = q
        return q

    def state_dict(self) -> dict:
        sd = super().state_dict()
        # copies: the hook updates the error buffers in place, which must not change a saved state
        sd["qs"] = {k: v.detach().to("cpu", copy=True) for k, v in self.qs.items()}
        sd["errors"] = {k: v.detach().to("cpu", copy=True) for k, v in self.errors.items()}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.qs = {k: v.clone() for k, v in sd.get("qs", {}).items()}
        self.errors = {k: v.clone() for k, v in sd.get("errors", {}).items()}


def _bucket_views(bucket):
    buffer = bucket.buffer()
    offset = 0
    views = []
    for p in bucket.parameters():
        n = p.numel()
        views.append((p, buffer[offset:offset + n].view(p.shape)))
        offset += n
    return views


def powersgd_hook(state: PowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: exact mean during warm-up, then rank-r PowerSGD with error feedback."""
    if state.rounds < state.warmup_steps:
        return allreduce_hook(state, bucket)
    n = state.world_size
    dense, low_rank = [], []
    for p, view in _bucket_views(bucket):
        (low_rank if should_compress(view.shape, state.rank) else dense).append((p, view))

    # Phase 1: P = M Q for every compressed matrix, packed with the exact (pre-divided) dense grads.
    # The arithmetic is memory-bound (rank-r products read the whole matrix once each), so every
    # full-size pass works in place: M is the bucket's own fp32 view (the result overwrites it at
    # the end anyway) and the error buffer is reused from step to step.
    mats, ps = [], []
    for p, view in low_rank:
        name = state.names.get(id(p), str(id(p)))
        rows, cols = matrix_shape(view.shape)
        r = min(state.rank, rows, cols)
        m = view.detach().reshape(rows, cols)
        m = m if m.dtype == torch.float32 else m.float()
        err = state.errors.get(name)
        if err is not None:
            m.add_(err.to(m.device))
        q = state.q_for(name, cols, r, m.device).to(m.device)
        mats.append((name, view, m))
        ps.append(m @ q)
    dense_flat = [v.reshape(-1).float() / n for _, v in dense]
    phase1 = torch.cat(dense_flat + [p.reshape(-1) for p in ps]) if (dense_flat or ps) else None
    if phase1 is None:
        state.close_bucket(bucket)
        return _completed(bucket.buffer())
    state.allreduce(phase1).wait()

    offset = 0
    for _, view in dense:
        k = view.numel()
        view.copy_(phase1[offset:offset + k].view(view.shape))
        offset += k
    # Phase 2: orthonormalise the summed P (identical on every rank), then Q_i = M_i^T P.
    ortho, q_locals = [], []
    for (name, view, m), p in zip(mats, ps):
        k = p.numel()
        p_sum = phase1[offset:offset + k].view(p.shape)
        offset += k
        p_hat = orthonormalise(p_sum)
        q_local = m.t() @ p_hat
        # Local residual: what this rank's share of the rank-r estimate misses (one fused pass).
        err = state.errors.get(name)
        if err is None or err.shape != m.shape or err.device != m.device:
            err = torch.empty_like(m)
            state.errors[name] = err
        torch.addmm(m, p_hat, q_local.t(), alpha=-1.0, out=err)
        ortho.append(p_hat)
        q_locals.append(q_local)
    if q_locals:
        phase2 = torch.cat([q.reshape(-1) for q in q_locals])
        state.allreduce(phase2).wait()
        offset = 0
        for (name, view, m), p_hat, q_local in zip(mats, ortho, q_locals):
            k = q_local.numel()
            q_sum = phase2[offset:offset + k].view(q_local.shape)
            offset += k
            state.qs[name] = q_sum.clone()
            mean_q = q_sum.t() / n  # divide the thin factor, not the full product
            if m.data_ptr() == view.data_ptr():  # fp32 bucket: write the estimate straight into it
                torch.mm(p_hat, mean_q, out=m)
            else:
                view.copy_((p_hat @ mean_q).view(view.shape))
    state.close_bucket(bucket)
    return _completed(bucket.buffer())

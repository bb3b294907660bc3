"""PowerSGD (Vogels et al., 2019): rank-r gradient compression with error feedback, on gloo and NCCL.

Each matrix gradient M (conv kernels are flattened to rows x rest) is sent as two thin factors:
P = M Q (rows x r) and Q' = M^T P (cols x r), one all-reduce each for the whole bucket. Q' is kept
and reused as the next step's Q ("warm start"), which turns the per-step work into one step of
power iteration that tracks the gradient's top-r subspace across steps. What the factors miss is
kept per rank as an error and added to the next step's gradient, so nothing is lost, only delayed.

1-D tensors (biases, norms) and matrices too small to save anything are all-reduced exactly, in
the same collective as P. For the first ``warmup_steps`` rounds the whole bucket is all-reduced
exactly, since early gradients change direction too fast for a warm-started subspace.

Nothing blocks backward: the hook launches P's all-reduce and returns a future; QR, Q's
all-reduce (on ``HookState.side_group``, in bucket order, see hooks.OrderedSecondPhase) and the
decompression run from completion callbacks while autograd works on the next buckets. Matrices
of one shape in a bucket are stacked, so QR and the products run batched (one call per shape),
and the error buffer of a shape group is one stacked tensor that doubles as the compensated
gradient M + E, so no full-size temporary is made. The factors travel in the bucket's dtype when
that is bf16 (bf16 gradients stay bf16 on the wire); fp16 buckets send fp32 factors, since a
sum of products can leave fp16's range where the gradients themselves do not.

Each phase is a named profiler range (``powersgd.p``: P and its launch, in the hook;
``powersgd.q``: QR and Q's launch; ``powersgd.decompress``), so a torch.profiler trace shows
where they run against backward: ``scripts/trace-powersgd.py`` writes one per rank.
"""

# No `from __future__ import annotations`: DDP reads a comm hook's return annotation at run time.

import zlib
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from .hooks import HookState, OrderedSecondPhase, allreduce_hook, completed

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
    """Orthonormal columns spanning P (or each P of a stack). Householder QR cannot divide by zero
    on a rank-deficient P."""
    return torch.linalg.qr(p, mode="reduced").Q


def initial_q(name: str, cols: int, r: int, seed: int = 0) -> torch.Tensor:
    """The first Q of parameter ``name``: seeded by name, so every rank has it without a broadcast."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(cols, r, generator=gen)


@dataclass
class _ShapeGroup:
    """Compressed matrices of one (rows, cols) in one bucket, and where their P and Q travel."""

    rows: int
    cols: int
    r: int
    names: tuple
    offsets: tuple
    """Start of each matrix in the bucket buffer."""
    p_at: int = 0
    """Start of this group's stacked P in the phase-1 buffer (and of its Q in the phase-2 one)."""
    q_at: int = 0


@dataclass
class _BucketLayout:
    """Everything about a bucket that does not change between steps, worked out once."""

    dense: list
    """(start in bucket, numel, start in phase-1 buffer) of the exactly reduced tensors."""
    groups: list
    phase1: int
    phase2: int


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
    """name -> this rank's error; within a bucket these are views of one stacked tensor per shape."""
    _layouts: dict = field(default_factory=dict, repr=False)
    _stacks: dict = field(default_factory=dict, repr=False)
    _second: OrderedSecondPhase = field(default_factory=OrderedSecondPhase, repr=False)

    def q_for(self, name: str, cols: int, r: int, device) -> torch.Tensor:
        q = self.qs.get(name)
        if q is None:
            q = initial_q(name, cols, r, self.seed).to(device)
            self.qs[name] = q
        return q

    def layout(self, bucket) -> _BucketLayout:
        """The bucket's layout, cached by its parameters (DDP rebuilds buckets once, early)."""
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        found = self._layouts.get(key)
        if found is not None:
            return found
        dense, by_shape, offset = [], {}, 0
        for p in params:
            if should_compress(p.shape, self.rank):
                rows, cols = matrix_shape(p.shape)
                by_shape.setdefault((rows, cols), []).append((self.names.get(id(p), str(id(p))), offset))
            else:
                dense.append([offset, p.numel(), 0])
            offset += p.numel()
        at = 0
        for d in dense:
            d[2] = at
            at += d[1]
        groups, q_at = [], 0
        for (rows, cols), members in by_shape.items():
            r = min(self.rank, rows, cols)
            g = _ShapeGroup(rows, cols, r, tuple(n for n, _ in members), tuple(o for _, o in members), at, q_at)
            at += len(members) * rows * r
            q_at += len(members) * cols * r
            groups.append(g)
        found = _BucketLayout([tuple(d) for d in dense], groups, at, q_at)
        self._layouts[key] = found
        return found

    def error_stack(self, group: _ShapeGroup, device) -> torch.Tensor:
        """The group's stacked fp32 error; ``errors[name]`` are views of it (rebuilt after a load)."""
        stack = self._stacks.get(group.names)
        if stack is not None and stack.device == device:
            return stack
        shape = (group.rows, group.cols)
        parts = []
        for name in group.names:
            err = self.errors.get(name)
            ok = err is not None and tuple(err.shape) == shape
            parts.append(err.to(device, torch.float32) if ok else torch.zeros(shape, device=device))
        stack = torch.stack(parts)
        for i, name in enumerate(group.names):
            self.errors[name] = stack[i]
        self._stacks[group.names] = stack
        return stack

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
        self._stacks = {}


def _factor_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def powersgd_hook(state: PowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: exact mean during warm-up, then rank-r PowerSGD with error feedback."""
    if state.rounds < state.warmup_steps:
        return allreduce_hook(state, bucket)
    layout = state.layout(bucket)
    buffer = bucket.buffer()
    state.close_bucket(bucket)
    if not layout.phase1:
        return completed(buffer)
    with record_function("powersgd.p"):
        return _launch_p(state, layout, buffer)


def _launch_p(state: PowerSGDState, layout: _BucketLayout, buffer: torch.Tensor) -> torch.futures.Future:
    n, device = state.world_size, buffer.device
    wire = _factor_dtype(buffer.dtype)
    # Phase 1: the exact tensors (pre-divided, in the bucket's dtype) and P = (M + E) Q per group.
    phase1 = torch.empty(layout.phase1, dtype=wire if layout.groups else buffer.dtype, device=device)
    for start, k, at in layout.dense:
        torch.div(buffer[start:start + k], n, out=phase1[at:at + k])
    stacks = []
    for g in layout.groups:
        m = state.error_stack(g, device)  # E, turned into M + E in place: the error is rebuilt below
        for i, start in enumerate(g.offsets):
            m[i].add_(buffer[start:start + g.rows * g.cols].view(g.rows, g.cols))
        q = torch.stack([state.q_for(name, g.cols, g.r, device).to(device) for name in g.names])
        p = phase1[g.p_at:g.p_at + m.shape[0] * g.rows * g.r].view(-1, g.rows, g.r)
        if wire == torch.float32:
            torch.bmm(m, q, out=p)
        else:
            p.copy_(torch.bmm(m, q))
        stacks.append(m)
    first = state.allreduce(phase1).get_future()

    def copy_dense(summed):
        for start, k, at in layout.dense:
            buffer[start:start + k].copy_(summed[at:at + k])

    if not layout.groups:
        def only_dense(fut):
            copy_dense(fut.value()[0])
            return buffer
        return first.then(only_dense)

    def phase2(values):
        with record_function("powersgd.q"):
            return launch_q(values)

    def launch_q(values):
        # QR of the summed P (identical on every rank), Q_i = M_i^T P_hat, E_i = M_i - P_hat Q_i^T.
        summed = values[0]
        copy_dense(summed)
        phase2_buf = torch.empty(layout.phase2, dtype=wire, device=device)
        p_hats = []
        for g, m in zip(layout.groups, stacks):
            b = m.shape[0]
            p_hat = orthonormalise(summed[g.p_at:g.p_at + b * g.rows * g.r].view(b, g.rows, g.r).float())
            q_local = torch.bmm(m.transpose(1, 2), p_hat)
            m.baddbmm_(p_hat, q_local.transpose(1, 2), alpha=-1.0)  # m is the error again
            phase2_buf[g.q_at:g.q_at + b * g.cols * g.r].view(b, g.cols, g.r).copy_(q_local)
            p_hats.append(p_hat)
        work = state.allreduce(phase2_buf, group=state.side_group)
        return work.get_future().then(lambda fut: decompress(fut.value()[0], p_hats))

    def decompress(q_summed, p_hats):
        with record_function("powersgd.decompress"):
            return unpack(q_summed, p_hats)

    def unpack(q_summed, p_hats):
        for g, p_hat in zip(layout.groups, p_hats):
            b = p_hat.shape[0]
            q_sum = q_summed[g.q_at:g.q_at + b * g.cols * g.r].view(b, g.cols, g.r).float()
            mean_qt = q_sum.transpose(1, 2) / n  # divide the thin factor, not the full product
            for i, (name, start) in enumerate(zip(g.names, g.offsets)):
                state.qs[name] = q_sum[i]
                out = buffer[start:start + g.rows * g.cols].view(g.rows, g.cols)
                if out.dtype == torch.float32:
                    torch.mm(p_hat[i], mean_qt[i], out=out)
                else:
                    out.copy_(p_hat[i] @ mean_qt[i])
        return buffer

    return state._second.chain(first, phase2, device)

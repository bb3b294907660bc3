"""1-bit Adam (Tang et al., 2021): Adam whose traffic after warm-up is 1-bit momentum.

Warm-up: plain Adam on gradients that DDP all-reduces as usual. Adam's variance settles early and
changes little afterwards, so at the end of warm-up it is frozen; from then on the update is
linear in the momentum, and averaging momentum across ranks is what averaging gradients did.
For the compressed tensors DDP's all-reduce is switched off, each rank folds its *local*
gradient into the shared momentum, and the momenta are averaged with error-compensated sign
compression (the paper's Algorithm 1):

* worker side: x_i = m_i + e_i is sent as sign(x_i) times one scale per tensor,
  ||x||_2 / sqrt(numel) (it keeps the tensor's norm); e_i keeps what the signs lost;
* server side: rank j owns chunk j of the flat buffer of compressed tensors; it averages the n
  decompressed chunks it got (one all_to_all), adds its own error, compresses again with one
  scale per tensor piece in its chunk, and every rank gathers the compressed chunks (one
  all_gather). A scale never spans two tensors: a shared scale over ~35 tensors of different
  magnitudes is what cost the earlier chunk-scale design 4% of loss.

What is not compressed, and why:

* tensors below ``min_compress_numel`` elements or with fewer than 2 dims (biases, norms): the
  bytes they would save are noise, and their gradients are the least sign-friendly. Their
  gradients keep being all-reduced exactly (in their own dtype) by the DDP hook and they keep
  running plain Adam, variance included;
* elements whose variance is exactly 0 at the freeze (embedding rows no warm-up batch touched):
  a frozen v = 0 would turn the first compressed momentum (every element gets +-scale) into an
  update of scale / eps ~ 1e4 x lr. They stay on **plain Adam from exact gradients**: step()
  averages exactly those elements' gradients, their momentum and variance follow Adam, and the
  compressed exchange treats them as absent (zero in the buffers, outside every scale). The
  mask is fixed at the freeze. Most masked elements are rows of tokens that no rank sees in a
  given step either, whose gradient is exactly 0, so each rank sends only its blocks of 32
  masked values that hold a nonzero, with a block id (4 bytes per 128), by one all_gather;
  when more are touched than that saves, one fp32 all_reduce of them all (4 bytes each).

Steps after the freeze are clipped, element by element, at the largest step Adam itself could
take with the same betas (``adam_step_bound``: |m_hat| / sqrt(v_hat) <= (1 - b1) /
sqrt((1 - b2)(1 - b1^2 / b2)) by Cauchy-Schwarz, 7.27 for (0.9, 0.999)). A frozen v cannot grow
with a gradient that grows, so an element whose v was small at the freeze (a token seen once in
warm-up, an lm_head row whose probability later rises) is otherwise stepped by g / sqrt(v_small)
every step and drifts without bound: on the 2-layer gpt the run went from val 5.6 to 19 without
the clip, and stayed within 1% of AdamW with it. The clip only cuts steps larger than any Adam
could take, so it leaves alone every element whose frozen variance is still a fair one.

Bytes: after warm-up a rank hands its collectives (N/8 + N/(8n)) bytes of signs plus a few
scales for N compressed elements (n ranks), against 4N for an fp32 all-reduce: 1/32 + 1/(32n)
of it, e.g. 1/21 at n = 2 and -> 1/32 as n grows, plus the exact tensors and the masked blocks a
step touched. ``HookState.bytes_sent`` counts it from the tensors actually passed.

Warm-up, chosen the way the paper does: uncompressed Adam until its variance is stable, then
freeze. Tang et al. warm up for about 15-25% of the steps in BERT pre-training (the variance has
to be measured on enough data to be worth freezing). ``warmup_for(total_steps)`` is that rule of
thumb, max(100, 20% of the steps); without ``total_steps`` the default is 1000 steps. The
fraction is not enough on its own: from random weights the gradients shrink ~10x over the first
hundred steps, and a variance frozen then under-steps everything after (the 300-step slow test
warms up for 60 steps, 20%, after 200 AdamW steps). The DP ladder's rows are short timing runs
whose warm-up (stated in turbotrain.bench.dp_ladder) is far below this: their val loss says what
compression does to early training, not whether 1-bit Adam converges.

The exchange itself (layout, sign packing, pipelining, compiled kernels) lives in
``onebit_exchange``, ``signs`` and ``onebit_kernels``; this module is the optimizer and its DDP hook.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(3))
>>> opt = OneBitAdam([w], lr=0.1, warmup_steps=2)
>>> w.grad = torch.ones(3); opt.step(); opt.compressing
False
"""

# No `from __future__ import annotations`: DDP reads a comm hook's return annotation at run time.

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .hooks import HookState, allreduce_hook, noop_hook
from .onebit_exchange import OneBitCompressor
from .onebit_kernels import _clipped_update, _scalars
from .signs import pack_signs, unpack_signs

__all__ = ["OneBitAdam", "OneBitCompressor", "onebit_hook", "pack_signs", "unpack_signs", "warmup_for",
           "adam_step_bound", "DEFAULT_WARMUP_STEPS", "MIN_COMPRESS_NUMEL"]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

#: Warm-up when neither ``warmup_steps`` nor ``total_steps`` is given.
DEFAULT_WARMUP_STEPS = 1000
#: Tensors smaller than this go exact: 4096 fp32 values are 16 KiB, below a collective's latency.
MIN_COMPRESS_NUMEL = 4096


def adam_step_bound(betas) -> float:
    """The most |m_hat / sqrt(v_hat)| can be in Adam (large t, eps ignored); inf when b1^2 >= b2."""
    b1, b2 = betas
    if b1 * b1 >= b2:
        return math.inf
    return (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))


def warmup_for(total_steps: int, fraction: float = 0.2, minimum: int = 100) -> int:
    """The paper's rule of thumb: warm up for ~15-25% of training (here 20%), and never under 100 steps."""
    return max(minimum, math.ceil(fraction * total_steps))


def _starts(sizes):
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


@dataclass
class _Masked:
    """One parameter's elements with v = 0 at the freeze: whole rows of its (shape[0], rest) view
    (an embedding's unseen tokens) plus single elements. Row-wise index ops on the rows run ~10x
    faster on CPU than per-element ones on the same count, and masks are mostly whole rows."""

    rows: torch.Tensor
    elems: torch.Tensor
    """Flat indices of the masked elements outside ``rows``."""
    cols: int

    @classmethod
    def of(cls, flat_index: torch.Tensor, shape: torch.Size) -> "_Masked":
        cols = shape.numel() // shape[0]
        row_of = flat_index // cols
        full = torch.bincount(row_of, minlength=shape[0]) == cols
        return cls(torch.nonzero(full).reshape(-1), flat_index[~full[row_of]], cols)

    @property
    def numel(self) -> int:
        return self.rows.numel() * self.cols + self.elems.numel()

    def take(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (numel values) <- t's masked elements: the rows' first, then the single ones."""
        k = self.rows.numel() * self.cols
        torch.index_select(t.view(-1, self.cols), 0, self.rows, out=out[:k].view(-1, self.cols))
        torch.index_select(t.view(-1), 0, self.elems, out=out[k:])

    def put_(self, t: torch.Tensor, values: torch.Tensor) -> None:
        """t's masked elements <- ``values`` (in ``take``'s order)."""
        k = self.rows.numel() * self.cols
        t.view(-1, self.cols).index_copy_(0, self.rows, values[:k].view(-1, self.cols))
        t.view(-1).index_copy_(0, self.elems, values[k:])

    def taken(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty(self.numel)
        self.take(t, out)
        return out


_BLOCK = 32
"""Masked gradients travel in blocks of 32 values with one int32 block id: 3% over the values."""


def _sparse_or_dense_sum(values: torch.Tensor, size: int, comp: "OneBitCompressor") -> torch.Tensor:
    """Sum over the group of ``values[:size]`` (fp32, zero-padded to a multiple of _BLOCK), in
    place or as a new tensor.

    Each rank sends only its blocks that hold a nonzero value, as (block id, 32 values) rows of one
    all_gather, when that moves fewer bytes than a ring all_reduce would (n k (B + 1) < 2 N, with k
    the most blocks any rank has); else one all_reduce. An embedding row no batch of the step
    touched has an exactly zero gradient, so most masked blocks are skipped. Every rank sums the
    gathered rows in rank order, so all get the same bits.
    """
    n = comp.world
    blocks = values.view(-1, _BLOCK)
    ids = torch.nonzero(blocks.ne(0).any(1)).reshape(-1)
    counts = comp._all_gather(torch.tensor([ids.numel()], dtype=torch.int64, device=values.device)).tolist()
    width = max(counts)
    if width == 0:  # no rank touched any of them: the sum is 0, already in place
        return values
    if n * width * (_BLOCK + 1) >= 2 * size or blocks.shape[0] >= 2 ** 31:
        comp._count(size * values.element_size())
        dist.all_reduce(values[:size], group=comp.group)
        return values
    send = torch.zeros(width, _BLOCK + 1, dtype=torch.int32, device=values.device)
    send[:ids.numel(), 0] = ids
    send[:ids.numel(), 1:] = blocks.index_select(0, ids).view(torch.int32)
    rows = comp._all_gather(send.view(-1)).view(n * width, _BLOCK + 1)
    out = torch.zeros_like(blocks)
    for r, k in enumerate(counts):
        mine = rows[r * width:r * width + k]
        out.index_add_(0, mine[:, 0].long(), mine[:, 1:].view(torch.float32))
    return out.view(-1)


@dataclass
class _Flat:
    """The compressed parameters' momenta as views of one padded buffer the exchange works in."""

    params: list
    buffer: torch.Tensor
    views: list
    mask: torch.Tensor | None
    starts: dict
    """Parameter position -> where its momentum starts in ``buffer``."""


class OneBitAdam(torch.optim.Optimizer):
    """Adam with frozen variance and 1-bit momentum exchange after ``warmup_steps`` steps.

    Weight decay is decoupled (AdamW style); bias corrections are Adam's, with the variance's
    frozen at the warm-up's last step. Use it through ``DataParallelConfig(compression='onebit')``
    so DDP's gradient all-reduce is narrowed to the exact tensors at the right step; alone (one
    process) it behaves the same with the compression applied locally.

    ``warmup_steps``: uncompressed Adam steps before the variance is frozen; default
    ``warmup_for(total_steps)`` when ``total_steps`` is given, else ``DEFAULT_WARMUP_STEPS``.
    ``min_compress_numel``: tensors below it (and every 1-D tensor) are exchanged exactly.
    ``clip_updates``: after the freeze, clip each element's step at ``adam_step_bound(betas)`` x lr.

    Memory: after the freeze it keeps the compressed tensors' frozen denominator sqrt(v_hat) + eps
    (4 bytes per element) rather than recompute it every step, and the two error buffers (4 bytes
    per element on the worker side, 4 / n on the server side).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, warmup_steps: int | None = None, group=None, *,
                 total_steps: int | None = None, min_compress_numel: int = MIN_COMPRESS_NUMEL,
                 clip_updates: bool = True):
        if warmup_steps is None:
            warmup_steps = warmup_for(total_steps) if total_steps is not None else DEFAULT_WARMUP_STEPS
            logger.info("1-bit Adam: warm-up of %d steps (%s)", warmup_steps,
                        "20% of total_steps, at least 100" if total_steps is not None else "default; "
                        "pass total_steps to get 20% of the run")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ConfigError(
                f"OneBitAdam warmup_steps={warmup_steps!r} must be an integer >= 1: the variance that "
                "gets frozen has to be measured first"
            )
        if lr <= 0 or eps <= 0 or not all(0 <= b < 1 for b in betas):
            raise ConfigError("OneBitAdam needs lr > 0, eps > 0 and betas in [0, 1)")
        if not isinstance(min_compress_numel, int) or min_compress_numel < 1:
            raise ConfigError(f"OneBitAdam min_compress_numel={min_compress_numel!r} must be an integer >= 1")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.warmup_steps = warmup_steps
        self.min_compress_numel = min_compress_numel
        self.clip_updates = clip_updates
        self._exact_params: set[int] = set()
        self.steps_done = 0
        self.compressor = OneBitCompressor(group)
        self._exact_idx: dict[int, torch.Tensor] = {}
        """Parameter position -> flat indices of its elements with v = 0 at the freeze."""
        self._flat: _Flat | None = None
        self._masks: dict | None = None
        self._denoms: dict[int, tuple] = {}
        """Parameter position -> (eps, sqrt(v_hat) + eps) of a compressed tensor after the freeze."""

    @property
    def compressing(self) -> bool:
        """True once warm-up is over: gradients stay local and momentum goes out in 1 bit."""
        return self.steps_done >= self.warmup_steps

    def compresses(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s momentum goes through the 1-bit exchange (else: exact gradient, plain Adam)."""
        return p.dim() >= 2 and p.numel() >= self.min_compress_numel and id(p) not in self._exact_params

    def keep_exact(self, params) -> None:
        """Never compress these (e.g. sparse embeddings, whose gradients are averaged exactly elsewhere)."""
        self._exact_params |= {id(p) for p in params}

    def _params(self):
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    yield i, group, p
                i += 1

    def _state(self, p):
        st = self.state[p]
        if not st:
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        return st

    def _freeze(self) -> None:
        """End of warm-up: remember which elements have no variance to freeze."""
        self._exact_idx = {}
        for i, _, p in self._params():
            if self.compresses(p):
                idx = torch.nonzero(self._state(p)["exp_avg_sq"].reshape(-1) == 0).reshape(-1)
                if idx.numel():
                    self._exact_idx[i] = idx
        self._masks = None
        self._denoms = {}
        masked = sum(t.numel() for t in self._exact_idx.values())
        if masked:
            logger.info("1-bit Adam: %d elements had v = 0 at the freeze; they stay on exact Adam", masked)

    def _masked(self) -> dict:
        """Parameter position -> its _Masked, built from ``_exact_idx`` on first use (and after a load)."""
        if self._masks is None:
            params = {i: p for i, _, p in self._params()}
            self._masks = {i: _Masked.of(idx.to(params[i].device), params[i].shape)
                           for i, idx in sorted(self._exact_idx.items())}
        return self._masks

    def _flat_momentum(self) -> _Flat:
        """The compressed momenta as views of one buffer, rebuilt if someone replaced the state."""
        flat = self._flat
        entries = [(i, p) for i, _, p in self._params() if self.compresses(p)]
        if (flat is not None and self.compressor.configured and len(entries) == len(flat.params)
                and all(p is q and self.state[p].get("exp_avg") is v
                        for (_, p), q, v in zip(entries, flat.params, flat.views))):
            return flat
        device = entries[0][1].device
        sizes = [p.numel() for _, p in entries]
        starts = _starts(sizes)
        masks = [self._exact_idx[i].to(device) + s for (i, _), s in zip(entries, starts) if i in self._exact_idx]
        mask = torch.cat(masks) if masks else None
        padded = self.compressor.configure(sizes, mask, device)
        buffer = torch.zeros(padded, device=device)
        views = []
        for (_, p), a in zip(entries, starts):
            view = buffer[a:a + p.numel()].view(p.shape)
            view.copy_(self._state(p)["exp_avg"])
            self.state[p]["exp_avg"] = view
            views.append(view)
        self._flat = _Flat([p for _, p in entries], buffer, views, mask, {i: a for (i, _), a in zip(entries, starts)})
        return self._flat

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compress = self.compressing
        t = self.steps_done + 1
        grads = {}
        for i, _, p in self._params():
            g = p.grad if p.grad is not None else torch.zeros_like(self._state(p)["exp_avg"])
            grads[i] = (g.to_dense() if g.is_sparse else g).float().contiguous()
        masks = self._masked() if compress else {}
        if masks:
            self._average_masked(grads, masks)
        flat = self._flat_momentum() if compress and any(self.compresses(p) for _, _, p in self._params()) else None
        entries = []
        for i, group, p in self._params():
            st = self._state(p)
            beta1, beta2 = group["betas"]
            g = grads[i]
            frozen = compress and self.compresses(p)
            if frozen:  # the momentum, and x = m + e of the exchange in the same pass
                self.compressor.momentum_(st["exp_avg"], g, flat.starts[i], beta1)
            else:
                st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
            running_v = None
            if not frozen:
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            elif i in masks:  # masked elements: exact mean gradient, plain Adam
                gm, running_v = masks[i].taken(g), masks[i].taken(st["exp_avg_sq"])
                running_v.mul_(beta2).addcmul_(gm, gm, value=1 - beta2)
                masks[i].put_(st["exp_avg_sq"], running_v)
            entries.append((i, group, p, st, frozen, running_v))
        if flat is not None:
            # the exchange leaves nothing of use at masked positions: their exact momenta go back after it
            kept = [(masks[i], st["exp_avg"], masks[i].taken(st["exp_avg"]))
                    for i, _, _, st, frozen, _ in entries if frozen and i in masks]
            self.compressor.allreduce_(flat.buffer, compensated=True)
            for mask, momentum, values in kept:
                mask.put_(momentum, values)
        for i, group, p, st, frozen, running_v in entries:
            beta1, beta2 = group["betas"]
            if frozen:
                denom = self._frozen_denominator(i, st, beta2, group["eps"])
            else:
                denom = st["exp_avg_sq"].sqrt().div_(math.sqrt(1 - beta2 ** t)).add_(group["eps"])
            if running_v is not None:
                masks[i].put_(denom, running_v.sqrt_().div_(math.sqrt(1 - beta2 ** t)).add_(group["eps"]))
            decay = 1 - group["lr"] * group["weight_decay"]
            step_size = group["lr"] / (1 - beta1 ** t)
            bound = adam_step_bound((beta1, beta2))
            clipped = frozen and self.clip_updates and bound < math.inf
            # m / denom clipped at bound x (1 - b1^t), scaled by lr / (1 - b1^t): the clip of
            # m_hat / denom at bound, with the bias correction folded into the bound and the step
            c1 = 1 - beta1 ** t
            if clipped and p.dtype == torch.float32 and self.compressor.kernel(
                    _clipped_update, p, st["exp_avg"], denom, *_scalars(p, decay, -group["lr"] / c1, bound * c1)):
                continue
            if group["weight_decay"]:
                p.mul_(decay)
            if clipped:  # eager: in the exchange's free sign buffer
                step = torch.div(st["exp_avg"], denom, out=self.compressor.scratch(p.shape))
                step.clamp_(-bound * c1, bound * c1)
                p.add_(step.to(p.dtype), alpha=-group["lr"] / c1)
            elif p.dtype == torch.float32:
                p.addcdiv_(st["exp_avg"], denom, value=-step_size)
            else:
                p.add_((st["exp_avg"] / denom).to(p.dtype), alpha=-step_size)
        self.steps_done = t
        if t == self.warmup_steps:
            self._freeze()
        return loss

    def _frozen_denominator(self, i: int, st: dict, beta2: float, eps: float) -> torch.Tensor:
        """sqrt(v_hat) + eps of a compressed tensor, computed once per freeze since v no longer
        changes there (4 bytes per element kept, three passes a step saved); its masked elements
        are overwritten every step with their running values."""
        found = self._denoms.get(i)
        if found is None or found[0] != eps:
            denom = st["exp_avg_sq"].sqrt().div_(math.sqrt(1 - beta2 ** self.warmup_steps)).add_(eps)
            self._denoms[i] = found = (eps, denom)
        return found[1]

    def _average_masked(self, grads: dict, masks: dict) -> None:
        """Replace the masked elements' local gradients by their exact mean over the group.

        Done here rather than in the DDP hook because the hook sees the model's parameters, which
        are not the optimizer's when the Engine keeps FP32 masters. Blocking, and sparse where that
        pays (``_sparse_or_dense_sum``): most masked rows are tokens no rank saw this step either.
        """
        comp = self.compressor
        if comp.world == 1:
            return
        sizes = [m.numel for m in masks.values()]
        local = grads[next(iter(masks))].new_zeros(math.ceil(sum(sizes) / _BLOCK) * _BLOCK)
        for (i, m), at in zip(masks.items(), _starts(sizes)):
            m.take(grads[i], local[at:at + m.numel])
        mean = _sparse_or_dense_sum(local.div_(comp.world), sum(sizes), comp)
        for (i, m), at in zip(masks.items(), _starts(sizes)):
            m.put_(grads[i], mean[at:at + m.numel])

    # -- checkpoints ----------------------------------------------------------------------------
    def onebit_state_dict(self) -> dict:
        """What Adam's per-parameter state does not hold: progress, the freeze's mask, the errors."""
        return {"steps_done": self.steps_done, "warmup_steps": self.warmup_steps,
                "exact_idx": {i: t.detach().to("cpu", copy=True) for i, t in self._exact_idx.items()},
                "compressor": self.compressor.state_dict()}

    def load_onebit_state_dict(self, sd: dict) -> None:
        self.steps_done = int(sd.get("steps_done", 0))
        self._exact_idx = {int(i): t.clone() for i, t in sd.get("exact_idx", {}).items()}
        if "compressor" in sd:
            self.compressor.load_state_dict(sd["compressor"])
        self._flat = self._masks = None
        self._denoms = {}

    def state_dict(self):
        sd = super().state_dict()
        sd["onebit"] = self.onebit_state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", {})
        super().load_state_dict(state_dict)
        for st in self.state.values():  # torch casts state to the parameter's dtype; ours is fp32
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st and st[key].dtype != torch.float32:
                    st[key] = st[key].float()
        self.load_onebit_state_dict(extra)


def onebit_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook for 1-bit Adam: the exact all-reduce during warm-up; after it, only the tensors the
    optimizer does not compress (small ones, 1-D ones) are all-reduced, in the bucket's dtype; the
    compressed ones keep their local gradient for the momentum exchange."""
    opt: OneBitAdam = state.extra["optimizer"]
    if not opt.compressing:
        return allreduce_hook(state, bucket)
    index = _bucket_exact_index(state, opt, bucket)
    if index is None:
        return noop_hook(state, bucket)
    if isinstance(index, str):
        return allreduce_hook(state, bucket)
    buffer = bucket.buffer()
    send = buffer.index_select(0, index).div_(state.world_size)
    work = state.allreduce(send)
    state.close_bucket(bucket)

    def scatter_back(fut):
        buffer.index_copy_(0, index, fut.value()[0])
        return buffer

    return work.get_future().then(scatter_back)


def _bucket_exact_index(state: HookState, opt: OneBitAdam, bucket):
    """Positions in the bucket to all-reduce exactly: None, 'all', or a LongTensor (cached per layout).

    Decided from the bucket's parameters' shapes (``OneBitAdam.compresses``), which are the model's:
    under FP32 masters they are not the optimizer's own tensors, but they have the same shapes.
    """
    params = bucket.parameters()
    cache = state.extra.setdefault("onebit_index", {})
    key = tuple(id(p) for p in params)
    if key in cache:
        return cache[key]
    parts, offset = [], 0
    device = bucket.buffer().device
    for p in params:
        if not opt.compresses(p):
            parts.append(torch.arange(offset, offset + p.numel(), device=device))
        offset += p.numel()
    if not parts:
        found = None
    elif sum(t.numel() for t in parts) == offset:
        found = "all"
    else:
        found = torch.cat(parts)
    cache[key] = found
    return found

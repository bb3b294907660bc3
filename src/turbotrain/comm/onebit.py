"""1-bit Adam (Tang et al., 2021): Adam whose only communication after warm-up is 1-bit momentum.

Warm-up: plain Adam on gradients that DDP all-reduces as usual. Adam's variance settles early and
changes little afterwards, so at the end of warm-up it is frozen; from then on the update is
linear in the momentum, and averaging momentum across ranks is what averaging gradients did.
DDP's gradient all-reduce is switched off (a no-op hook), each rank folds its *local* gradient
into the shared momentum, and the momenta are averaged with error-compensated sign compression:

* worker side: x_i = m_i + e_i is sent as sign(x_i) times one scale per tensor
  (||x||_2 / sqrt(numel), which keeps the tensor's norm); e_i keeps what the signs lost;
* server side: rank j owns chunk j of the flat buffer, averages the n decompressed chunks it got
  (one all_to_all), adds its own error, compresses again with one scale for the chunk, and every
  rank gathers the compressed chunks (one all_gather).

So a step sends about 2 bits per parameter each way instead of 32 (x2 for a ring all-reduce).

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(3))
>>> opt = OneBitAdam([w], lr=0.1, warmup_steps=2)
>>> w.grad = torch.ones(3); opt.step(); opt.compressing
False
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..errors import ConfigError

from .collectives import all_gather_flat

__all__ = ["OneBitAdam", "OneBitCompressor", "pack_signs", "unpack_signs"]

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Eight signs per byte (bit set where x >= 0); ``x.numel()`` must be a multiple of 8."""
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """+1/-1 per bit of ``pack_signs``' output."""
    bits = (packed.unsqueeze(1) & _BIT_WEIGHTS.to(packed.device)) != 0
    return bits.view(-1).to(dtype) * 2 - 1


def signed(x: torch.Tensor) -> torch.Tensor:
    """sign(x) with sign(0) = +1, matching the packed bit."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


class OneBitCompressor:
    """Error-compensated 1-bit all-reduce of one flat fp32 buffer (worker and server errors)."""

    def __init__(self, group=None):
        self.bind(group)
        self.worker_error: torch.Tensor | None = None
        self.server_error: torch.Tensor | None = None
        self.hook_state = None
        """A HookState whose counters this exchange bumps (set by comm.prepare)."""
        self._layout = None

    def bind(self, group=None) -> None:
        """Use ``group`` (the default group when None; a single process when none is running)."""
        self.group = group
        running = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if running else 1
        self.rank = dist.get_rank(group) if running else 0
        self._layout = None

    def _prepare(self, sizes: list[int], device) -> None:
        if self._layout is not None and self._layout[0] == sizes:
            return
        n_total = sum(sizes)
        chunk = math.ceil(n_total / (self.world * 8)) * 8  # whole bytes of signs per server chunk
        # Segment id per element; padding gets id len(sizes), whose scale is 0.
        seg = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), torch.tensor(sizes))
        seg = torch.cat([seg, torch.full((chunk * self.world - n_total,), len(sizes), dtype=torch.int32)])
        self._layout = (list(sizes), chunk, seg.to(device))
        if self.worker_error is None or self.worker_error.numel() != n_total:
            self.worker_error = torch.zeros(n_total, device=device)
            self.server_error = torch.zeros(chunk, device=device)

    def exchange(self, flat: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The compressed mean of ``flat`` over ranks (identical on every rank afterwards)."""
        device = flat.device
        self._prepare(sizes, device)
        _, chunk, seg = self._layout
        n, n_total = self.world, flat.numel()
        self.worker_error = self.worker_error.to(device)
        self.server_error = self.server_error.to(device)

        # Worker: compensate, compress with one scale per tensor, keep the residual.
        x = torch.zeros(chunk * n, device=device)
        x[:n_total] = flat + self.worker_error
        scales = torch.stack([s.norm() / math.sqrt(s.numel()) for s in x[:n_total].split(sizes)])
        scales = torch.cat([scales, scales.new_zeros(1)])
        self.worker_error = x[:n_total] - signed(x[:n_total]) * scales[seg[:n_total].long()]
        sign_bytes = chunk // 8
        packed = pack_signs(x).view(n, sign_bytes)
        scale_bytes = scales.view(torch.uint8).expand(n, -1)
        received = self._all_to_all(torch.cat([packed, scale_bytes], dim=1).contiguous())

        # Server for chunk `rank`: average the n decompressed chunks, compensate, compress again.
        my_seg = seg[self.rank * chunk:(self.rank + 1) * chunk].long()
        parts = []
        for i in range(n):
            worker_scales = received[i, sign_bytes:].clone().view(torch.float32)  # clone: offset 0 for the view
            parts.append(unpack_signs(received[i, :sign_bytes]) * worker_scales[my_seg])
        z = torch.stack(parts).mean(0) + self.server_error
        valid = my_seg != len(sizes)
        count = int(valid.sum())
        s = (z[valid].norm() / math.sqrt(count)) if count else z.new_zeros(())
        compressed = torch.where(valid, signed(z) * s, 0.0)
        self.server_error = torch.where(valid, z - compressed, 0.0)
        reply = torch.cat([pack_signs(z), s.reshape(1).view(torch.uint8)])
        gathered = self._all_gather(reply).view(n, sign_bytes + 4)

        out = torch.empty(chunk * n, device=device)
        for j in range(n):
            server_scale = gathered[j, sign_bytes:].clone().view(torch.float32)
            out[j * chunk:(j + 1) * chunk] = unpack_signs(gathered[j, :sign_bytes]) * server_scale
        out = torch.where(seg != len(sizes), out, 0.0)
        if self.hook_state is not None:
            self.hook_state.rounds += 1
            self.hook_state.calls += 2 if n > 1 else 0
        return out[:n_total]

    def _all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return send
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv

    def _all_gather(self, send: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return send
        out = send.new_empty(self.world * send.numel())
        all_gather_flat(out, send, group=self.group)
        return out

    def state_dict(self) -> dict:
        def cpu(t):
            return None if t is None else t.detach().cpu()

        return {"worker_error": cpu(self.worker_error), "server_error": cpu(self.server_error)}

    def load_state_dict(self, sd: dict) -> None:
        self.worker_error = sd.get("worker_error")
        self.server_error = sd.get("server_error")


class OneBitAdam(torch.optim.Optimizer):
    """Adam with frozen variance and 1-bit momentum exchange after ``warmup_steps`` steps.

    Weight decay is decoupled (AdamW style). Use it through ``DataParallelConfig(compression='onebit')``
    so DDP's gradient all-reduce is turned off at the right step; alone (one process) it behaves
    the same with the compression applied locally.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, warmup_steps: int = 10, group=None):
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ConfigError(
                f"OneBitAdam warmup_steps={warmup_steps!r} must be an integer >= 1: the variance that "
                "gets frozen has to be measured first"
            )
        if lr <= 0 or eps <= 0 or not all(0 <= b < 1 for b in betas):
            raise ConfigError("OneBitAdam needs lr > 0, eps > 0 and betas in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.warmup_steps = warmup_steps
        self.steps_done = 0
        self.compressor = OneBitCompressor(group)

    @property
    def compressing(self) -> bool:
        """True once warm-up is over: gradients stay local and momentum goes out in 1 bit."""
        return self.steps_done >= self.warmup_steps

    def _params(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    yield group, p

    def _state(self, p):
        st = self.state[p]
        if not st:
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        return st

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compress = self.compressing
        t = self.steps_done + 1
        entries = []
        for group, p in self._params():
            st = self._state(p)
            beta1, beta2 = group["betas"]
            g = p.grad.float() if p.grad is not None else torch.zeros_like(st["exp_avg"])
            st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
            if not compress:
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            entries.append((group, p, st))
        if compress and entries:
            flat = torch.cat([st["exp_avg"].reshape(-1) for _, _, st in entries])
            synced = self.compressor.exchange(flat, [st["exp_avg"].numel() for _, _, st in entries])
            for (_, _, st), m in zip(entries, synced.split([st["exp_avg"].numel() for _, _, st in entries])):
                st["exp_avg"].copy_(m.view_as(st["exp_avg"]))
        var_steps = min(t, self.warmup_steps)
        for group, p, st in entries:
            beta1, beta2 = group["betas"]
            m_hat = st["exp_avg"] / (1 - beta1 ** t)
            denom = (st["exp_avg_sq"] / (1 - beta2 ** var_steps)).sqrt_().add_(group["eps"])
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_((m_hat / denom).to(p.dtype), alpha=-group["lr"])
        self.steps_done = t
        return loss

    def state_dict(self):
        sd = super().state_dict()
        sd["onebit"] = {"steps_done": self.steps_done, "warmup_steps": self.warmup_steps}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", {})
        super().load_state_dict(state_dict)
        self.steps_done = int(extra.get("steps_done", 0))

"""Peer rows: training loops written the way a PyTorch user writes them, without turbotrain.

They are the yardstick the turbotrain rows are measured against, so they use only documented
PyTorch recipes: a plain loop, torch.autocast + GradScaler, and torch.compile with fused AdamW.

Autocast dtype: bf16 on CPU (fp16 matmul is emulated and slow there), fp16 on CUDA (the classic
AMP recipe). GradScaler is enabled for fp16 only: bf16 has fp32's exponent range, gradients do not
underflow, and the PyTorch AMP docs tell bf16 users they need no scaler, so a user does not add one.
"""

from __future__ import annotations

import contextlib

import torch

from .configs import make_optimizer, register_config

__all__ = ["PeerTrainer", "autocast_dtype"]


_DTYPE_NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # autocast dtype -> matmul dtype


def autocast_dtype(device: str) -> torch.dtype:
    """What a user passes to torch.autocast on ``device``."""
    return torch.bfloat16 if device == "cpu" else torch.float16


class PeerTrainer:
    """A user's own loop: optionally autocast (+GradScaler for fp16), torch.compile, fused AdamW."""

    def __init__(self, workload, device: str, *, amp: bool = False, compile: bool = False,
                 fused_adamw: bool = False):
        self.device = device
        self.loss_fn = workload.loss_fn
        self.model = workload.build_model().to(device)
        self.optimizer = make_optimizer(self.model.parameters(), **({"fused": True} if fused_adamw else {}))
        self.amp_dtype = autocast_dtype(device) if amp else None
        self.compute_dtype = _DTYPE_NAMES[self.amp_dtype]
        self.scaler = torch.amp.GradScaler(device, enabled=self.amp_dtype == torch.float16)
        self.forward = torch.compile(self.model) if compile else self.model
        self.compiled = compile

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device, dtype=self.amp_dtype)

    def step(self, batch) -> torch.Tensor:
        inputs, targets = batch
        with self.autocast():
            loss = self.loss_fn(self.forward(inputs), targets)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        self.model.eval()
        losses = []
        for inputs, targets in batches:
            # the eager module holds the same weights; evaluating through it spares a compiled row a
            # second (no-grad, eval-mode) compilation that would only lengthen the ladder
            with self.autocast():
                losses.append(float(self.loss_fn(self.model(inputs), targets)))
        self.model.train()
        return sum(losses) / len(losses)


register_config("fp32-eager", "plain PyTorch loop in fp32, AdamW (foreach)", group="peer",
                build=lambda workload, device: PeerTrainer(workload, device))
_AMP_DTYPE = {d: _DTYPE_NAMES[autocast_dtype(d)] for d in ("cpu", "cuda")}  # the matmul dtype of the autocast rows
register_config("torch-amp", "torch.autocast (bf16 on CPU, fp16 + GradScaler on CUDA), AdamW", group="peer",
                dtype=_AMP_DTYPE, build=lambda workload, device: PeerTrainer(workload, device, amp=True))
register_config("torch-compile", "torch.compile(model) + autocast + AdamW(fused=True)", group="peer",
                dtype=_AMP_DTYPE, fp32_twin="torch-compile-fp32",
                build=lambda workload, device: PeerTrainer(workload, device, amp=True, compile=True,
                                                           fused_adamw=True))
# What a user compiles on hardware whose low-precision matmuls are slower than fp32 (a CPU without
# avx512_bf16/amx_bf16): the yardstick of the fp32 turbotrain rows there.
register_config("torch-compile-fp32", "torch.compile(model) in fp32 + AdamW(fused=True)", group="peer",
                default=False,
                build=lambda workload, device: PeerTrainer(workload, device, compile=True, fused_adamw=True))

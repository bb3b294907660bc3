"""Peer rows: training loops written the way a PyTorch user writes them, without turbotrain.

They are the yardstick the turbotrain rows are measured against, so they use only documented
PyTorch recipes: a plain loop, torch.autocast + GradScaler, torch.compile of the model, and
torch.compile of the training step (``torch-compile-step``, the strongest peer and the ladder's
reference). Every row, peer or not, steps the ladder's one AdamW (``make_optimizer``: fused).

Batches are taken as the workload gives them: ``loss_fn(model(inputs), targets)`` for a pair, and
the model's own loss, ``model(**batch).loss``, for a Hugging Face dict batch.

Autocast dtype: bf16 on CPU (fp16 matmul is emulated and slow there), fp16 on CUDA for torch-amp
and torch-compile (the classic AMP recipe), bf16 everywhere for torch-compile-step (what a careful
user picks on hardware with native bf16: fp32's exponent range, so no loss scaling). GradScaler is
enabled for fp16 only: bf16 gradients do not underflow, and the PyTorch AMP docs tell bf16 users
they need no scaler, so a user does not add one.
"""

from __future__ import annotations

import contextlib

import torch

from .configs import REFERENCE, make_optimizer, register_config

__all__ = ["PeerTrainer", "CompiledStepTrainer", "autocast_dtype"]


_DTYPE_NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # autocast dtype -> matmul dtype


def autocast_dtype(device: str) -> torch.dtype:
    """What a user passes to torch.autocast on ``device`` in the classic AMP recipe."""
    return torch.bfloat16 if device == "cpu" else torch.float16


class _UserLoop:
    """What every peer shares: the workload's model on the device, the ladder's AdamW, autocast."""

    def __init__(self, workload, device: str, amp_dtype: torch.dtype | None):
        self.device = device
        self.workload = workload
        self.model = workload.build_model().to(device)
        self.optimizer = make_optimizer(self.model.parameters())
        self.amp_dtype = amp_dtype
        self.compute_dtype = _DTYPE_NAMES[amp_dtype]

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device, dtype=self.amp_dtype)

    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        self.model.eval()
        losses = []
        for batch in batches:
            # the eager module holds the same weights; evaluating through it spares a compiled row a
            # second (no-grad, eval-mode) compilation that would only lengthen the ladder
            with self.autocast():
                losses.append(float(self.workload.loss(self.model, batch)))
        self.model.train()
        return sum(losses) / len(losses)


class PeerTrainer(_UserLoop):
    """A user's own loop: optionally autocast (+GradScaler for fp16) and torch.compile(model)."""

    def __init__(self, workload, device: str, *, amp: bool = False, compile: bool = False):
        super().__init__(workload, device, autocast_dtype(device) if amp else None)
        self.scaler = torch.amp.GradScaler(device, enabled=self.amp_dtype == torch.float16)
        self.forward = torch.compile(self.model) if compile else self.model
        self.compiled = compile

    def step(self, batch) -> torch.Tensor:
        with self.autocast():
            loss = self.workload.loss(self.forward, batch)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


class CompiledStepTrainer(_UserLoop):
    """torch.compile over the training step, as a careful user writes it: the ladder's reference.

    What is compiled, and why (torch 2.13; timings from the quick gpt, d=128 L=2 T=64 B=4, on the
    shared 2-core development CPU, minimum of 15 steps, so rough but far apart):

    - **forward and loss as one compiled function, autocast inside it.** Inductor fuses across the
      model/loss boundary (the logits' cast and the cross-entropy's softmax), and AOTAutograd
      compiles the backward of the same graph, so ``loss.backward()`` outside runs compiled code.
    - **backward outside the compiled function.** Inside it, Dynamo graph-breaks on
      ``Tensor.backward`` unless compiled autograd or the experimental
      ``torch._dynamo.config.trace_autograd_ops`` is on; both were slower: 49 s and 72 s of
      compilation against 17 s, and 205 ms and 181 ms a step against 72 ms.
    - **the optimizer step eager.** Fused AdamW is already one kernel that Inductor leaves as a
      fallback: ``torch.compile(optimizer.step)`` measured the same (47 vs 49 ms at the default gpt)
      after 6 s more compilation, and the foreach AdamW that Inductor could fuse does not trace on
      CPU in torch 2.13 (``_foreach_addcdiv_``: "Expected scalars to be on CPU, got meta").
    - **bf16 autocast, no GradScaler.** ``amp=False`` is the fp32 twin, for hardware whose bf16
      matmul is slower than fp32.
    - the default compile mode: ``max-autotune`` multiplies compilation time for a ladder whose
      rows run tens of steps, and CUDA graphs (``reduce-overhead``) would not cover the eager
      optimizer step.
    """

    compiled = True

    def __init__(self, workload, device: str, *, amp: bool = True):
        super().__init__(workload, device, torch.bfloat16 if amp else None)
        model, autocast = self.model, self.autocast

        def forward_loss(batch):
            with autocast():
                return workload.loss(model, batch)

        self._forward_loss = torch.compile(forward_loss)

    def step(self, batch) -> torch.Tensor:
        loss = self._forward_loss(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


register_config("fp32-eager", "plain PyTorch loop in fp32, AdamW(fused)", group="peer",
                build=lambda workload, device: PeerTrainer(workload, device))
_AMP_DTYPE = {d: _DTYPE_NAMES[autocast_dtype(d)] for d in ("cpu", "cuda")}  # the matmul dtype of the autocast rows
register_config("torch-amp", "torch.autocast (bf16 on CPU, fp16 + GradScaler on CUDA), AdamW(fused)", group="peer",
                dtype=_AMP_DTYPE, build=lambda workload, device: PeerTrainer(workload, device, amp=True))
register_config("torch-compile", "torch.compile(model) + autocast + AdamW(fused)", group="peer",
                dtype=_AMP_DTYPE, fp32_twin="torch-compile-fp32",
                build=lambda workload, device: PeerTrainer(workload, device, amp=True, compile=True))
# What a user compiles on hardware whose low-precision matmuls are slower than fp32 (a CPU without
# avx512_bf16/amx_bf16): the yardstick of the fp32 turbotrain rows there.
register_config("torch-compile-fp32", "torch.compile(model) in fp32 + AdamW(fused)", group="peer",
                default=False, build=lambda workload, device: PeerTrainer(workload, device, compile=True))
register_config(REFERENCE, "torch.compile(forward+loss under bf16 autocast), backward, AdamW(fused): "
                "the strongest peer, the reference", group="peer", dtype="bf16",
                fp32_twin=f"{REFERENCE}-fp32",
                build=lambda workload, device: CompiledStepTrainer(workload, device))
register_config(f"{REFERENCE}-fp32", "torch.compile(forward+loss) in fp32, backward, AdamW(fused): "
                "the reference where bf16 is slow", group="peer", default=False,
                build=lambda workload, device: CompiledStepTrainer(workload, device, amp=False))

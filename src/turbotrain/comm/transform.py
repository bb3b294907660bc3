"""The data-parallel transform: the rank's device, DDP with compression, one exchange per step."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..plan import ApplyContext, ModelPlan, StepContext, Transform
from .config import DataParallelConfig

__all__ = ["DataParallelTransform"]


class DataParallelTransform(Transform):
    """``Config(data_parallel=...)``: DDP over the finished model, after the optimizer exists."""

    name = "data_parallel"

    def __init__(self, dp: DataParallelConfig):
        self.dp = dp
        self.state = None
        """The CommState once the model is wrapped."""
        self.ddp = None
        """The DistributedDataParallel wrapper once the model is wrapped."""

    def place(self, device: torch.device) -> torch.device:
        # The process group and the rank's GPU come first: the model, the FP32 masters and every
        # buffer are then created on that GPU, not on cuda:0 for every rank.
        from .env import init

        info = init(timeout_s=self.dp.timeout_s)  # a no-op returning the info when the group exists
        if device.type != "cuda":
            return device
        device = torch.device("cuda", info.local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
        return device

    def wrap_module(self, module: nn.Module, plan: ModelPlan, ctx: ApplyContext) -> nn.Module:
        import torch.distributed as dist

        from .ddp import prepare

        ddp, _, self.state = prepare(module, ctx.optimizer, self.dp, ctx.device)
        self.ddp = ddp
        # DDP broadcast rank 0's (possibly low-precision) weights; the FP32 masters must follow, or
        # the first copy-back would restore each rank's own initialisation and the replicas diverge.
        for low, master in plan.master_of.items():
            dist.broadcast(master.data, src=0, group=self.state.group)
            low.data.copy_(master.data)
        return ddp

    def accumulate_context(self, closes_step: bool):
        return contextlib.nullcontext() if closes_step else self.state.no_sync()

    @contextlib.contextmanager
    def eval_context(self):
        # DDP's forward broadcasts rank 0's buffers (HF Llama's rotary inv_freq, BatchNorm's running
        # stats) when the last forward prepared a backward: a collective, so a loss evaluated on rank 0
        # alone would wait for ranks that never call it. The flag is put back afterwards: a forward
        # without grad clears it, and then this rank's next training forward would skip the broadcast
        # the other ranks' make. Every replica holds the same buffers, so skipping it in eval changes
        # no numbers.
        if self.ddp is None:
            yield
            return
        saved = self.ddp.require_forward_param_sync
        self.ddp.require_forward_param_sync = False
        try:
            yield
        finally:
            self.ddp.require_forward_param_sync = saved

    def before_optimizer_step(self, ctx: StepContext) -> None:
        if ctx.found_inf is not None:
            ctx.found_inf = self.state.agree_found_inf(ctx.found_inf)

    def state_dict(self) -> dict:
        return self.state.state_dict() if self.state is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.state is not None and state:
            self.state.load_state_dict(state)

    def describe(self) -> str:
        return f"data parallel (compression {self.dp.compression})"

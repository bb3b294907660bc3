"""Precision modes: what the model computes in, what the optimizer updates, and how loss is scaled.

fp32           everything FP32.
bf16/fp16-mixed  torch.autocast picks per-op dtypes; weights stay FP32 (cast again every forward).
bf16/fp16-master the model itself is held in bf16/fp16 (no per-op casts in forward or backward);
               the optimizer updates FP32 master copies, which are copied back after each step, so
               small updates are not rounded away (pure bf16 training drifts without them).
In every low-precision mode KeepFp32Mode keeps softmax, norms, losses and reductions in FP32 and
the norm layers' own weights stay FP32.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..errors import ConfigError, HardwareError
from ..plan import ApplyContext, ModelPlan, StepContext, Transform
from .config import LossScaleConfig
from .keep_fp32 import KEEP_FP32_MODULES, KeepFp32Mode
from .scaler import DynamicLossScaler

__all__ = ["Precision", "resolve_precision", "find_head"]

logger = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_HEAD_NAMES = ("lm_head", "head", "classifier", "fc_out", "output")


def resolve_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """Turn 'auto' into a concrete mode for ``device``; return (mode, reason)."""
    if precision != "auto":
        return precision, "set explicitly"
    from .. import hardware

    return hardware.recommend_precision(hardware.detect(device.type))


def find_head(model: nn.Module) -> tuple[str, nn.Linear] | None:
    """The classifier head: a Linear with a conventional head name, else the last Linear."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, module in reversed(linears):
        if name.rsplit(".", 1)[-1] in _HEAD_NAMES:
            return name, module
    return linears[-1] if linears else None


def _cast_inputs(dtype: torch.dtype):
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    def hook(module, args, kwargs):
        return tree_map_only(torch.Tensor, cast, (args, kwargs))

    return hook


def _output_like_input(module, args, output):
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and isinstance(output, torch.Tensor) and output.dtype != x.dtype \
            and x.is_floating_point():
        return output.to(x.dtype)
    return output


class Precision(Transform):
    """The precision transform: cast the model, keep norms (and optionally the head) FP32, hold FP32
    masters for the optimizer, scale the loss in fp16, copy the masters back after each step."""

    name = "precision"

    def __init__(self, mode: str, device: torch.device, loss_scale: LossScaleConfig | None = None,
                 keep_fp32_head: bool = False, sharded: bool = False):
        self.requested = mode
        self.sharded = sharded
        """FSDP holds the FP32 masters (its shards) and computes in self.dtype: leave the model as it is."""
        self.mode, self.reason = resolve_precision(mode, device)
        if mode == "auto":
            logger.info("precision='auto' chose %r (%s)", self.mode, self.reason)
        self.device = device
        prefix = self.mode.split("-")[0]
        self.dtype = _DTYPES.get(prefix)  # None for fp32
        self.master = self.mode.endswith("-master")
        self.autocast_enabled = self.mode.endswith("-mixed")
        self.keep_fp32_head = keep_fp32_head
        self.scaler = DynamicLossScaler(loss_scale) if self.dtype is torch.float16 else None
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (model param, FP32 master)
        self._check_hardware(device)

    def _check_hardware(self, device: torch.device) -> None:
        if self.dtype is torch.float16 and device.type == "cpu":
            warnings.warn(
                "fp16 on CPU runs, but this CPU's fp16 matmuls are far slower than bf16 ones; "
                "use precision='bf16-master' for speed (fp16 on CPU is for checking fp16 numerics).",
                stacklevel=4,
            )
        if self.dtype is torch.bfloat16 and device.type == "cpu":
            from .. import hardware

            if hardware.native_bf16_feature(hardware.detect("cpu")) is None:
                warnings.warn(
                    f"precision={self.mode!r} on a CPU without native bf16 matmul (no "
                    f"{' or '.join(hardware.NATIVE_BF16_FEATURES)} flag): torch emulates it, typically tens "
                    "of times slower than fp32. It trains correctly; for speed here use precision='fp32' "
                    "(what 'auto' picks).",
                    stacklevel=4,
                )
        if self.dtype is torch.bfloat16 and device.type == "cuda" and not _cuda_bf16_native(device):
            raise HardwareError(
                f"precision={self.mode!r} needs native bf16 (compute capability 8.0 or newer), which this "
                "GPU lacks; use precision='fp16-master' (or 'auto')."
            )

    # -- the transform -----------------------------------------------------------------------
    def describe(self) -> str:
        return f"precision {self.mode} ({self.reason})"

    def apply(self, model: nn.Module, plan: ModelPlan, ctx: ApplyContext) -> None:
        if not self.master or self.sharded:
            return
        keep = set(plan.norm_params)
        if self.keep_fp32_head:
            keep.update(plan.head_params())
        norm_modules = {m for m in model.modules() if any(p in plan.norm_params for p in m.parameters(recurse=False))}
        for p in model.parameters():
            if p in keep or not p.is_floating_point():
                continue
            master = nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
            p.data = p.data.to(self.dtype)
            plan.master_of[p] = master
            self._pairs.append((p, master))
        for module in model.modules():
            if module in norm_modules or isinstance(module, KEEP_FP32_MODULES):
                continue
            for name, buf in module.named_buffers(recurse=False):
                # index buffers (position ids) are not floating; RoPE's inv_freq is kept FP32 like a norm
                if buf.is_floating_point() and "inv_freq" not in name:
                    setattr(module, name, buf.to(self.dtype))
        model.register_forward_pre_hook(_cast_inputs(self.dtype), with_kwargs=True)
        for module in norm_modules - {m for m in norm_modules if isinstance(m, KEEP_FP32_MODULES)}:
            # A hand-written norm (HF's LlamaRMSNorm) multiplies its FP32 weight into the result, which
            # promotes it to FP32; hand the next matmul the dtype the norm was given, as torch's do.
            module.register_forward_hook(_output_like_input)
        if self.keep_fp32_head and plan.head is not None:
            plan.head.register_forward_pre_hook(_cast_inputs(torch.float32), with_kwargs=True)

    def broadcast_masters(self, src: int = 0, group=None) -> None:
        """Make every data-parallel rank's FP32 masters equal to rank ``src``'s (then copy back)."""
        if not self._pairs:
            return
        import torch.distributed as dist

        for _, m in self._pairs:
            dist.broadcast(m.data, src=src, group=group)
        self.after_optimizer_step()

    # -- every step --------------------------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager:
        """Autocast (mixed modes) and the FP32 keep-list (all low-precision modes)."""
        stack = contextlib.ExitStack()
        if self.autocast_enabled:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.dtype))
        if self.dtype is not None:
            stack.enter_context(KeepFp32Mode())
        return stack

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(loss) if self.scaler else loss

    def before_optimizer_step(self, ctx: StepContext) -> None:
        """Move model grads onto the FP32 masters (master modes); unscale and flag inf/NaN (fp16)."""
        if self._pairs:
            low, masters = [], []
            for p, m in self._pairs:
                if p.grad is None:
                    m.grad = None
                    continue
                if m.grad is None:
                    m.grad = torch.empty_like(m)
                low.append(p.grad)
                masters.append(m.grad)
                p.grad = None
            if masters:
                torch._foreach_copy_(masters, low)
        ctx.grads = [p.grad for p in ctx.params if p.grad is not None]
        if self.scaler:
            ctx.found_inf = self.scaler.unscale_and_check_([_local(g) for g in ctx.grads])

    def after_optimizer_step(self) -> None:
        """Copy the updated FP32 masters back into the low-precision model (one fused copy)."""
        if self._pairs:
            torch._foreach_copy_([p.data for p, _ in self._pairs], [m.data for _, m in self._pairs])

    def reset_grads(self) -> None:
        for p, m in self._pairs:
            p.grad = None
            m.grad = None

    @contextlib.contextmanager
    def full_precision_weights(self):
        """Temporarily let the model's parameters be the FP32 masters (for state_dict save/load)."""
        saved = [(p, p.data) for p, _ in self._pairs]
        for p, m in self._pairs:
            p.data = m.data
        try:
            yield
        finally:
            for p, data in saved:
                p.data = data
            self.after_optimizer_step()

    @property
    def master_params(self) -> list[nn.Parameter]:
        return [m for _, m in self._pairs]

    def state_dict(self) -> dict:
        return {"mode": self.mode, "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") not in (None, self.mode):
            raise ConfigError(
                f"checkpoint was trained with precision={state['mode']!r} but this Engine uses "
                f"{self.mode!r}; pass config=Config(precision={state['mode']!r}) to resume it exactly"
            )
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def _cuda_bf16_native(device: torch.device) -> bool:
    from .. import hardware

    return hardware.cuda_bf16_native(device)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (unscaling it in place unscales the DTensor), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t

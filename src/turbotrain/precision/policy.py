"""Precision modes: what the model computes in, what the optimizer updates, and how loss is scaled.

fp32           everything FP32.
bf16/fp16-mixed  torch.autocast picks per-op dtypes; weights stay FP32 (cast again every forward).
bf16/fp16-master the model itself is held in bf16/fp16 (no per-op casts in forward or backward);
               the optimizer updates FP32 master copies, which are copied back after each step, so
               small updates are not rounded away (pure bf16 training drifts without them).
In every low-precision mode KeepFp32Mode keeps softmax, norms, losses, reductions and FFTs in FP32 and
the norm layers' own weights stay FP32; in the master modes it also casts the FP32 activations a
model makes itself to the low dtype at the next matmul, as autocast would.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from ..errors import ConfigError, HardwareError
from ..plan import ApplyContext, ModelPlan, StepContext, Transform
from ..utils import local_shard
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
        self._model: nn.Module | None = None
        self._fp32_view = False
        self.fp32_modules: list[str] = []
        """Modules moved to FP32 while training (the runtime keep-list; guards.py heals with it)."""
        self.switched_from: str | None = None
        """The fp16 mode this run started in, once it switched to bf16 while training."""
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
        runtime = f"; FP32 since training began: {', '.join(p or '<model>' for p in self.fp32_modules)}" \
            if self.fp32_modules else ""
        switched = f"; switched from {self.switched_from}" if self.switched_from else ""
        return f"precision {self.mode} ({self.reason}){switched}{runtime}"

    def apply(self, model: nn.Module, plan: ModelPlan, ctx: ApplyContext) -> None:
        self._model = model
        if self.sharded:
            return
        if not self.master:
            low = [(n, p) for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
            if low:
                mode = repr(self.mode) if self.requested == self.mode else f"{self.requested!r} (chose {self.mode!r})"
                _warn_low_precision_model(mode, low)
            return
        keep = set(plan.norm_params)
        if self.keep_fp32_head:
            keep.update(plan.head_params())
        norm_modules = {m for m in model.modules() if any(p in plan.norm_params for p in m.parameters(recurse=False))}
        for p in model.parameters():
            if p in keep and p.is_floating_point() and p.dtype != torch.float32:
                # A model handed over in bf16/fp16 (from_pretrained(torch_dtype=...)): its norm weights would
                # step in that dtype with no master, where an update below 2^-8 of a weight near 1 is lost.
                p.data = p.data.float()
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
        model.register_forward_pre_hook(self._cast_model_inputs, with_kwargs=True)
        for module in norm_modules - {m for m in norm_modules if isinstance(m, KEEP_FP32_MODULES)}:
            # A hand-written norm (HF's LlamaRMSNorm) multiplies its FP32 weight into the result, which
            # promotes it to FP32; hand the next matmul the dtype the norm was given, as torch's do.
            module.register_forward_hook(_output_like_input)
        if self.keep_fp32_head and plan.head is not None:
            plan.head.register_forward_pre_hook(_cast_inputs(torch.float32), with_kwargs=True)

    def _cast_model_inputs(self, module, args, kwargs):
        """The model's inputs in the run's dtype (read at every call: the dtype may switch fp16 -> bf16)."""
        if self._fp32_view:  # fp32_compute(): the model runs on its FP32 masters
            return None
        return _cast_inputs(self.dtype)(module, args, kwargs)

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
            stack.enter_context(KeepFp32Mode(match_operands=self.master))
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
            ctx.found_inf = self.scaler.unscale_and_check_([local_shard(g) for g in ctx.grads])

    def after_optimizer_step(self) -> None:
        """Copy the updated FP32 masters back into the low-precision model (one fused copy)."""
        if self._pairs:
            torch._foreach_copy_([p.data for p, _ in self._pairs], [m.data for _, m in self._pairs])

    def reset_grads(self) -> None:
        for p, m in self._pairs:
            p.grad = None
            m.grad = None

    @contextlib.contextmanager
    def _masters_as_weights(self):
        saved = [(p, p.data) for p, _ in self._pairs]
        for p, m in self._pairs:
            p.data = m.data
        try:
            yield
        finally:
            for p, data in saved:
                p.data = data

    @contextlib.contextmanager
    def full_precision_weights(self):
        """Temporarily let the model's parameters be the FP32 masters (for state_dict save/load)."""
        try:
            with self._masters_as_weights():
                yield
        finally:
            self.after_optimizer_step()

    @contextlib.contextmanager
    def fp32_compute(self):
        """Let the model compute as an FP32 model for a while (the guards' FP32 shadow check): the masters
        as weights, FP32 buffers, inputs not cast. The caller enters no autocast; nothing is copied back."""
        buffers = [(m, name, b) for m in (self._model.modules() if self._model is not None else ())
                   for name, b in m.named_buffers(recurse=False) if b is not None and b.dtype in _DTYPES.values()]
        with self._masters_as_weights():
            for m, name, b in buffers:
                setattr(m, name, b.float())
            self._fp32_view = True
            try:
                yield
            finally:
                self._fp32_view = False
                for m, name, b in buffers:
                    setattr(m, name, b)

    # -- changes while training (guards.py) --------------------------------------------------
    def keep_module_fp32(self, path: str) -> None:
        """From now on run the module at ``path`` ('' for the whole model) in FP32: its parameters are its
        FP32 masters themselves (the optimizer is not touched), its buffers FP32, its inputs upcast, autocast
        off inside it; outputs go back to the input's low dtype in the master modes (the next layer's)."""
        if self._model is None or self.dtype is None or path in self.fp32_modules:
            return
        module = self._model.get_submodule(path)
        own = set(module.parameters())
        for p, m in self._pairs:
            if p in own:
                p.data = m.data  # shared storage: the optimizer's update is the module's weight
        for sub in module.modules():
            for name, b in sub.named_buffers(recurse=False):
                if b is not None and b.dtype in _DTYPES.values():
                    setattr(sub, name, b.float())
        module.forward = _Fp32Forward(module.forward, self.device.type, cast_back=self.master)
        self.fp32_modules.append(path)

    def switch_to_bf16(self) -> None:
        """fp16 -> bf16 while training: bf16 has FP32's exponent range, so no loss scaling is needed."""
        if self.dtype is not torch.float16:
            return
        self.switched_from, self.mode = self.mode, "bf16-" + self.mode.split("-", 1)[1]
        self.dtype, self.scaler = torch.bfloat16, None
        healed = {p for path in self.fp32_modules for p in self._model.get_submodule(path).parameters()}
        for p, m in self._pairs:
            if p not in healed:
                p.data = m.data.to(torch.bfloat16)
        for module in self._model.modules() if self._model is not None else ():
            for name, b in module.named_buffers(recurse=False):
                if b is not None and b.dtype is torch.float16:
                    setattr(module, name, b.to(torch.bfloat16))

    @property
    def master_params(self) -> list[nn.Parameter]:
        return [m for _, m in self._pairs]

    def state_dict(self) -> dict:
        return {"mode": self.mode, "scaler": self.scaler.state_dict() if self.scaler else None,
                "fp32_modules": list(self.fp32_modules), "switched_from": self.switched_from}

    def load_state_dict(self, state: dict) -> None:
        if state.get("switched_from") is not None and state["switched_from"] == self.mode != state.get("mode"):
            self.switch_to_bf16()  # the run switched while training: resume it the way it ran
            logger.info("precision: resumed in %s (the checkpointed run switched from %s)", self.mode,
                        self.switched_from)
        if state.get("mode") not in (None, self.mode):
            raise ConfigError(
                f"checkpoint was trained with precision={state['mode']!r} but this Engine uses "
                f"{self.mode!r}; pass config=Config(precision={state['mode']!r}) to resume it exactly"
            )
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        for path in state.get("fp32_modules") or ():
            self._restore_fp32_module(path)

    def _restore_fp32_module(self, path: str) -> None:
        try:
            self.keep_module_fp32(path)
        except AttributeError:
            warnings.warn(f"the checkpoint ran module {path!r} in FP32, but this model has no such module (another "
                          "architecture or fusion setting?); it runs in the run's precision", stacklevel=4)
            return
        logger.info("precision: %s runs in FP32, as in the checkpointed run", path or "<model>")


class _Fp32Forward:
    """A module's forward run in FP32: low-precision inputs upcast, autocast off; with ``cast_back``,
    floating outputs go back to the dtype of the first low-precision input."""

    def __init__(self, forward, device_type: str, cast_back: bool):
        self.forward, self.device_type, self.cast_back = forward, device_type, cast_back

    def __call__(self, *args, **kwargs):
        low = next((t.dtype for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor) and t.dtype in _DTYPES.values()), None)
        if low is not None:
            args, kwargs = tree_map_only(torch.Tensor, _to_fp32, (args, kwargs))
        with torch.autocast(self.device_type, enabled=False):
            out = self.forward(*args, **kwargs)
        if low is not None and self.cast_back:
            out = tree_map_only(torch.Tensor, lambda t: t.to(low) if t.dtype is torch.float32 else t, out)
        return out


def _warn_low_precision_model(mode: str, low: list) -> None:
    """precision=fp32 (or a -mixed mode, which keeps FP32 parameters) on a model whose parameters came in a
    lower precision: the Engine leaves the model's dtype as it is, and says what that means once."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for _, p in low})
    warnings.warn(
        f"precision={mode}, but {len(low)} of the model's parameters are {'/'.join(dtypes)} (e.g. {low[0][0]!r}): "
        "the Engine leaves the model's dtype alone, so they train in that dtype, optimizer step included, with no "
        "FP32 copy (a norm weight near 1 loses any update below 2^-8 of it in bf16). For FP32 master weights use "
        "a master mode (precision='bf16-master'); for FP32 training call model.float() before building the Engine.",
        stacklevel=5,
    )


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _DTYPES.values() else t


def _cuda_bf16_native(device: torch.device) -> bool:
    from .. import hardware

    return hardware.cuda_bf16_native(device)

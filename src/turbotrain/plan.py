"""The transform protocol and the model plan the transforms share.

Every feature the Engine can switch on (fusion, activation checkpointing, precision, data
parallel, compile) is a :class:`Transform`. The Engine applies them in one order, builds the
optimizer from the parameters they leave behind, and then only calls their hooks:

    place(device)              before the model moves: pick the device (data parallel: the rank's GPU)
    apply(model, plan, ctx)    change the model in place, record what was learnt in the plan
    verify(model, plan, ctx)   every transform has applied: check what only the final model shows
    wrap_module(module, ...)   wrap the module the forward calls (DDP), after the optimizer exists
    wrap_runner(runner, ...)   wrap the function that runs forward and loss (torch.compile)
    forward_context()          around forward and loss (autocast, the FP32 keep-list)
    accumulate_context(last)   around a micro-batch's backward (DDP's no_sync)
    scale_loss(loss)           before backward (fp16 loss scaling)
    before_optimizer_step(ctx) gradients ready: move them to masters, unscale, vote on inf/NaN
    after_optimizer_step()     the optimizer stepped: copy masters back
    state_dict / load_state_dict

The :class:`ModelPlan` is where transforms tell each other what they found: which modules are
norms, which Linear is the head, which fused parameter stands for which stock ones, and which
FP32 master stands for which model parameter. Fusion writes it, precision and checkpointing read
it, so an FP32 norm stays FP32 inside a fused LayerNorm+GELU. When the Engine's set-up ends,
:meth:`ModelPlan.settle` keeps, by name, where each stock parameter now lives and forgets every
Parameter the model no longer holds.
"""

from __future__ import annotations

from collections.abc import Mapping

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from .utils import leaves_no_trace

__all__ = ["Transform", "ModelPlan", "ApplyContext", "StepContext", "is_norm_module", "find_head", "NORM_MODULE_TYPES"]


#: torch's normalisation layers (their parameters stay FP32 in every low-precision mode).
NORM_MODULE_TYPES = (
    nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm, nn.InstanceNorm1d,
    nn.InstanceNorm2d, nn.InstanceNorm3d,
)


def is_norm_module(module: nn.Module) -> bool:
    """A normalisation layer, whatever library wrote it (torch's, HF's LlamaRMSNorm, a user's).

    Judged by structure first (torch's norm types), then by the class name and the shape of its
    parameters: a norm holds only 1-D scale/shift vectors.
    """
    if isinstance(module, NORM_MODULE_TYPES):
        return True
    params = list(module.parameters(recurse=False))
    name = type(module).__name__.lower()
    return bool(params) and "norm" in name and all(p.dim() == 1 for p in params) \
        and not list(module.children())


@dataclass
class ModelPlan:
    """What the transforms learnt about the model, keyed by Parameter / module identity."""

    norm_params: set = field(default_factory=set)
    """Parameters of normalisation layers (kept FP32 in every low-precision mode)."""
    head: Optional[nn.Module] = None
    """The module that produces the logits the loss reads (a Linear, or the fused loss head)."""
    head_path: Optional[str] = None
    fused_from: dict = field(default_factory=dict)
    """Stock Parameter -> the fused Parameter (or (Parameter, row slice)) that now holds it, until
    settle() drops the entries of the Parameters fusion took out of the model (all of them)."""
    master_of: dict = field(default_factory=dict)
    """Model Parameter -> its FP32 master (master-weight precision modes), or -> its shard (FSDP2, until
    settle() drops the entries of the Parameters the shards replaced)."""
    stock_layout: dict = field(default_factory=dict)
    """Stock parameter name -> (the Parameter the optimizer steps for it, row slice or None), in model
    order; set by settle() when the Engine's set-up ends. The stock-layout optimizer state reads it."""
    loss_head: object = None
    """The fused linear+cross-entropy head when it replaced the loss (fusion/loss_head.py)."""
    notes: list = field(default_factory=list)
    """One line per decision a transform took on its own (printed by the Engine's describe())."""

    def record_norms(self, model: nn.Module) -> None:
        for module in model.modules():
            if is_norm_module(module):
                self.norm_params.update(module.parameters(recurse=False))

    def locate(self, param: nn.Parameter) -> tuple[nn.Parameter, Optional[slice]]:
        """(the Parameter the optimizer steps for ``param``, row slice or None): fused into another, then
        mastered or sharded. Valid during set-up, while the maps still hold the replaced Parameters."""
        target = self.fused_from.get(param, param)
        target, rows = target if isinstance(target, tuple) else (target, None)
        return self.master_of.get(target, target), rows

    def settle(self, stock: list[tuple[str, nn.Parameter]], model: nn.Module) -> None:
        """The end of set-up: record where each of ``stock`` (the model's named parameters before the
        transforms) now lives, by name, and drop every entry whose Parameter the model no longer holds.

        The Parameters fusion concatenated and FSDP2 sharded are out of the model by now; a dict keyed
        by them would keep each one's whole tensor alive for as long as the Engine lives (an FSDP rank
        would hold the unsharded model next to its shards).
        """
        self.stock_layout = {name: self.locate(p) for name, p in stock}
        live = set(model.parameters())
        self.fused_from = {p: target for p, target in self.fused_from.items() if p in live}
        self.master_of = {p: master for p, master in self.master_of.items() if p in live}
        self.norm_params = {p for p in self.norm_params if p in live}

    def head_params(self) -> list[nn.Parameter]:
        if self.head is None:
            return []
        site = getattr(self.head, "site", None)
        if site is not None:  # a head the model computes with F.linear: its Parameters live on other modules
            return [p for p in (site.weight, site.bias) if p is not None]
        return list(self.head.parameters())


@dataclass
class ApplyContext:
    """What a transform may need while it changes the model."""

    device: torch.device
    example: object = None
    """The first batch (already on the device), for transforms that probe the model."""
    optimizer: Optional[torch.optim.Optimizer] = None
    """Set only for the wrap hooks: the optimizer the Engine steps."""
    loss_contract: object = None
    """The Engine's batch/loss contract (batch.py), for transforms that verify against the loss."""
    dtype: Optional[torch.dtype] = None
    """The low-precision dtype the run computes in (None for FP32), so sites are verified in it."""
    forward_context: object = None
    """A callable returning the run's forward context (autocast, FP32 keep-list)."""


@dataclass
class StepContext:
    """What the hooks around an optimizer step share."""

    params: list = field(default_factory=list)
    """The parameters the optimizer steps (FP32 masters in the master modes)."""
    grads: list = field(default_factory=list)
    """The gradients the optimizer will see (after before_optimizer_step)."""
    found_inf: Optional[torch.Tensor] = None
    """On-device inf/NaN flag (fp16 loss scaling), agreed across ranks."""


class Transform:
    """The base of every Engine feature. Every hook is optional; the defaults do nothing."""

    name: str = "transform"
    #: True when apply() needs the first batch (the Engine then applies it lazily, at the first step).
    needs_example: bool = False

    def place(self, device: torch.device) -> torch.device:
        return device

    def apply(self, model: nn.Module, plan: ModelPlan, ctx: ApplyContext) -> None:
        pass

    def verify(self, model: nn.Module, plan: ModelPlan, ctx: ApplyContext) -> None:
        """After every transform's apply (the model as it will run: cast, checkpointed), before the
        optimizer is built; may undo what this transform did."""

    def wrap_module(self, module: nn.Module, plan: ModelPlan, ctx: ApplyContext) -> nn.Module:
        return module

    def wrap_runner(self, runner, plan: ModelPlan, ctx: ApplyContext):
        return runner

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def accumulate_context(self, closes_step: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def eval_context(self) -> contextlib.AbstractContextManager:
        """Entered around ``Engine.eval_loss``, which may run on some ranks only: nothing in it may
        issue a collective the other ranks would have to join."""
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def before_optimizer_step(self, ctx: StepContext) -> None:
        pass

    def after_optimizer_step(self) -> None:
        pass

    def reset_grads(self) -> None:
        """Drop any gradient the transform holds (after a step, or after a failed one)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def describe(self) -> str:
        return self.name


def _logits_of(output) -> Optional[torch.Tensor]:
    """``output.logits``, a plain dict's ``"logits"`` (else its first tensor of 2 or more dims, as for a
    tuple), or the output itself."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, Mapping):
        output = [output["logits"]] if "logits" in output else list(output.values())
    if isinstance(output, torch.Tensor):
        return output if output.dim() >= 2 else None
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    return None


_LOG_SOFTMAX_FUNCS = (torch.nn.functional.log_softmax, torch.log_softmax, torch.Tensor.log_softmax)


class _LogSoftmaxOfHead(torch.overrides.TorchFunctionMode):
    """Records, into ``outputs``, a log-softmax over the last dimension of a recorded Linear output
    under that Linear's name: a model that returns log-probabilities (``F.log_softmax(decoder(h), -1)``
    for an NLL loss, as PyTorch's word-language-model example does) has that Linear as its head.
    ``scored`` is the first Linear whose whole output a ``F.cross_entropy`` call in the forward took:
    the head of a model that returns only its loss."""

    def __init__(self, outputs: dict):
        super().__init__()
        self.outputs = outputs
        self.scored: Optional[str] = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.nn.functional.cross_entropy and self.scored is None:
            x = args[0] if args else kwargs.get("input")
            found = self.outputs.get(x.data_ptr()) if isinstance(x, torch.Tensor) else None
            if found is not None and found[1]() is not None and found[1]().numel() == x.numel():
                self.scored = found[0]
        elif (func in _LOG_SOFTMAX_FUNCS and args and isinstance(args[0], torch.Tensor)
              and isinstance(out, torch.Tensor)):
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            found = self.outputs.get(x.data_ptr())
            if found is not None and found[1]() is not None and dim is not None and dim % x.dim() == x.dim() - 1:
                self.outputs[out.data_ptr()] = (found[0], weakref.ref(out))
        return out


def find_head(model: nn.Module, run=None) -> Optional[str]:
    """The qualified name of the Linear whose output is the logits the model returns.

    Found by data flow when ``run`` (a callable that runs the model once) is given: every Linear's
    output is recorded and compared with the returned logits (or log-probabilities: the log-softmax
    over the last dimension of a Linear's output, or of a view of it); a model that returns only its
    loss has as head the Linear whose whole output its ``F.cross_entropy`` took. Without it, or when the logits
    are not a Linear's output, a Hugging Face model's ``get_output_embeddings()`` is asked; there is
    no guessing by names.
    """
    if run is not None:
        # Each Linear's output by address, with a weak reference: an output freed during the forward
        # gives its memory to later tensors, the logits among them, and must not match by address.
        outputs: dict[int, tuple[str, weakref.ref]] = {}
        handles = []
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                handles.append(module.register_forward_hook(
                    lambda mod, args, out, name=name: outputs.__setitem__(out.data_ptr(), (name, weakref.ref(out)))
                    if isinstance(out, torch.Tensor) else None))
        try:
            with torch.no_grad(), leaves_no_trace(model), _LogSoftmaxOfHead(outputs) as mode:
                logits = _logits_of(run())
        finally:
            for h in handles:
                h.remove()
        if logits is None and mode.scored is not None:  # the model returned its loss alone
            return mode.scored
        name, ref = outputs.get(logits.data_ptr(), (None, None)) if logits is not None else (None, None)
        if ref is not None and ref() is not None:
            return name
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        head = get()
        if isinstance(head, nn.Linear):
            return next(n for n, m in model.named_modules() if m is head)
    return None

"""Engine: train the user's model as it is, with the transforms the Config names, in one order.

    fusion -> activation checkpointing -> precision   (change the model; record what they learn
                                                       in the ModelPlan)
    the optimizer is bound                            (the user's instance re-pointed, or built
                                                       by the user's factory, over what is left)
    data parallel                                     (DDP over the final parameters)
    compile                                           (last: one graph for forward and loss)

Transforms that need to see a batch (fusion verifies every site on it) make the Engine finish its
set-up at the first ``step``; until then ``engine.optimizer`` is the instance passed in (or None
for a factory). See docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch import nn

from . import checkpoint as ckpt
from .batch import Batch, ContractCall, LossContract, as_batch, check_batch_keys, check_loss, pad_to_bucket
from .config import Config
from .errors import CheckpointError, ConfigError, DistributedError, HardwareError, MetaInitError, TurbotrainError
from .guards import Guards, ShadowCheck, StepSkipped
from .memory.checkpoint import recompute_user_checkpoints_under_forward_modes
from .optim_layout import bind_optimizer, check_optimizer_params, load_stock_state_dict, stock_state_dict
from .plan import ApplyContext, ModelPlan, StepContext, Transform, find_head
from .precision import Precision, warn_misaligned

__all__ = ["Engine", "StepStats", "build_transforms"]

logger = logging.getLogger(__name__)

OptimizerArg = Union[torch.optim.Optimizer, Callable[..., torch.optim.Optimizer]]


@dataclass
class StepStats:
    """What one ``Engine.step`` did. Tensors stay on the device (no host sync) unless sync_stats."""

    loss: torch.Tensor
    """Unscaled loss of this micro-batch (0-d, detached)."""
    micro_step: int
    """Index of this micro-batch within its optimizer step (0 .. accumulate-1)."""
    step: int
    """Optimizer steps taken so far, skipped ones included."""
    optimizer_stepped: bool
    """True when this micro-batch closed an optimizer step (whether or not it was skipped)."""
    skipped: bool = False
    """True when the optimizer step was skipped (inf/NaN gradients)."""
    skip_reason: str | None = None
    loss_scale: float | None = None
    """Current dynamic loss scale (fp16 modes), else None."""
    grad_norm: torch.Tensor | float | None = None
    """Global L2 norm of the unscaled gradients (when clipping or track_grad_norm)."""
    recompiles: int = 0
    """Graphs torch.compile built after the first step (compile=True): 0 while shapes are stable."""
    shadow: ShadowCheck | None = None
    """The FP32 shadow check run on this micro-batch (Config(guards=...)), on the steps it is due."""


def _resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise HardwareError("device='cuda' was asked for but no CUDA device is visible; use device='cpu' or 'auto'")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def build_transforms(config: Config, device: torch.device) -> list[Transform]:
    """The Config's transforms in the order the Engine applies them."""
    out: list[Transform] = []
    if config.fuse:
        from .fusion.transform import FusionTransform, patterns_for

        out.append(FusionTransform(*patterns_for(config.fuse, device, config.compile)))
    if config.checkpoint:
        from .memory.transform import CheckpointTransform

        out.append(CheckpointTransform(config.checkpoint, config.checkpoint_every))
    out.append(Precision(config.precision, device, config.loss_scale, config.keep_fp32_head,
                         sharded=config.parallel is not None))
    if config.parallel is not None:
        from .parallel import ParallelTransform

        out.append(ParallelTransform(config.parallel, keep_fp32_head=config.keep_fp32_head, compile=config.compile))
    if config.data_parallel is not None:
        from .comm.transform import DataParallelTransform

        out.append(DataParallelTransform(config.data_parallel))
    if config.compile:
        from .fusion.compile import CompileTransform

        # auto never picks plain attention under activation checkpointing: the recomputation in
        # backward runs outside the mode, so it would save other tensors than the forward did
        auto = None if config.checkpoint is None else False
        out.append(CompileTransform(attention={"auto": auto, "plain": True, "stock": False}[config.attention]))
    if config.guards is not None:
        out.append(Guards(config.guards))
    return out


def _unwrap_compiled(model: nn.Module, config: Config) -> tuple[nn.Module, Config]:
    """A model handed over as ``torch.compile(model)``: the module inside it, trained with the Engine's own
    compile of forward and loss (said once). The wrapper's graphs are guarded on the module's hooks, which
    the set-up's checks add and remove, so it would recompile at each of them, reach Dynamo's limit of
    8 and then run uncompiled for the rest of the run."""
    inner = getattr(model, "_orig_mod", None)
    if not isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or not isinstance(inner, nn.Module):
        return model, config
    if not config.compile:
        config = dataclasses.replace(config, compile=True)
    warnings.warn("the model was passed wrapped by torch.compile: the Engine trains the module inside it and "
                  "compiles forward and loss as one graph itself (Config(compile=True)); the wrapper and its "
                  "options are not used. Pass the module itself (model._orig_mod) to choose: compile=False "
                  "runs it eagerly.", stacklevel=3)
    return inner, config


class Engine:
    """Train ``model`` with ``optimizer``; the loss is ``loss_fn``'s or, without one, the model's own.

    ``optimizer`` is a torch.optim.Optimizer over ``model.parameters()`` (the Engine steps that same
    object) or a factory ``lambda params: torch.optim.AdamW(params, ...)`` called after the
    transforms. ``scheduler`` likewise: an LR scheduler bound to that optimizer, or a factory
    ``lambda optimizer: ...``. Batches follow the contract in :mod:`turbotrain.batch`.

    A model built under ``torch.device("meta")`` (with ``Config(parallel=...)``) is sharded before any
    weight exists, and each rank allocates only its shards. ``init_weights(model)`` is what its eager
    build ran to initialise it (by default ``turbotrain.parallel.reset_parameters``: torch's own), and
    the shards get exactly those values (docs/parallel.md, "Building on the meta device").

    >>> import torch, turbotrain
    >>> model = torch.nn.Linear(8, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> engine = turbotrain.Engine(model, opt, torch.nn.functional.cross_entropy,
    ...                            config=turbotrain.Config(accumulate=2, device="cpu"))
    >>> batch = (torch.randn(4, 8), torch.tensor([0, 1, 0, 1]))
    >>> [engine.step(batch).optimizer_stepped for _ in range(2)]
    [False, True]
    >>> engine.optimizer is opt
    True
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerArg, loss_fn: Optional[Callable] = None,
                 config: Config | None = None, scheduler=None,
                 init_weights: Optional[Callable[[nn.Module], None]] = None):
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer or a factory taking the parameters, "
                              f"got {type(optimizer).__name__}")
        if isinstance(loss_fn, Config):
            raise ConfigError("a Config was passed as the third argument, which is loss_fn; "
                              "write Engine(model, optimizer, config=turbotrain.Config(...)) "
                              "(and loss_fn=... if the model does not compute its own loss)")
        if config is None:
            config = Config()
        elif not isinstance(config, Config):
            raise ConfigError(f"config must be a turbotrain.Config, got {type(config).__name__}; "
                              "write config=turbotrain.Config(**settings)")
        model, config = _unwrap_compiled(model, config)
        if scheduler is not None and not callable(scheduler) and not hasattr(scheduler, "step"):
            raise ConfigError("scheduler must be an LR scheduler or a factory taking the optimizer")
        self.config = config
        self.contract = LossContract(loss_fn)
        self.loss_fn = loss_fn
        if isinstance(optimizer, torch.optim.Optimizer):
            check_optimizer_params(optimizer, list(model.named_parameters()))
        self._optimizer_arg, self._scheduler_arg = optimizer, scheduler
        self.optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self.scheduler = None if (scheduler is None or callable(scheduler) and not hasattr(scheduler, "step")) \
            else scheduler

        device = _resolve_device(config.device)
        self.transforms = build_transforms(config, device)
        meta = self._record_meta_init(model, init_weights)  # before place(): its refusals need no process group
        for t in self.transforms:
            device = t.place(device)
        self.device = device
        self.precision: Precision = self._transform("precision")
        self.guards: Guards | None = self._transform("guards")
        """The guards (Config(guards=...)): ``engine.guards.last`` is the latest FP32 shadow check."""
        self.plan = ModelPlan()
        self.module = model if meta else model.to(device)  # a meta model is allocated shard by shard at set-up
        """The model itself (unwrapped from DDP and compile); its state_dict is the stock layout."""
        self.model = self.module
        """What a forward pass calls (DDP-wrapped once set up)."""
        self._runner = None
        self._pending_state: dict | None = None
        self._micro = 0
        self.steps = 0
        self.skipped_steps = 0
        self._advised = False
        self._checked_keys: frozenset = frozenset()  # the last dict batch's keys check_batch_keys passed
        if not self._needs_example():
            self._setup(None)

    # -- set-up --------------------------------------------------------------------------------
    def _record_meta_init(self, model: nn.Module, init_weights) -> bool:
        """A model built on the meta device: check the Config can materialise it and record its init, drawing
        from the global generator now, as its eager build would have (docs/parallel.md, "Building on the meta
        device"). False for a model with real weights."""
        if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            if init_weights is not None:
                raise MetaInitError("init_weights= initialises a model built on the meta device, but this model's "
                                    "weights are real already; drop init_weights, or build the model under "
                                    "torch.device('meta') to have each rank allocate only its shards")
            return False
        from .parallel.meta_init import check_meta_config, record_init

        check_meta_config(self.config)
        self._transform("parallel").meta_init = record_init(model, init_weights)
        return True

    def _transform(self, name: str):
        return next((t for t in self.transforms if t.name == name), None)

    @property
    def comm(self):
        """The data-parallel CommState, or None."""
        dp = self._transform("data_parallel")
        return dp.state if dp is not None else None

    @property
    def fusion_report(self):
        fusion = self._transform("fusion")
        return fusion.report if fusion is not None else None

    def _needs_example(self) -> bool:
        return any(t.needs_example for t in self.transforms) or self.config.keep_fp32_head

    @property
    def ready(self) -> bool:
        """True once the transforms are applied and the optimizer is bound."""
        return self._runner is not None

    def _setup(self, example: Optional[Batch]) -> None:
        model, plan = self.module, self.plan
        stock = list(model.named_parameters())  # as the user built them: the names checkpoints are keyed by
        ctx = ApplyContext(self.device, example, loss_contract=self.contract, dtype=self.precision.dtype,
                           forward_context=self.autocast)
        plan.record_norms(model)
        run = None if example is None else (lambda: model(*example.args, **example.kwargs))
        plan.head_path = find_head(model, run)
        plan.head = model.get_submodule(plan.head_path) if plan.head_path else None
        if self.config.keep_fp32_head and plan.head is None:
            head = None
            if example is not None:
                from .fusion.loss_head import functional_head_of

                # F.linear(h, self.wte.weight) or h @ W.t(): kept FP32 through the mode that reaches it
                head = functional_head_of(model, example, self.autocast)
            if head is None:
                warnings.warn("keep_fp32_head=True, but no Linear produces the logits the model returns (nor "
                              "F.linear or a matmul on a transposed Parameter), so no head is kept in FP32",
                              stacklevel=3)
            elif self.config.parallel is not None:
                warnings.warn(f"keep_fp32_head=True: the head is {head.name} used in F.linear or a matmul, which "
                              "the sharded run does not keep in FP32 (it shards the modules that hold it); an "
                              "nn.Linear head is kept FP32 there", stacklevel=3)
            else:
                plan.head = head
        for t in self.transforms:
            t.apply(model, plan, ctx)
        for t in self.transforms:
            t.verify(model, plan, ctx)
        self.optimizer = bind_optimizer(self._optimizer_arg, plan, model)
        self._bind_scheduler()
        ctx.optimizer = self.optimizer
        forward_module = model
        for t in self.transforms:
            forward_module = t.wrap_module(forward_module, plan, ctx)
        self.model = forward_module
        runner = self._forward_loss
        for t in self.transforms:
            runner = t.wrap_runner(runner, plan, ctx)
        self._runner = runner
        # Set-up ends: where each stock parameter lives is kept by name, and the Parameters fusion and
        # FSDP replaced are let go (an eager FSDP build would otherwise keep the whole model per rank).
        plan.settle(stock, model)
        del stock
        for t in self.transforms:
            logger.info("%s", t.describe())
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            if "sharded_path" in state:
                self.load_sharded(state["sharded_path"])
            else:
                self._load_after_setup(state)

    def _bind_scheduler(self) -> None:
        arg = self._scheduler_arg
        if arg is None:
            return
        if hasattr(arg, "step") and hasattr(arg, "optimizer"):
            if arg.optimizer is not self.optimizer:
                raise ConfigError("the scheduler is bound to another optimizer than the one the Engine steps; "
                                  "build it on the optimizer you pass, or pass a factory: "
                                  "scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, ...)")
            self.scheduler = arg
        else:
            self.scheduler = arg(self.optimizer)

    def describe(self) -> str:
        """One line per transform: what it chose and found."""
        return "\n".join(t.describe() for t in self.transforms)

    # -- the step ------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """The context forward passes run under (autocast and the FP32 keep-list)."""
        stack = contextlib.ExitStack()
        for t in self.transforms:
            stack.enter_context(t.forward_context())
        stack.enter_context(recompute_user_checkpoints_under_forward_modes())
        return stack

    def _forward_loss(self, args, kwargs, targets, kind: str):
        """Forward and loss of one micro-batch: the function torch.compile sees as one graph."""
        head = self.plan.loss_head
        batch = Batch(args, kwargs, targets, kind=kind)
        if head is not None:
            from .fusion.loss_head import head_calls, loss_targets, own_loss, through_own_call

            with head_calls(head):  # a head the model computes with F.linear is reached through a mode
                if through_own_call(batch, head):  # the run's own cross-entropy call is the fused one
                    return own_loss(self.model, head, batch, self.contract)
                labels, call = loss_targets(batch, self.module)
                head.arm(labels)
                self.model(*call.args, **call.kwargs)
                return head.take_loss()
        if getattr(self.plan.head, "site", None) is not None:  # keep_fp32_head on a head written as F.linear
            from .fusion.loss_head import head_calls

            with head_calls(self.plan.head):
                return self.contract.loss(self.model(*args, **kwargs), batch)
        return self.contract.loss(self.model(*args, **kwargs), batch)

    def _prepare_batch(self, batch) -> Batch:
        b = as_batch(batch, self.device, self.loss_fn is not None)
        if b.kind == "mapping" and frozenset(b.kwargs) != self._checked_keys:  # each new key set once
            check_batch_keys(self.module, b)
            self._checked_keys = frozenset(b.kwargs)
        if not self.ready:
            self._setup(b)
        if self.config.seq_buckets:  # pad to a few lengths so torch.compile sees few shapes
            b = pad_to_bucket(b, self.config.seq_buckets, self.module)
        return b

    def step(self, batch) -> StepStats:
        """Forward, backward and (every ``accumulate`` calls) the optimizer step on one micro-batch.

        Whatever this raises, the Engine is left as before the call's micro-batch (its gradients
        dropped, the accumulation restarted), so the next good batch trains.
        """
        b = self._prepare_batch(batch)
        try:
            return self._step(b)
        except StepSkipped as skipped:  # the guards absorbed an inf/NaN step (GuardConfig(heal=True))
            return self._skip_absorbed(skipped)
        except BaseException as exc:
            self._drop_gradients()
            self._micro = 0
            lost = _lost_peer(exc) if self.comm is not None else None
            if lost is not None:
                import torch.distributed as dist

                raise DistributedError(
                    f"rank {dist.get_rank()} of {dist.get_world_size()}: the gradient exchange of step "
                    f"{self.steps + 1} failed ({lost}); another rank died or stalled past the process-group "
                    "timeout (DataParallelConfig.timeout_s). Restart every rank and resume with "
                    "Engine.load(<last checkpoint>)") from exc
            raise

    def _step(self, b: Batch) -> StepStats:
        cfg = self.config
        if not self._advised:
            self._advised = True
            if self.precision.dtype is not None:
                warn_misaligned(self.module, b.size)
        micro = self._micro
        closes_step = micro + 1 == cfg.accumulate
        guards = self.guards
        shadow_rng = guards.begin(self, b, micro) if guards is not None else None  # set only when a check is due
        with contextlib.ExitStack() as stack:
            for t in self.transforms:
                stack.enter_context(t.accumulate_context(closes_step))
            with self.autocast():
                loss = self._runner(b.args, b.kwargs, b.targets, b.kind)
            check_loss(loss, self.contract.source if self.plan.loss_head is None else "the fused loss head")
            scaled = loss / cfg.accumulate if cfg.accumulate > 1 else loss
            for t in self.transforms:
                scaled = t.scale_loss(scaled)
            scaled.backward()
        if cfg.nan_check:
            self._check_finite(loss, b)
        stats = StepStats(loss=loss.detach(), micro_step=micro, step=self.steps, optimizer_stepped=closes_step)
        if shadow_rng is not None:
            stats.shadow = guards.shadow_check(self, b, loss, shadow_rng)
        if closes_step:
            self._optimizer_step(stats)
        self._micro = 0 if closes_step else micro + 1
        if self.precision.scaler is not None:
            stats.loss_scale = self.precision.scaler.scale
        compile_t = self._transform("compile")
        if compile_t is not None:
            stats.recompiles = compile_t.recompiles()
        if cfg.sync_stats:
            stats.loss = stats.loss.item()
            if isinstance(stats.grad_norm, torch.Tensor):
                stats.grad_norm = stats.grad_norm.item()
        return stats

    def _optimizer_step(self, stats: StepStats) -> None:
        cfg = self.config
        ctx = StepContext(params=[p for g in self.optimizer.param_groups for p in g["params"]])
        for t in self.transforms:
            t.before_optimizer_step(ctx)
        if getattr(self.plan, "sharded", False):  # DTensor gradients, possibly on several meshes
            from .parallel import clip_grad_norm_, grad_norm
        else:
            clip_grad_norm_, grad_norm = torch.nn.utils.clip_grad_norm_, torch.nn.utils.get_total_norm
        if cfg.clip_grad_norm is not None:
            stats.grad_norm = clip_grad_norm_(ctx.params, cfg.clip_grad_norm, foreach=True)
        elif cfg.track_grad_norm:
            stats.grad_norm = grad_norm(ctx.grads, foreach=True)
        # The one host sync of a step, and only in the fp16 modes: the skip decision.
        skip = False
        if ctx.found_inf is not None:
            scale = self.precision.scaler.scale
            skip = self.precision.scaler.update(bool(ctx.found_inf.item()))
        if skip:
            stats.skipped = True
            stats.skip_reason = f"inf/NaN gradients at loss scale {scale:g}; scale now {self.precision.scaler.scale:g}"
            self.skipped_steps += 1
        else:
            self.optimizer.step()
            for t in self.transforms:
                t.after_optimizer_step()
            if self.scheduler is not None:
                self.scheduler.step()
        if ctx.found_inf is not None and self.guards is not None:  # healing may switch fp16 -> bf16 here
            self.guards.after_scaler_update(self, skip, scale)
        self._drop_gradients()
        self.steps += 1
        stats.step = self.steps

    def _drop_gradients(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)
        for t in self.transforms:
            t.reset_grads()

    def _check_finite(self, loss: torch.Tensor, batch: Batch) -> None:
        """One fused finiteness test of the loss and gradients, agreed across ranks; on failure, name the origin."""
        from . import diagnose

        scaler = self.precision.scaler
        # Scaled fp16 gradients may overflow legitimately: the loss scaler skips those steps.
        grads = [] if scaler else [p.grad for p in self.module.parameters()]
        flag = diagnose.nonfinite_flag(loss, grads)  # local: a sharded gradient is read as this rank's shard
        sharded = getattr(self.plan, "sharded", False)
        # Another rank may see what this one does not (its rows, its shards): all ranks stop, or none.
        if sharded:
            from .parallel import agree_found_inf, nonfinite_error

            flag = agree_found_inf(flag)
        elif self.comm is not None:
            flag = self.comm.agree_found_inf(flag)
        if not bool(flag):
            return
        if sharded:  # the replay below would be a collective the ranks run apart: each rank's findings instead
            error = nonfinite_error(self.module, loss, batch, check_grads=scaler is None, step=self.steps)
            self._drop_gradients()
            raise error
        self._drop_gradients()  # the replay below makes its own
        scale = scaler.scale if scaler else 1.0
        if batch.kind == "tuple" and self.loss_fn is not None:
            report = diagnose.find_nonfinite(self.module, self.loss_fn, (batch.args[0], batch.targets),
                                             autocast=self.autocast, loss_scale=scale)
        else:  # the finder calls model(inputs): let it call the model the way the contract does
            report = diagnose.find_nonfinite(ContractCall(self.module), lambda out, *_: self.contract.loss(out, batch),
                                             ((batch.args, batch.kwargs), None), autocast=self.autocast,
                                             loss_scale=scale)
        where = ""
        if self.comm is not None:
            # DDP: each rank replayed its own batch on the unwrapped module, a local run (DDP's forward, which
            # arms its reducer, never ran, and autograd.grad runs no AccumulateGrad hooks). A rank that got the
            # NaN only through the all-reduce finds nothing: every rank reports the lowest rank that found it.
            import torch.distributed as dist

            reports = [None] * self.comm.world_size
            dist.all_gather_object(reports, report, group=self.comm.group)
            origin = next((r for r, rep in enumerate(reports) if rep), None)
            report = reports[origin] if origin is not None else report  # the guards decide alike on every rank
            lines = [f"  rank {r}: " + (str(rep).splitlines()[0] if rep else "nothing in its own replay (another "
                                        "rank's inf/NaN reached it through the gradient exchange or the agreed flag)")
                     for r, rep in enumerate(reports)]
            where = (f" of a {len(reports)}-rank data-parallel run; every rank stopped at this step\n"
                     + "\n".join(lines) + (f"\nthe report of rank {origin}" if origin is not None else ""))
        self._on_nonfinite(report, loss)
        raise TurbotrainError(f"inf/NaN appeared at optimizer step {self.steps}{where}.\n{report}")

    def _on_nonfinite(self, report, loss: torch.Tensor) -> None:
        """Let the guards heal and skip an inf/NaN step (they raise StepSkipped); return to raise as before."""
        if self.guards is not None:
            self.guards.on_nonfinite(self, report, loss)

    def _skip_absorbed(self, skipped: StepSkipped) -> StepStats:
        """The guards absorbed an inf/NaN micro-batch: its optimizer step is dropped and counted as skipped."""
        micro = self._micro
        self._drop_gradients()
        self._micro = 0
        self.steps += 1
        self.skipped_steps += 1
        scaler = self.precision.scaler
        return StepStats(loss=skipped.loss, micro_step=micro, step=self.steps, optimizer_stepped=True, skipped=True,
                         skip_reason=skipped.reason, loss_scale=scaler.scale if scaler is not None else None)

    # -- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        """Mean loss over ``batches`` under the engine's precision, in eval mode, without gradients.

        Under data parallelism it may run on one rank alone (rank 0's evaluation): it issues no
        collective (``Transform.eval_context``). A sharded model's forward is collective, so there
        every rank evaluates."""
        was_training = self.module.training
        self.module.eval()
        total, count = 0.0, 0
        try:
            with contextlib.ExitStack() as stack:  # no_grad: the method's decorator
                for t in self.transforms:
                    stack.enter_context(t.eval_context())
                for batch in batches:
                    b = self._prepare_batch(batch)
                    with self.autocast():
                        total += float(self._runner(b.args, b.kwargs, b.targets, b.kind))
                    count += 1
        finally:
            self.module.train(was_training)
        if count == 0:
            raise ConfigError("eval_loss needs at least one batch")
        return total / count

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything to resume exactly. 'model' holds FP32 weights and 'optimizer' its state, both in
        the stock layout (keyed by the unfused model's parameter names)."""
        if not self.ready:
            raise CheckpointError("the Engine is not set up yet (fusion is applied at the first step); "
                                  "save after at least one engine.step")
        if getattr(self.plan, "sharded", False):
            raise CheckpointError("a sharded Engine (Config(parallel=...)) has no single-process state_dict; "
                                  "use engine.save(directory), then `turbotrain ckpt consolidate` for one file")
        with self.precision.full_precision_weights():
            model_state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        state = self._resume_state()
        state["model"] = model_state
        state["optimizer"] = stock_state_dict(self.optimizer, self.plan.stock_layout)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict; before set-up (fusion pending) it is applied at the first step."""
        ckpt.validate_structure(state)
        if state.get("model") is not None:
            self._check_model_keys(state["model"])  # before anything is changed
        self._check_compatible(state)
        if not self.ready:
            self._pending_state = state
            return
        self._load_after_setup(state)

    def _check_model_keys(self, saved: dict) -> None:
        mine = self.module.state_dict()
        # in model order, so the first names listed are the first layers that differ
        missing = [k for k in mine if k not in saved]
        unexpected = [k for k in saved if k not in mine]
        shapes = [k for k in mine if k in saved and tuple(getattr(saved[k], "shape", ())) != tuple(mine[k].shape)]
        if not (missing or unexpected or shapes):
            return

        def listed(names, describe=str):
            more = f" and {len(names) - 6} more" if len(names) > 6 else ""
            return ", ".join(describe(n) for n in names[:6]) + more

        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {listed(missing)}")
        if unexpected:
            parts.append(f"unexpected in the checkpoint: {listed(unexpected)}")
        if shapes:
            parts.append("other shapes: " + listed(shapes, lambda k: f"{k} {tuple(saved[k].shape)} in the checkpoint, "
                                                                  f"{tuple(mine[k].shape)} here"))
        raise CheckpointError(
            f"the checkpoint was saved from another model architecture ({'; '.join(parts)}); build the model it "
            "was trained with, or load the matching weights alone with "
            "turbotrain.load_model_weights(path, model, strict=False)"
        )

    def _check_compatible(self, state: dict) -> None:
        saved_type = state.get("optimizer_type")
        current = self.optimizer if self.optimizer is not None else None
        if saved_type is not None and current is not None and saved_type != _qualname(current):
            raise CheckpointError(f"the checkpoint was trained with the optimizer {saved_type}, this Engine has "
                                  f"{_qualname(current)}; pass the same optimizer class to resume")
        saved_cfg = state.get("config") or {}
        mine = self.config.to_dict()
        differ = sorted(k for k in saved_cfg if k in mine and saved_cfg[k] != mine[k] and k != "precision")
        if differ:
            listed = ", ".join(f"{k}: {saved_cfg[k]!r} -> {mine[k]!r}" for k in differ)
            warnings.warn(f"resuming with a different config ({listed}); the run continues, but it is not the "
                          "run that was saved", stacklevel=3)

    def _load_after_setup(self, state: dict) -> None:
        transforms = state.get("transforms") or {"precision": state.get("precision") or {},
                                                 "data_parallel": state.get("comm") or {}}
        self.precision.load_state_dict(transforms.get("precision") or {})
        if state["model"] is not None:  # None: a sharded checkpoint, which load_sharded already restored
            self._load_model_and_optimizer(state)
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        for t in self.transforms:
            if t.name != "precision" and transforms.get(t.name):
                t.load_state_dict(transforms[t.name])
        eng = state["engine"]
        self.steps, self._micro, self.skipped_steps = eng["steps"], eng["micro"], eng["skipped"]
        if state.get("rng") is not None:
            ckpt.set_rng_state(state["rng"])

    def _load_model_and_optimizer(self, state: dict) -> None:
        with self.precision.full_precision_weights():
            self.module.load_state_dict(state["model"])
        saved_opt = state["optimizer"]
        if saved_opt.get("layout") == "stock":
            load_stock_state_dict(self.optimizer, saved_opt, self.plan.stock_layout)
        else:  # format 1: torch's own layout, valid only for an identically built optimizer
            self.optimizer.load_state_dict(saved_opt)

    def save(self, path) -> None:
        """Write a checkpoint atomically (temporary file, fsync, rename) with a content hash."""
        if self._micro:
            raise ConfigError(
                f"save() was called in the middle of an accumulated step (micro-step {self._micro} of "
                f"{self.config.accumulate}); call it right after a step whose optimizer_stepped is True"
            )
        if getattr(self.plan, "sharded", False):
            from .parallel import save_sharded

            save_sharded(path, self.module, self.optimizer, extra=self._resume_state())
            return
        ckpt.atomic_save(self.state_dict(), path)

    def _resume_state(self) -> dict:
        """Everything but the model and optimizer (which a sharded checkpoint holds in DCP's files)."""
        return {
            "format": "turbotrain",
            "version": ckpt.FORMAT_VERSION,
            "model": None,
            "optimizer": None,
            "optimizer_type": _qualname(self.optimizer),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "transforms": {t.name: t.state_dict() for t in self.transforms},
            "engine": {"steps": self.steps, "micro": self._micro, "skipped": self.skipped_steps},
            "config": self.config.to_dict(),
            "rng": ckpt.rng_state(),
        }

    def load_sharded(self, path) -> None:
        """Restore a directory Engine.save wrote with parallel training, on any number of ranks."""
        if not self.ready:
            self._pending_state = {"sharded_path": path}
            return
        from .parallel import load_sharded

        state = load_sharded(path, self.module, self.optimizer)
        self._check_compatible(state)
        self._load_after_setup(state)

    @classmethod
    def load(cls, path, model, optimizer, loss_fn=None, config: Config | None = None, scheduler=None,
             init_weights=None) -> "Engine":
        """Build an Engine around a fresh model/optimizer and restore ``path`` into it. A model built on the
        meta device is initialised (``init_weights``; buffers the checkpoint does not hold need it) and then
        loaded."""
        if Path(path).is_dir():  # a sharded checkpoint (parallel training)
            engine = cls(model, optimizer, loss_fn, config=config, scheduler=scheduler, init_weights=init_weights)
            engine.load_sharded(path)
            return engine
        state = ckpt.load_checkpoint(path)
        engine = cls(model, optimizer, loss_fn, config=config, scheduler=scheduler, init_weights=init_weights)
        engine.load_state_dict(state)
        return engine


_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Timed out waiting")


def _lost_peer(exc: BaseException) -> Optional[str]:
    """The first line of a collective's error that says a peer is gone (gloo raises RuntimeError)."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, TurbotrainError):
        return None
    text = str(exc)
    return text.splitlines()[0][:200] if any(m in text for m in _LOST_PEER) else None


def _qualname(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"

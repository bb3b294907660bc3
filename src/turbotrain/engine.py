"""Engine: one training step with every turbotrain feature the Config names, and nothing else.

The Engine owns the order the transforms are applied in, which matters:
fusion (swaps modules, so parameters may change) -> activation checkpointing -> precision (casts
the model, gives the optimizer FP32 masters) -> data parallel (DDP over the final parameters) ->
torch.compile (last, so it sees the finished model).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from .checkpoint import FORMAT_VERSION, atomic_save, load_checkpoint
from .config import Config
from .errors import ConfigError, HardwareError, TurbotrainError
from .precision import Precision, warn_misaligned

__all__ = ["Engine", "StepStats"]


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


def _resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise HardwareError("device='cuda' was asked for but no CUDA device is visible; use device='cpu' or 'auto'")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _to_device(value, device):
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), value)


class Engine:
    """Train ``model`` with ``optimizer`` on ``loss_fn(model(inputs), targets)``.

    >>> import torch, turbotrain
    >>> model = torch.nn.Linear(8, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> engine = turbotrain.Engine(model, opt, torch.nn.functional.cross_entropy,
    ...                            config=turbotrain.Config(accumulate=2, device="cpu"))
    >>> batch = (torch.randn(4, 8), torch.tensor([0, 1, 0, 1]))
    >>> [engine.step(batch).optimizer_stepped for _ in range(2)]
    [False, True]
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, config: Config | None = None,
                 scheduler=None):
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.config = config = config or Config()
        self.device = _resolve_device(config.device)
        self.loss_fn = loss_fn
        self.scheduler = scheduler
        self.fusion_report = None
        self.comm = None
        model.to(self.device)

        if config.fuse:
            from . import fusion

            self.fusion_report = fusion.fuse(model, patterns=config.fuse, verify=True)
            optimizer = fusion.rebuild_optimizer(optimizer, model)
            if scheduler is not None:
                scheduler.optimizer = optimizer
        if config.checkpoint:
            from . import memory

            memory.apply_checkpointing(model, config.checkpoint)

        self.precision = Precision(config.precision, self.device, config.loss_scale, config.keep_fp32_head)
        self.precision.prepare(model, optimizer)
        self.module = model
        """The model itself (unwrapped from DDP / torch.compile); its state_dict is the stock layout."""

        if config.data_parallel is not None:
            from . import comm

            model, new_optimizer, self.comm = comm.prepare(model, optimizer, config.data_parallel, self.device)
            # DDP broadcast rank 0's (low-precision) weights; the FP32 masters must follow, or the
            # first copy-back would restore each rank's own initialisation and the replicas diverge.
            self.precision.broadcast_masters()
            if new_optimizer is not optimizer:  # 1-bit Adam replaces the optimizer (same parameters)
                optimizer = new_optimizer
                self.precision.bind_optimizer(optimizer)
                if scheduler is not None:
                    scheduler.optimizer = optimizer
        self.optimizer = optimizer
        self._forward_model = model
        if config.compile:
            self._forward_model = torch.compile(model)
        self.model = self._forward_model
        """What to call for a forward pass (possibly DDP-wrapped and compiled)."""

        self._micro = 0
        self.steps = 0
        self.skipped_steps = 0
        self._advised = False
        self._graphs_at_start: int | None = None

    # -- the step ----------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision context forward passes run under (autocast and the FP32 keep-list)."""
        return self.precision.forward_context()

    def step(self, batch) -> StepStats:
        """Forward, backward and (every ``accumulate`` calls) the optimizer step on one micro-batch."""
        inputs, targets = self._unpack(batch)
        cfg = self.config
        if not self._advised:
            self._advised = True
            if self.precision.dtype is not None:
                batch_size = inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() else None
                warn_misaligned(self.module, batch_size)
        micro = self._micro
        closes_step = micro + 1 == cfg.accumulate
        sync_ctx = self.comm.no_sync() if (self.comm is not None and not closes_step) else contextlib.nullcontext()
        with sync_ctx:
            with self.autocast():
                output = self._forward_model(inputs)
                loss = self.loss_fn(output, targets)
            scaled = self.precision.scale_loss(loss / cfg.accumulate if cfg.accumulate > 1 else loss)
            scaled.backward()
        if cfg.nan_check:
            self._check_finite(loss, (inputs, targets))
        self._micro = 0 if closes_step else micro + 1
        stats = StepStats(loss=loss.detach(), micro_step=micro, step=self.steps, optimizer_stepped=closes_step)
        if closes_step:
            self._optimizer_step(stats)
        if self.precision.scaler is not None:
            stats.loss_scale = self.precision.scaler.scale
        if cfg.compile:
            from .fusion.compile import check_recompile_budget, recompile_count

            if self._graphs_at_start is None:  # the first step's compile is not a recompile
                self._graphs_at_start = recompile_count()
            stats.recompiles = recompile_count() - self._graphs_at_start
            check_recompile_budget()
        if cfg.sync_stats:
            stats.loss = stats.loss.item()
            if isinstance(stats.grad_norm, torch.Tensor):
                stats.grad_norm = stats.grad_norm.item()
        return stats

    def _optimizer_step(self, stats: StepStats) -> None:
        cfg = self.config
        grads = self.precision.collect_grads()
        found_inf = self.precision.unscale_and_check_(grads)
        if found_inf is not None and self.comm is not None:
            found_inf = self.comm.agree_found_inf(found_inf)
        params = self.precision.optimizer_params()
        if cfg.clip_grad_norm is not None:
            stats.grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad_norm, foreach=True)
        elif cfg.track_grad_norm:
            stats.grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        # The one host sync of a step, and only in the fp16 modes: the skip decision.
        skip = False
        if found_inf is not None:
            scale = self.precision.scaler.scale
            skip = self.precision.scaler.update(bool(found_inf.item()))
        if skip:
            stats.skipped = True
            stats.skip_reason = f"inf/NaN gradients at loss scale {scale:g}; scale now {self.precision.scaler.scale:g}"
            self.skipped_steps += 1
        else:
            self.optimizer.step()
            self.precision.after_optimizer_step()
            if self.scheduler is not None:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)
        self.steps += 1
        stats.step = self.steps

    def _check_finite(self, loss: torch.Tensor, batch) -> None:
        """One fused finiteness test of the loss and gradients; on failure, name the origin module."""
        from . import diagnose

        scaler = self.precision.scaler
        # Scaled fp16 gradients may overflow legitimately: the loss scaler skips those steps.
        grads = [] if scaler else [p.grad for p in self.module.parameters()]
        if not bool(diagnose.nonfinite_flag(loss, grads)):
            return
        report = diagnose.find_nonfinite(self.module, self.loss_fn, batch, autocast=self.autocast,
                                         loss_scale=scaler.scale if scaler else 1.0)
        raise TurbotrainError(f"inf/NaN appeared at optimizer step {self.steps}.\n{report}")

    def _unpack(self, batch):
        if isinstance(batch, dict):
            try:
                batch = (batch["inputs"], batch["targets"])
            except KeyError:
                raise ConfigError("a dict batch needs the keys 'inputs' and 'targets'") from None
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ConfigError("a batch must be (inputs, targets) or {'inputs': ..., 'targets': ...}")
        inputs, targets = _to_device(tuple(batch), self.device)
        if self.config.seq_buckets:  # pad to a few lengths so torch.compile sees few shapes
            from .fusion.compile import pad_batch

            inputs, targets = pad_batch((inputs, targets), self.config.seq_buckets)
        return inputs, targets

    # -- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        """Mean loss over ``batches`` under the engine's precision, in eval mode."""
        was_training = self.module.training
        self.module.eval()
        total, count = 0.0, 0
        try:
            for batch in batches:
                inputs, targets = self._unpack(batch)
                with self.autocast():
                    total += float(self.loss_fn(self._forward_model(inputs), targets))
                count += 1
        finally:
            self.module.train(was_training)
        if count == 0:
            raise ConfigError("eval_loss needs at least one batch")
        return total / count

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything to resume exactly; 'model' holds FP32 weights in the stock layout."""
        with self.precision.full_precision_weights():
            model_state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        return {
            "format": "turbotrain",
            "version": FORMAT_VERSION,
            "model": model_state,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "precision": self.precision.state_dict(),
            "comm": self.comm.state_dict() if self.comm is not None else None,
            "engine": {"steps": self.steps, "micro": self._micro, "skipped": self.skipped_steps},
            "config": self.config.to_dict(),
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.precision.load_state_dict(state.get("precision") or {})
        with self.precision.full_precision_weights():
            self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.comm is not None and state.get("comm") is not None:
            self.comm.load_state_dict(state["comm"])
        eng = state["engine"]
        self.steps, self._micro, self.skipped_steps = eng["steps"], eng["micro"], eng["skipped"]
        if state.get("rng") is not None:
            torch.set_rng_state(state["rng"])

    def save(self, path) -> None:
        """Write a checkpoint atomically (temporary file, fsync, rename)."""
        if self._micro:
            raise ConfigError(
                f"save() was called in the middle of an accumulated step (micro-step {self._micro} of "
                f"{self.config.accumulate}); call it right after a step whose optimizer_stepped is True"
            )
        atomic_save(self.state_dict(), path)

    @classmethod
    def load(cls, path, model, optimizer, loss_fn, config: Config | None = None, scheduler=None) -> "Engine":
        """Build an Engine around a fresh model/optimizer and restore ``path`` into it."""
        state = load_checkpoint(path)
        engine = cls(model, optimizer, loss_fn, config=config, scheduler=scheduler)
        engine.load_state_dict(state)
        return engine

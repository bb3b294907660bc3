"""Guards while training: an FP32 shadow check, and precision that heals itself.

``Config(guards=GuardConfig(...))`` switches them on (None, the default, is off):

* **FP32 shadow check.** Every ``shadow_every`` optimizer steps the first micro-batch of the step
  is recomputed in FP32 on the same weights (the FP32 masters where precision keeps them), without
  autocast or loss scaling, and its loss and gradient norm are compared with the run's. The
  shadow's gradients come from ``torch.autograd.grad``, the RNG is replayed and then restored and
  BatchNorm statistics are put back, so the run's gradients, optimizer state and random stream are
  the same with the check as without it. A gap past its bound warns (PrecisionDriftWarning), or
  with ``action='stop'`` raises PrecisionDriftError. Steps that are not due do no extra work.
* **Self-healing precision** (``heal=True``). When the fp16 loss scale sits at its floor for
  ``floor_steps`` overflowing steps in a row, the run switches fp16 -> bf16 where the hardware
  computes bf16 natively, and otherwise moves the module the NaN finder names on a replay of the
  step to FP32. With ``Config(nan_check=True)``, a module the finder names twice moves to FP32
  (the step that found it is skipped, not fatal). Each change is logged, kept in the precision
  transform's checkpoint state and re-applied by ``Engine.load``; training goes on.

>>> GuardConfig(shadow_every=50, action="stop").max_loss_gap
0.02
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .batch import ContractCall
from .checkpoint import rng_state, set_rng_state
from .errors import ConfigError, TurbotrainError, check_bool, check_choice, check_number
from .plan import Transform

__all__ = ["GuardConfig", "GUARD_ACTIONS", "Guards", "ShadowCheck", "PrecisionDriftError", "PrecisionDriftWarning",
           "StepSkipped"]

logger = logging.getLogger(__name__)

GUARD_ACTIONS = ("warn", "stop")
#: Below this the relative gap is taken against 1.0 instead (a loss or norm near zero).
_TINY = 1e-12
_LOSS_FN, _ROOT = "<loss_fn>", "<model>"
#: The attribute under which batch.ContractCall holds the model (the finder's paths start with it).
_ADAPTER_PREFIX = "inner"


class PrecisionDriftError(TurbotrainError):
    """The FP32 shadow check found the run's loss or gradient norm too far from FP32's (action='stop')."""


class PrecisionDriftWarning(UserWarning):
    """The FP32 shadow check found the run's loss or gradient norm too far from FP32's (action='warn')."""


class StepSkipped(Exception):
    """Raised inside Engine.step when the guards absorbed an inf/NaN step; the Engine counts it as skipped."""

    def __init__(self, loss: torch.Tensor, reason: str):
        super().__init__(reason)
        self.loss, self.reason = loss, reason


@dataclass(frozen=True)
class GuardConfig:
    """What the guards check and do. Invalid values raise ConfigError listing the valid choices."""

    shadow_every: int | None = 100
    """Recompute one micro-batch in FP32 every this many optimizer steps (None: no shadow check). One
    FP32 forward and backward per 100 steps costs a few percent of a low-precision run, and precision
    drift builds up over hundreds of steps, so it is still caught early."""
    max_loss_gap: float = 0.02
    """Largest |loss - FP32 loss| / |FP32 loss| tolerated: the bf16 loss tolerance the engine's
    precision tests hold every mode to. bf16 keeps 8 significant bits (rounding 2^-8 = 0.4%) and the
    loss averages its rounding errors over every token, so a healthy run stays well inside it."""
    max_grad_norm_gap: float = 0.1
    """Largest relative gap of the global gradient norm. Looser than the loss: every gradient element
    is rounded along the whole backward chain and the norm sums their squares, so bf16 gradient norms
    sit a few percent from FP32's in a healthy run (fp16, 3 more bits, within 5%)."""
    action: str = "warn"
    """'warn' (PrecisionDriftWarning, once per check that fails) or 'stop' (PrecisionDriftError)."""
    heal: bool = True
    """Move modules that overflow to FP32 (or fp16 -> bf16 where bf16 is native) and go on."""
    floor_steps: int = 3
    """Overflowing steps in a row at the fp16 loss-scale floor that trigger healing. At the floor no
    smaller scale can help, so three skipped steps are evidence enough; it must stay below
    LossScaleConfig.max_floor_overflows (10), where the scaler gives up with LossScaleError."""

    def __post_init__(self):
        if self.shadow_every is not None:
            check_number("shadow_every", self.shadow_every, integer=True, minimum=1)
        for name in ("max_loss_gap", "max_grad_norm_gap"):
            check_number(name, getattr(self, name), minimum=0, exclusive=True)
        check_choice("action", self.action, GUARD_ACTIONS)
        check_bool("heal", self.heal)
        check_number("floor_steps", self.floor_steps, integer=True, minimum=1)


def check_guards(guards: GuardConfig | None, loss_scale) -> None:
    """Settings of GuardConfig that only make sense against the rest of the Config."""
    if guards is not None and guards.heal and guards.floor_steps >= loss_scale.max_floor_overflows:
        raise ConfigError(
            f"GuardConfig(floor_steps={guards.floor_steps}) must be below LossScaleConfig(max_floor_overflows="
            f"{loss_scale.max_floor_overflows}): the scaler raises LossScaleError at that count, before healing "
            "could run; lower floor_steps or raise max_floor_overflows"
        )


@dataclass
class ShadowCheck:
    """One FP32 shadow check: the run's figures, FP32's on the same weights and micro-batch, the gaps."""

    step: int
    """The optimizer step whose first micro-batch was checked (0-based)."""
    loss: float
    fp32_loss: float
    loss_gap: float
    """|loss - fp32_loss| / |fp32_loss|."""
    grad_norm: float | None = None
    """The run's gradient norm of that micro-batch (unscaled), None where it is not comparable."""
    fp32_grad_norm: float | None = None
    grad_norm_gap: float | None = None
    note: str | None = None
    """Why the gradient norm was not compared, when it was not."""
    exceeded: tuple[str, ...] = ()
    """The names of the gaps past their bounds ('loss', 'grad_norm'); empty when the check passed."""


def _gap(value: float, reference: float) -> float:
    if not (math.isfinite(value) and math.isfinite(reference)):
        return 0.0 if value == reference else math.inf
    return abs(value - reference) / max(abs(reference), _TINY)


def _norm(grads) -> torch.Tensor:
    """Global L2 norm computed in FP32 (fp16 gradients under a loss scale would overflow their own norm)."""
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms))


def _bf16_native(device: torch.device) -> str | None:
    """The reason bf16 runs natively on ``device``, or None where it is emulated."""
    from . import hardware

    mode, reason = hardware.recommend_precision(hardware.detect(device.type))
    return reason if mode.startswith("bf16") else None


@contextlib.contextmanager
def _side_effects_undone(module: nn.Module, replay_rng=None):
    """Run extra forward passes without changing the run: the RNG stream (optionally replayed from
    ``replay_rng`` first, so dropout draws the run's masks) and BatchNorm statistics are put back."""
    after = rng_state()
    norms = [(m, {k: b.clone() for k, b in m.named_buffers(recurse=False) if b is not None})
             for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if replay_rng is not None:
        set_rng_state(replay_rng)
    try:
        yield
    finally:
        set_rng_state(after)
        for m, saved in norms:
            for k, b in saved.items():
                getattr(m, k).copy_(b)


class Guards(Transform):
    """``Config(guards=...)``: the Engine calls its hooks around a step; its state is checkpointed."""

    name = "guards"

    def __init__(self, config: GuardConfig):
        self.config = config
        self.last: ShadowCheck | None = None
        """The latest FP32 shadow check (also in that step's StepStats.shadow)."""
        self.heals: list[dict] = []
        """Every change healing made: {'step', 'change', 'reason'}."""
        self.named: dict[str, int] = {}
        """How often the NaN finder named each module (not yet healed)."""
        self._floor_run = 0
        self._batch = None
        self._checked_setup = False
        self._shadow_on = config.shadow_every is not None
        self._grad_norm_note: str | None = None
        self._heal_on = config.heal
        self._absorb_nonfinite = config.heal

    def describe(self) -> str:
        cfg = self.config
        shadow = (f"FP32 shadow check every {cfg.shadow_every} steps (loss gap <= {cfg.max_loss_gap:g}, grad-norm "
                  f"gap <= {cfg.max_grad_norm_gap:g}, {cfg.action})" if self._shadow_on else "no shadow check")
        heal = (f"healing after {cfg.floor_steps} overflowing steps at the loss-scale floor or a module the NaN "
                f"finder names twice" if cfg.heal else "no healing")
        done = "; healed: " + ", ".join(h["change"] for h in self.heals) if self.heals else ""
        return f"guards: {shadow}; {heal}{done}"

    # -- set-up, once ------------------------------------------------------------------------
    def _check_setup(self, engine) -> None:
        """Say once what cannot run in this Engine, and switch it off (never silently)."""
        self._checked_setup = True
        if engine.precision.dtype is None:
            self._shadow_on = self._heal_on = self._absorb_nonfinite = False
            logger.info("guards: the run computes in FP32, so the FP32 shadow check has nothing to compare and "
                        "healing nothing to move; both are off")
        if getattr(engine.plan, "sharded", False) and (self._shadow_on or self._heal_on):
            self._shadow_on = self._heal_on = self._absorb_nonfinite = False
            warnings.warn("GuardConfig: the FP32 shadow check and healing do not run under Config(parallel=...) "
                          "(FSDP shards the weights and fixes their compute dtype at set-up); both are off",
                          stacklevel=5)
        if self._shadow_on and engine.comm is not None and engine.config.accumulate == 1:
            self._grad_norm_note = ("data parallel with accumulate=1: the run's gradients are already averaged "
                                    "over ranks, so only the loss is compared")
            logger.info("guards: %s", self._grad_norm_note)
        if self._absorb_nonfinite and engine.config.nan_check and engine.comm is not None:
            self._absorb_nonfinite = False
            logger.warning("guards: under data parallel an inf/NaN step still stops the run (each rank's NaN "
                           "finder sees its own batch, and ranks must agree to skip); loss-scale-floor healing "
                           "stays on")

    # -- every micro-batch -------------------------------------------------------------------
    def begin(self, engine, batch, micro: int):
        """Before a micro-batch's forward: the RNG state to replay when a shadow check is due, else None."""
        if not self._checked_setup:
            self._check_setup(engine)
        if self._heal_on:
            self._batch = batch  # the loss-scale-floor replay needs the step's last micro-batch
        if self._shadow_on and micro == 0 and engine.steps % self.config.shadow_every == 0:
            return rng_state()
        return None

    def shadow_check(self, engine, batch, loss: torch.Tensor, rng_before) -> ShadowCheck:
        """After the first micro-batch's backward: recompute it in FP32 and compare (warn or raise)."""
        run_norm, note = self._run_grad_norm(engine)
        fp32_loss, fp32_norm = self._fp32_pass(engine, batch, rng_before)
        value = float(loss)
        check = ShadowCheck(step=engine.steps, loss=value, fp32_loss=fp32_loss, loss_gap=_gap(value, fp32_loss),
                            note=note)
        if run_norm is not None:
            check.grad_norm, check.fp32_grad_norm = run_norm, fp32_norm
            check.grad_norm_gap = _gap(run_norm, fp32_norm)
        exceeded = []
        if check.loss_gap > self.config.max_loss_gap:
            exceeded.append("loss")
        if check.grad_norm_gap is not None and check.grad_norm_gap > self.config.max_grad_norm_gap:
            exceeded.append("grad_norm")
        check.exceeded = tuple(exceeded)
        self.last = check
        if exceeded:
            self._report_drift(engine, check)
        return check

    def _run_grad_norm(self, engine) -> tuple[float | None, str | None]:
        if self._grad_norm_note is not None:
            return None, self._grad_norm_note
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        if not grads:
            return None, "no parameter has a gradient"
        scaler = engine.precision.scaler
        # the backward ran on loss / accumulate * scale
        norm = float(_norm(grads)) * engine.config.accumulate / (scaler.scale if scaler is not None else 1.0)
        if not math.isfinite(norm):
            return None, "the run's gradients overflowed (fp16); the loss scaler skips this step"
        return norm, None

    def _fp32_pass(self, engine, batch, rng_before) -> tuple[float, float]:
        """The micro-batch's loss and gradient norm in FP32; .grad, the optimizer and the RNG untouched."""
        module = engine.module
        params = [p for p in module.parameters() if p.requires_grad]
        with _side_effects_undone(module, rng_before), engine.precision.fp32_compute(), torch.enable_grad():
            wrapped, engine.model = engine.model, module  # the bare module: no DDP hooks, no compiled graph
            try:
                loss = engine._forward_loss(batch.args, batch.kwargs, batch.targets, batch.kind)
            finally:
                engine.model = wrapped
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        grads = [g for g in grads if g is not None]
        return float(loss), float(_norm(grads)) if grads else 0.0

    def _report_drift(self, engine, check: ShadowCheck) -> None:
        cfg = self.config
        parts = []
        if "loss" in check.exceeded:
            parts.append(f"loss gap {check.loss_gap:.3g} > max_loss_gap {cfg.max_loss_gap:g} (loss {check.loss:.6g} "
                         f"in {engine.precision.mode}, {check.fp32_loss:.6g} in FP32)")
        if "grad_norm" in check.exceeded:
            parts.append(f"gradient-norm gap {check.grad_norm_gap:.3g} > max_grad_norm_gap {cfg.max_grad_norm_gap:g} "
                         f"({check.grad_norm:.6g} in {engine.precision.mode}, {check.fp32_grad_norm:.6g} in FP32)")
        message = (f"FP32 shadow check at optimizer step {check.step}: " + "; ".join(parts) + ", on the same weights "
                   "and micro-batch. Low precision is changing this run's result: find the layers it hurts with "
                   "`turbotrain diagnose precision` (per-layer SQNR) and keep them FP32 (Config(keep_fp32_head=True) "
                   "for the head), or train in precision='fp32'; raise the bound only if this gap is expected.")
        if cfg.action == "stop":
            raise PrecisionDriftError(message)
        warnings.warn(message, PrecisionDriftWarning, stacklevel=5)  # the user's engine.step

    # -- healing -----------------------------------------------------------------------------
    def after_scaler_update(self, engine, overflowed: bool, scale_before: float) -> None:
        """After the fp16 scaler's update: count overflowing steps at its floor; heal at floor_steps."""
        if not self._heal_on:
            return
        scaler = engine.precision.scaler
        at_floor = overflowed and scale_before <= scaler.config.min_scale
        self._floor_run = self._floor_run + 1 if at_floor else 0
        if self._floor_run < self.config.floor_steps:
            return
        self._floor_run = 0
        reason = (f"the fp16 loss scale sat at its floor ({scaler.config.min_scale:g}) for {self.config.floor_steps} "
                  "overflowing steps in a row")
        native = _bf16_native(engine.device)
        if native is not None:
            old = engine.precision.mode
            engine.precision.switch_to_bf16()
            self._record(engine, f"{old} -> {engine.precision.mode}",
                         f"{reason}; bf16 has FP32's exponent range and this hardware computes it natively ({native})")
            return
        report = self._replay(engine, scale_before)
        path = self._healable_path(engine, report) if report else None
        if path is None:
            logger.warning("guards: %s, but the NaN finder's replay of the step's last micro-batch named no module "
                           "of the model (%s); nothing was moved", reason,
                           "no inf/NaN" if not report else f"{report.phase} at {report.module_path}")
            return
        self._heal_module(engine, path, f"{reason}; the NaN finder's replay named it ({report.cause}, {report.phase})")

    def on_nonfinite(self, engine, report, loss: torch.Tensor) -> None:
        """After the NaN finder's report on an inf/NaN step: skip it (raise StepSkipped) and heal a module
        named twice; return (so the Engine raises as before) when healing cannot help."""
        if not self._absorb_nonfinite:
            return
        path = self._healable_path(engine, report)
        if path is None:
            return
        count = self.named.get(path, 0) + 1
        label = path or _ROOT
        if count < 2:
            self.named[path] = count
            logger.warning("guards: inf/NaN at optimizer step %d, first made by %s (%s, %s); the step is skipped, "
                           "and %s moves to FP32 if the NaN finder names it again", engine.steps, label,
                           report.cause, report.phase, label)
            raise StepSkipped(loss.detach(), f"inf/NaN from {label} ({report.cause}); named once")
        self.named.pop(path, None)
        self._heal_module(engine, path, f"the NaN finder named it twice ({report.cause}, {report.phase})")
        raise StepSkipped(loss.detach(), f"inf/NaN from {label} ({report.cause}); {label} now runs in FP32")

    def _replay(self, engine, scale: float):
        """The NaN finder on the step's last micro-batch, as _check_finite runs it; the run unchanged."""
        from . import diagnose

        batch = self._batch
        if batch is None:
            return None
        with _side_effects_undone(engine.module):
            return diagnose.find_nonfinite(ContractCall(engine.module),
                                           lambda out, *_: engine.contract.loss(out, batch),  # targets: None
                                           ((batch.args, batch.kwargs), None), autocast=engine.autocast,
                                           loss_scale=scale)

    def _healable_path(self, engine, report) -> str | None:
        """The module to move to FP32 for ``report``: the one it names, or its parent once that one is FP32
        already (its output overflows the low dtype it is handed back in); None when nothing can help."""
        if report.phase not in ("forward", "backward") or report.module_path in (None, _LOSS_FN):
            return None
        path = _module_path(engine.module, report.module_path)
        if path is None:
            return None
        healed = set(engine.precision.fp32_modules)
        while path in healed:
            if path == "":
                return None
            path = path.rpartition(".")[0]
        return path

    def _heal_module(self, engine, path: str, reason: str) -> None:
        engine.precision.keep_module_fp32(path)
        self._record(engine, f"{path or _ROOT} -> FP32", reason)

    def _record(self, engine, change: str, reason: str) -> None:
        self.heals.append({"step": engine.steps, "change": change, "reason": reason})
        logger.warning("guards: %s at optimizer step %d: %s; training goes on", change, engine.steps, reason)
        if engine._transform("compile") is not None:
            torch.compiler.reset()  # the compiled graphs hold the old dtypes; they are rebuilt at the next step
            logger.info("guards: compiled graphs dropped; they are rebuilt with the new precision")

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What healing did and saw. The changes themselves are the precision transform's state, which
        re-applies them on load."""
        return {"heals": [dict(h) for h in self.heals], "named": dict(self.named), "floor_run": self._floor_run}

    def load_state_dict(self, state: dict) -> None:
        self.heals = [dict(h) for h in state.get("heals", ())]
        self.named = dict(state.get("named", {}))
        self._floor_run = int(state.get("floor_run", 0))


def _module_path(model: nn.Module, reported: str) -> str | None:
    """The qualified name in ``model`` of a module the NaN finder reported ('' for the model itself).

    The finder names modules relative to what it was given: the model, or the Engine's call adapter
    around it (whose paths start with 'inner')."""
    candidates = [reported]
    if reported == _ROOT or reported == _ADAPTER_PREFIX:
        return ""
    if reported.startswith(_ADAPTER_PREFIX + "."):
        candidates.append(reported[len(_ADAPTER_PREFIX) + 1:])
    for path in candidates:
        try:
            model.get_submodule(path)
        except AttributeError:
            continue
        return path
    return None

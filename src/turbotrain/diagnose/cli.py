"""``turbotrain diagnose nan`` and ``turbotrain diagnose precision``.

``--inject`` plants a known fault in the middle Linear of the workload's model, so the finder can
be seen (and checked) naming it: 'inf-weight' sets one weight to inf, 'log-zero' makes the layer
return log(0), 'fp16-overflow' scales its weights until its outputs pass fp16's 65504.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..precision.config import PRECISIONS
from .audit import precision_audit
from .nonfinite import find_nonfinite
from .stats import FP16_MAX, precision_run

__all__ = ["add_cli", "inject_fault", "INJECTIONS"]

INJECTIONS = ("inf-weight", "log-zero", "fp16-overflow")


def _middle_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError("--inject needs a model with at least one nn.Linear; this workload has none")
    return linears[len(linears) // 2]


def _log_zero_hook(module, args, output):
    return output + torch.log(torch.zeros_like(output))


def inject_fault(model: nn.Module, kind: str, sample_inputs=None) -> str:
    """Plant fault ``kind`` (one of INJECTIONS) in the model's middle Linear; return its path."""
    if kind not in INJECTIONS:
        raise ConfigError(f"--inject {kind!r} is not valid; choose one of: {', '.join(INJECTIONS)}")
    path, layer = _middle_linear(model)
    if kind == "inf-weight":
        with torch.no_grad():
            layer.weight.view(-1)[0] = float("inf")
    elif kind == "log-zero":
        layer.register_forward_hook(_log_zero_hook)
    else:
        seen = []
        handle = layer.register_forward_hook(lambda m, a, out: seen.append(float(out.detach().abs().max())))
        with torch.no_grad():
            model(sample_inputs)
        handle.remove()
        # Twice past fp16's range; the weights themselves stay representable when fan-in allows.
        with torch.no_grad():
            layer.weight.mul_(2 * FP16_MAX / max(seen[0], 1e-12))
    return path


def _build(args):
    from ..workloads import get_workload  # lazy: the registry imports every workload's model code

    workload = get_workload(args.workload)
    torch.manual_seed(args.seed)
    model = workload.build_model()
    batch = next(iter(workload.batches(split="train", seed=args.seed, device="cpu")))
    return workload, model, batch


def _cmd_nan(args) -> int:
    precision = args.precision
    if args.inject == "fp16-overflow" and not precision.startswith("fp16"):
        precision = "fp16-mixed"
        print("--inject fp16-overflow: running in precision='fp16-mixed' (an fp16 fault needs fp16)")
    workload, model, (inputs, targets) = _build(args)
    planted = inject_fault(model, args.inject, inputs) if args.inject else None
    run = precision_run(model, precision, copy_model=False)
    report = find_nonfinite(run.model, workload.loss_fn, (run.inputs(inputs), targets), autocast=run.autocast)
    print(report)
    if planted:
        print(f"(fault '{args.inject}' was injected into {planted})")
    return 1 if report else 0


def _cmd_precision(args) -> int:
    _, model, batch = _build(args)
    report = precision_audit(model, batch, args.precision, threshold_db=args.threshold_db)
    print(report)
    return 0


def add_cli(subparsers) -> None:
    """Register ``turbotrain diagnose {nan,precision}``."""
    parser = subparsers.add_parser("diagnose", help="find where inf/NaN starts; audit low-precision error")
    sub = parser.add_subparsers(dest="diagnose_command", required=True)
    choices = [p for p in PRECISIONS if p != "auto"]

    nan = sub.add_parser("nan", help="run one step with hooks and report the first module to go inf/NaN")
    nan.add_argument("--workload", required=True)
    nan.add_argument("--precision", default="fp32", choices=choices)
    nan.add_argument("--inject", choices=INJECTIONS, help="plant a known fault first (a demonstration)")
    nan.add_argument("--seed", type=int, default=0)
    nan.set_defaults(func=_cmd_nan)

    prec = sub.add_parser("precision", help="per-layer SQNR of a low precision against FP32")
    prec.add_argument("--workload", required=True)
    prec.add_argument("--precision", default="bf16-mixed", choices=choices)
    prec.add_argument("--threshold-db", type=float, default=20.0)
    prec.add_argument("--seed", type=int, default=0)
    prec.set_defaults(func=_cmd_precision)

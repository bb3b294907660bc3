"""``turbotrain diagnose nan`` and ``turbotrain diagnose precision``.

``--inject`` plants a known fault in the middle Linear of the workload's model (see
turbotrain.diagnose.inject), so the finder can be seen naming it.
"""

from __future__ import annotations

from ..diagnose.inject import INJECTIONS
from ..precision.config import PRECISIONS

__all__ = ["add_parsers"]


def _build(args):
    import torch

    from ..workloads import get_workload  # lazy: the registry imports every workload's model code

    workload = get_workload(args.workload)
    torch.manual_seed(args.seed)
    model = workload.build_model()
    batch = next(iter(workload.batches(split="train", seed=args.seed, device="cpu")))
    return workload, model, batch


def _nan(args) -> int:
    from ..diagnose import find_nonfinite, inject_fault
    from ..diagnose.stats import precision_run

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


def _precision(args) -> int:
    from ..diagnose import precision_audit

    _, model, batch = _build(args)
    print(precision_audit(model, batch, args.precision, threshold_db=args.threshold_db))
    return 0


def add_parsers(subparsers, parents=()) -> None:
    """Register ``turbotrain diagnose {nan,precision}``."""
    parser = subparsers.add_parser("diagnose", parents=parents,
                                   help="find where inf/NaN starts; audit low-precision error")
    sub = parser.add_subparsers(dest="diagnose_command", required=True)
    choices = [p for p in PRECISIONS if p != "auto"]

    nan = sub.add_parser("nan", parents=parents, help="run one step with hooks and report the first module to go inf/NaN")
    nan.add_argument("--workload", required=True)
    nan.add_argument("--precision", default="fp32", choices=choices)
    nan.add_argument("--inject", choices=INJECTIONS, help="plant a known fault first (a demonstration)")
    nan.add_argument("--seed", type=int, default=0)
    nan.set_defaults(func=_nan)

    prec = sub.add_parser("precision", parents=parents, help="per-layer SQNR of a low precision against FP32")
    prec.add_argument("--workload", required=True)
    prec.add_argument("--precision", default="bf16-mixed", choices=choices)
    prec.add_argument("--threshold-db", type=float, default=20.0)
    prec.add_argument("--seed", type=int, default=0)
    prec.set_defaults(func=_precision)

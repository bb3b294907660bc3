"""``turbotrain profile --workload W [--precision P] [--fuse] [--compile]``."""

from __future__ import annotations

from ..precision.config import PRECISIONS

__all__ = ["add_parsers"]


def _profile(args) -> int:
    import torch

    from .. import Config, Engine
    from ..bench.configs import OPTIMIZER_IMPLEMENTATION
    from ..profile import profile
    from ..utils import check_output_dir
    from ..workloads import get_workload  # lazy: the registry imports every workload's model code

    check_output_dir(args.out)
    workload = get_workload(args.workload)
    torch.manual_seed(args.seed)
    model = workload.build_model()
    # the ladder's AdamW implementation (fused), so the profile is of the step the bench times
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, **OPTIMIZER_IMPLEMENTATION)
    config = Config(precision=args.precision, fuse=args.fuse, compile=args.compile, checkpoint=args.checkpoint,
                    device=args.device)
    engine = Engine(model, optimizer, workload.loss_fn, config=config)
    batches = workload.batches(split="train", seed=args.seed, device=str(engine.device))
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else None
    peak_bw = args.peak_gbps * 1e9 if args.peak_gbps else None
    report = profile(engine, batches, steps=args.steps, warmup=args.warmup, peak_flops=peak_flops,
                     peak_bandwidth=peak_bw, out_dir=args.out,
                     title=f"turbotrain profile: {args.workload}, precision={args.precision}")
    print(report)
    print(f"trace: {report.trace_path}\nreport: {report.html_path}")
    return 0


def add_parsers(subparsers, parents=()) -> None:
    """Register ``turbotrain profile``."""
    p = subparsers.add_parser("profile", parents=parents, help="where a training step's time goes, and what to turn on")
    p.add_argument("--workload", required=True)
    p.add_argument("--precision", default="fp32", choices=PRECISIONS)
    p.add_argument("--fuse", action="store_true",
                   help="Config(fuse=True): the fusion patterns that pay on this device (the loss head alone on a CPU)")
    p.add_argument("--compile", action="store_true", help="Config(compile=True)")
    p.add_argument("--checkpoint", choices=("blocks", "selective"), default=None)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, help="peak FLOP/s for MFU (default: measured by turbotrain.hardware)")
    p.add_argument("--peak-gbps", type=float, help="peak memory bandwidth in GB/s (default: measured)")
    p.add_argument("--out", default="profile-out", help="folder for trace.json, profile.json, report.html")
    p.set_defaults(func=_profile)

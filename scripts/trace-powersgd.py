#!/usr/bin/env python
"""A Chrome/Perfetto trace per rank of DDP + PowerSGD on 2 gloo ranks, and what it shows.

    python scripts/trace-powersgd.py [--out DIR] [--d 512 --n-layer 4 --T 256 --B 8] [--bucket-mb 25]

Starts itself on 2 ranks through turbotrain's loopback launcher (turbotrain.comm.launch). Each
rank trains the gpt workload (fp32, AdamW) under ``DataParallelConfig(compression='powersgd',
warmup_steps=1)``: one exact step, one compressed step that lays the buckets out, then
``--steps`` compressed steps under torch.profiler (CPU activities). Each rank writes
``DIR/rank{r}.trace.json`` (gzipped when over 5 MB), which chrome://tracing and
https://ui.perfetto.dev open, and rank 0 prints, per profiled step, when each bucket's P and Q
all-reduce (``gloo:all_reduce`` ranges) started and ended relative to that step's backward, and
where the hook's phases (``powersgd.p``, ``powersgd.q``, ``powersgd.decompress``) ran.

What to look for: in the rank's main thread, ``autograd::engine::evaluate_function: ...Backward0``
ranges run until the last bucket is ready; a ``gloo:all_reduce`` that starts inside
``powersgd.p`` during backward and ends before the last backward op is a collective in flight
while later buckets' gradients are still being computed. ``--json PATH`` keeps the figures.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

GZIP_OVER = 5 * 2 ** 20
BACKWARD = "autograd::engine::evaluate_function"
COLLECTIVE = "gloo:all_reduce"
PHASES = ("powersgd.p", "powersgd.q", "powersgd.decompress")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/2026-12-04-powersgd-trace", help="directory for the traces")
    ap.add_argument("--steps", type=int, default=2, help="compressed steps to profile")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DataParallelConfig.bucket_mb")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    ap.add_argument("--json", default=None, help="also write the figures printed to this file")
    return ap.parse_args(argv)


def run_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile, schedule

    from turbotrain import comm
    from turbotrain.comm import DataParallelConfig
    from turbotrain.workloads import get_workload

    torch.set_num_threads(1)
    info = comm.init(backend="gloo", timeout_s=300)
    wl = get_workload("gpt", d=args.d, n_layer=args.n_layer, T=args.T, B=args.B)
    model = wl.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    dp = DataParallelConfig(compression="powersgd", warmup_steps=1, bucket_mb=args.bucket_mb,
                            powersgd_rank=args.rank)
    ddp, opt, state = comm.prepare(model, opt, dp, torch.device("cpu"))
    batches = wl.batches("train", seed=info.rank)
    settle = 2  # the exact warm-up step, then the first compressed one (DDP rebuilds its buckets)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # every thread: Q's launch and the decompression run in completion callbacks on gloo's threads
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=settle, warmup=0, active=args.steps),
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        for _ in range(settle + args.steps):
            x, y = next(batches)
            wl.loss_fn(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    path = out / f"rank{info.rank}.trace.json"
    prof.export_chrome_trace(str(path))
    if path.stat().st_size > GZIP_OVER:
        with open(path, "rb") as f, gzip.open(f"{path}.gz", "wb") as g:
            g.write(f.read())
        path.unlink()
    buckets = len(state.hook_state._layouts)  # one layout per DDP bucket the compressed steps saw
    params = sum(p.numel() for p in model.parameters())
    if info.rank == 0:
        (out / "run.json").write_text(json.dumps({
            "workload": "gpt", "d": args.d, "n_layer": args.n_layer, "T": args.T, "B": args.B, "parameters": params,
            "precision": "fp32", "world_size": info.world_size, "backend": info.backend, "threads_per_rank": 1,
            "bucket_mb": args.bucket_mb, "ddp_buckets": buckets, "powersgd_rank": args.rank,
            "profiled_steps": args.steps, "bytes_sent_rank0": state.bytes_sent, "torch": torch.__version__}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _ranges(events, match) -> list[tuple[float, float, dict]]:
    return sorted((e["ts"], e["ts"] + e.get("dur", 0), e) for e in events if e.get("ph") == "X" and match(e["name"]))


def analyse(trace: Path) -> list[dict]:
    """Per profiled step: the backward window and every all-reduce and hook phase, in ms from its start."""
    events = _load(trace)
    steps = _ranges(events, lambda n: n.startswith("ProfilerStep#"))
    backward = _ranges(events, lambda n: n.startswith(BACKWARD))
    collectives = _ranges(events, lambda n: n == COLLECTIVE)
    phases = _ranges(events, lambda n: n in PHASES)
    report = []
    for s0, s1, step in steps:
        bwd = [(a, b) for a, b, _ in backward if s0 <= a < s1]
        if not bwd:
            continue
        b0, b1 = bwd[0][0], max(b for _, b in bwd)

        def ms(t):
            return round((t - b0) / 1e3, 2)

        ops = [{"tid": e.get("tid"), "start_ms": ms(a), "end_ms": ms(b),
                "in_flight_during_backward_ms": round(max(0.0, min(b, b1) - a) / 1e3, 2)}
               for a, b, e in collectives if s0 <= a < s1]
        hooks = [{"name": e["name"], "tid": e.get("tid"), "start_ms": ms(a), "end_ms": ms(b)}
                 for a, b, e in phases if s0 <= a < s1]
        report.append({"step": step["name"], "backward_ms": ms(b1), "all_reduces": ops, "phases": hooks,
                       "started_before_backward_ended": sum(1 for o in ops if o["start_ms"] < ms(b1)),
                       "ended_before_backward_ended": sum(1 for o in ops if o["end_ms"] < ms(b1))})
    return report


def show(report: list[dict]) -> None:
    for step in report:
        print(f"{step['step']}: backward {step['backward_ms']:.1f} ms (0 = its first op); "
              f"{len(step['all_reduces'])} gloo all_reduces, {step['started_before_backward_ended']} launched and "
              f"{step['ended_before_backward_ended']} finished before backward's last op")
        for o in step["all_reduces"]:
            print(f"  all_reduce thread {o['tid']!s:>8} {o['start_ms']:8.1f} -> {o['end_ms']:8.1f} ms, "
                  f"{o['in_flight_during_backward_ms']:7.1f} ms of it during backward")
        for h in step["phases"]:
            print(f"  {h['name']:20s} thread {h['tid']!s:>8} {h['start_ms']:8.1f} -> {h['end_ms']:8.1f} ms")


def main(argv=None) -> int:
    args = parse(argv)
    if "LOCAL_RANK" in os.environ:
        run_rank(args)
        return 0
    from turbotrain.comm.launch import torchrun_command

    cmd = torchrun_command(2, __file__, sys.argv[1:] if argv is None else argv)
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        return done.returncode
    out = Path(args.out)
    traces = sorted(out.glob("rank*.trace.json*"))
    report = {t.name: analyse(t) for t in traces}
    for name, per_step in report.items():
        print(f"== {name}")
        show(per_step)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

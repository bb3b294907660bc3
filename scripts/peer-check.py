#!/usr/bin/env python
"""Time a hand-written fp32 loop and a torch.autocast loop outside the benchmark ladder.

An independent check of the ladder's peer rows (fp32-eager, torch-amp): this file uses nothing of
turbotrain.bench, only the workload, and writes its training loops out by hand. Run it on a quiet
machine and compare:

    .venv/bin/python scripts/peer-check.py                         # default gpt, 6 steps
    .venv/bin/python scripts/peer-check.py --results bench-out/results.json

With --results the workload settings and seed are taken from that run's header, and each loop's
median step time is compared with the ladder's row: they agree when the ratio is within the
ladder's own p20-p80 spread or 15%, whichever is wider (timings on a shared CPU are noisy). The
first losses are compared too: same seed, same batches and same AdamW settings give the same curve.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

from turbotrain.workloads import get_workload

# Written out again on purpose (not imported from turbotrain.bench) so the check stays independent.
ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "fused": True}  # as bench.make_optimizer
TOLERANCE = 0.15


def run_loop(workload, *, amp: bool, steps: int, warmup: int, seed: int) -> tuple[list[float], list[float]]:
    """(losses of every step, seconds of the measured steps) of a plain loop, optionally autocast."""
    stream = workload.batches(split="train", seed=seed, device="cpu")
    batches = [next(stream) for _ in range(warmup + steps)]
    torch.manual_seed(seed)
    model = workload.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, times = [], []
    for i, (inputs, targets) in enumerate(batches):
        t0 = time.perf_counter()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
        with ctx:
            loss = workload.loss_fn(model(inputs), targets)
        loss.backward()  # bf16 keeps fp32's exponent range: no GradScaler, as the AMP docs advise
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        losses.append(loss.item())
        if i >= warmup:
            times.append(elapsed)
    return losses, times


def compare(name: str, losses: list[float], times: list[float], row: dict | None) -> bool:
    median = statistics.median(times)
    print(f"{name:<11} median step {median:.3f} s over {len(times)} steps; losses {[round(x, 4) for x in losses[:4]]}")
    if row is None or row.get("status") != "ok":
        return True
    ladder = row["metrics"]["step_time"]
    spread = max(TOLERANCE, (ladder["p80"] - ladder["p20"]) / ladder["median"])
    ratio = median / ladder["median"]
    n = min(len(losses), len(row["losses"]))
    loss_gap = max(abs(a - b) for a, b in zip(losses[:n], row["losses"][:n]))
    agree = abs(ratio - 1.0) <= spread
    print(f"{'':<11} ladder {ladder['median']:.3f} s (p20-p80 {ladder['p20']:.3f}-{ladder['p80']:.3f}); "
          f"ratio {ratio:.2f} -> {'agree within noise' if agree else 'DISAGREE'} (allowed ±{spread:.0%}); "
          f"max loss gap over {n} steps {loss_gap:.2e}")
    return agree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--results", help="a results.json of `turbotrain bench` to compare against")
    args = parser.parse_args()
    overrides, seed, rows = {}, 0, {}
    if args.results:
        results = json.load(open(args.results))
        overrides = results["header"]["workload"]["overrides"]
        seed = results["header"]["run"]["seed"]
        rows = results["configs"]
        if results["header"]["run"]["device"] != "cpu":
            print("peer-check times CPU loops; the results given are from", results["header"]["run"]["device"])
    workload = get_workload("gpt", **overrides)
    print(f"{workload.description}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    ok = True
    for name, amp in (("fp32-eager", False), ("torch-amp", True)):
        losses, times = run_loop(workload, amp=amp, steps=args.steps, warmup=args.warmup, seed=seed)
        ok &= compare(name, losses, times, rows.get(name))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

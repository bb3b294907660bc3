"""``turbotrain tune``: the fastest Config for this model on this machine that keeps the loss.

* ``space``: the search space, enumerated (precision x fusion x compile x checkpointing x
  micro-batch/accumulation; compression x bucket size for the chosen recipe when data parallel).
* ``facts``, ``prune``: what is known without running a candidate (one FP32 analysis pass, the
  hardware flags, measured matmul peaks and bandwidth), the memory estimate, the ordering model.
* ``search``: the survivors measured with the interleaved ladder (bench/interleave.py) within a
  time budget, each checked against the FP32 shadow run; ``report``: tuned.json, tune.json,
  tune.md, tune.html. ``row``: the bench rows built from a Config (``tt-config``, ``tt-tuned``).
* ``dp_prune``, ``dp_search``: the data-parallel stage of ``turbotrain tune --nproc N``: the
  winner's compression x bucket size priced by comm/model.py's alpha-beta model, the survivors
  measured as torchrun jobs (bench/dp_ladder.py's job runner).

Like bench/, this is harness: it imports the library, and the library imports it only when
``turbotrain.tune(...)`` is called. The package itself is callable, so ``turbotrain.tune(...)``
and ``turbotrain.tune.search`` both work.
"""

from __future__ import annotations

import sys
import tempfile
import time
import types
from pathlib import Path

__all__ = ["tune"]


def tune(model_fn, optimizer_fn, batches, *, loss_fn=None, val_batches=None, max_memory=None, budget=300.0,
         out=None, device: str = "auto", steps: int = 5, rounds: int = 5, warmup: int = 2, seed: int = 0,
         max_candidates: int | None = None):
    """Search the Config space for ``model_fn()`` trained by ``optimizer_fn(params)`` on ``batches``.

    ``batches``: a list of batches in the Engine's contract ((inputs, targets) with ``loss_fn``, a
    dict for ``model(**batch)``, ...); the last quarter is held out for the loss check unless
    ``val_batches`` is given. ``max_memory``: bytes or a size such as '8G'. ``budget``: seconds or
    a duration such as '5m'. ``out``: where the four reports go (default: a temporary folder).
    The callables must be importable (module-level functions): each candidate trains in its own
    process. Returns a TuneResult whose ``config`` is the winning turbotrain.Config.

    This tunes one process: the data-parallel stage (compression x bucket size as torchrun jobs) is
    ``turbotrain tune --workload NAME --nproc N``, which needs a workload the jobs can load by name.
    """
    from .search import TuneSettings, parse_duration, parse_memory, run_tune
    from ..workloads.user import save_payload, user_workload

    started = time.monotonic()
    workload = user_workload(model_fn, optimizer_fn, batches, loss_fn=loss_fn, val_batches=val_batches)
    settings = TuneSettings(budget_s=parse_duration(budget, "budget"), max_memory=parse_memory(max_memory, "max_memory"),
                            steps=steps, rounds=rounds, warmup=warmup, seed=seed, device=device,
                            val_batches=len(workload.batches.val), max_candidates=max_candidates)
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="turbotrain-tune-out-"))
    with tempfile.TemporaryDirectory(prefix="turbotrain-tune-payload-") as tmp:
        payload = save_payload(workload, Path(tmp) / "workload.pkl")
        return run_tune(workload, settings, out, workload_spec={"workload": "user", "payload": str(payload)},
                        started=started)


class _CallableModule(types.ModuleType):
    """Makes ``turbotrain.tune(...)`` call tune() while ``turbotrain.tune`` stays this package."""

    def __call__(self, *args, **kwargs):
        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

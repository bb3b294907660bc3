"""The benchmark ladder on a model of yours: ``turbotrain.bench.compare(model_fn, batches, ...)``.

``turbotrain bench --workload NAME`` runs the ladder on a workload turbotrain knows by name (its own,
or any transformers family as ``hf:<model_type>``). ``compare`` runs the same ladder, rows, reference
(``torch-compile-step``, the whole step compiled as a careful user writes it), A/A row, intervals,
loss check and reports, on the model your ``model_fn`` builds and the batches you give. Every row
trains in its own process, so the functions travel there by reference, as with ``turbotrain.tune``:
module-level functions (or functools.partial of them), and a script keeps its work under
``if __name__ == "__main__":``. Every row steps the ladder's one optimizer (fused AdamW,
``make_optimizer``), as on the named workloads, so no row is credited with another's optimizer.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .configs import make_optimizer
from .runner import DEFAULT_ROUNDS, DEFAULT_STEPS, DEFAULT_WARMUP, LadderSettings, run_ladder

__all__ = ["compare"]


def compare(model_fn, batches, *, loss_fn=None, val_batches=None, configs=None, out="bench-out",
            steps: int = DEFAULT_STEPS, warmup: int = DEFAULT_WARMUP, rounds: int = DEFAULT_ROUNDS,
            device: str = "auto", reference: str | None = None, aa: bool = True, malloc_tuned: bool = False,
            unit: str = "samples", timeout: float = 1200.0, console=None) -> dict:
    """Run the benchmark ladder on ``model_fn()`` trained on ``batches``; returns the results dict
    (results.json's content; docs/benchmark-schema.md) and writes the reports into ``out``.

    ``batches``: a list in the Engine's batch contract ((inputs, targets) with ``loss_fn``, or without
    it ``model(inputs, targets)`` and the model's own loss as nanoGPT computes it; a dict for
    ``model(**batch)`` whose output has ``.loss`` or a ``"loss"`` entry); train batches cycle, and the last quarter is
    held out for the val loss unless ``val_batches`` is given. ``configs``: row names (``turbotrain
    bench --list``; a list, or one comma-separated string), default the device's ladder.
    ``malloc_tuned``: start every row's process with glibc's tuned allocator settings
    (``--malloc-tuned``), peers and turbotrain rows alike. ``unit``: throughput in "samples" (rows)
    or "tokens" (elements of the inputs, a (batch, sequence) tensor of ids, or ``input_ids``).
    """
    from ..hardware import TUNED_MALLOC_ENV
    from ..workloads.user import save_payload, user_workload

    workload = user_workload(model_fn, make_optimizer, batches, loss_fn=loss_fn, val_batches=val_batches, unit=unit)
    if isinstance(configs, str):
        configs = [c.strip() for c in configs.split(",") if c.strip()]
    env = dict(TUNED_MALLOC_ENV) if malloc_tuned else {}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the workers inherit it
    try:
        with tempfile.TemporaryDirectory(prefix="turbotrain-compare-") as tmp:
            payload = save_payload(workload, Path(tmp) / "workload.pkl")
            settings = LadderSettings(workload=workload.name, configs=tuple(configs) if configs else None, steps=steps,
                                      warmup=warmup, rounds=rounds, device=device, timeout=timeout,
                                      val_batches=len(workload.batches.val), reference=reference, aa=aa,
                                      payload=str(payload))
            return run_ladder(settings, out, console=console, workload=workload)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

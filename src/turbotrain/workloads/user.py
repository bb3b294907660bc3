"""A user's model as a workload the bench workers can load: ``turbotrain.tune(model_fn, ...)`` and
``turbotrain.bench.compare(model_fn, ...)``.

Each candidate or row trains in its own worker process, so the user's callables travel there by pickle:
by reference, which needs module-level functions (or functools.partial of them), not lambdas or
closures. save_payload checks that before any work and says how to fix it. Functions of the script
being run are found by running it again in the worker as ``__mp_main__`` (multiprocessing's way),
so a script that calls tune() or compare() keeps its work under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..errors import ConfigError
from ..workloads.base import Workload

__all__ = ["ListBatches", "UserWorkload", "user_workload", "save_payload"]


class ListBatches:
    """``batches(split, seed, device)`` over fixed lists: train cycles, val repeats its list."""

    def __init__(self, train: list, val: list):
        self.train, self.val = list(train), list(val)

    def __call__(self, split: str = "train", seed: int = 0, device: str = "cpu"):
        source = self.train if split == "train" else self.val
        move = lambda b: torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), b)  # noqa: E731
        while True:
            for batch in source:
                yield move(batch)


@dataclass
class UserWorkload(Workload):
    optimizer_fn: Optional[Callable] = None
    """Called with the parameters after the Engine's transforms (the Engine's optimizer factory)."""


def _inputs(batch) -> torch.Tensor:
    """The tensor a batch's rows and tokens are counted on: ``input_ids`` of a dict, else the first tensor."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"]
    leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    if not leaves or leaves[0].dim() == 0:
        raise ConfigError("the batches must hold tensors with a batch dimension: (inputs, targets), a dict or a tensor")
    return leaves[0]


def user_workload(model_fn, optimizer_fn, batches, loss_fn=None, val_batches=None, unit: str = "samples") -> UserWorkload:
    """A UserWorkload over ``batches`` (a list); val: ``val_batches``, else the last quarter of ``batches``
    (at least one), which is then not trained on. ``unit``: what throughput counts, "samples" (rows of
    the inputs) or "tokens" (their elements: a (batch, sequence) tensor of token ids, or ``input_ids``)."""
    if unit not in ("samples", "tokens"):
        raise ConfigError(f"unit={unit!r} is not a throughput unit; choose 'samples' or 'tokens'")
    for name, fn in (("model_fn", model_fn), ("optimizer_fn", optimizer_fn)):
        if not callable(fn):
            raise ConfigError(f"{name} must be callable ({name}() -> model; optimizer_fn(params) -> optimizer)")
    batches = list(batches)
    if val_batches is None:
        if len(batches) < 2:
            raise ConfigError("at least 2 batches are needed (one to train on, one for the loss check), "
                              "or pass val_batches=")
        held = max(1, len(batches) // 4)
        batches, val_batches = batches[:-held], batches[-held:]
    val_batches = list(val_batches)
    if not batches or not val_batches:
        raise ConfigError("at least one train batch and one val batch are needed")
    inputs = _inputs(batches[0])
    rows = int(inputs.shape[0])
    return UserWorkload(name="user", kind="user", unit=unit, items_per_batch=rows if unit == "samples" else inputs.numel(),
                        build_model=model_fn,
                        loss_fn=loss_fn, batches=ListBatches(batches, val_batches),
                        description=f"{getattr(model_fn, '__qualname__', type(model_fn).__name__)} on "
                                    f"{len(batches)} train / {len(val_batches)} val batches of {rows} rows",
                        optimizer_fn=optimizer_fn)


def save_payload(workload: UserWorkload, path: Path) -> Path:
    """Pickle ``workload`` for the workers (bench.worker.load_payload); ConfigError when a callable
    cannot travel by reference."""
    try:
        blob = pickle.dumps(workload)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ConfigError(
            f"every tune candidate and ladder row trains in its own process, so model_fn, optimizer_fn and loss_fn must be "
            f"importable: module-level functions or functools.partial of them, not lambdas or local functions "
            f"({exc})") from exc
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    path.write_bytes(pickle.dumps({"sys_path": list(sys.path), "main_path": main and str(Path(main).resolve()),
                                   "workload": blob}))
    return path

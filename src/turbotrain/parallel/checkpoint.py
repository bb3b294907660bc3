"""Sharded checkpoints: every rank writes its own shards, any number of ranks reads them back.

torch.distributed.checkpoint (DCP) does the work: ``get_state_dict`` names every tensor by its
fully qualified name in the *unwrapped* model (no FSDP, DDP or compile prefixes) and keeps it a
DTensor where it is sharded, ``dcp.save`` writes each rank's pieces with a global index, and
``dcp.load`` reads whatever pieces the loading ranks' own sharding needs. So a checkpoint saved
by FSDP on N ranks loads on M ranks, into FSDP, tensor parallel, DDP or one plain process, with
the optimizer state.

A checkpoint directory holds DCP's files plus ``extra.pt`` (what the caller passed as ``extra``:
step counts, scheduler, RNG, written by rank 0). It is complete or absent: it is written as
``<dir>.tmp-<token>`` and, after every rank has finished, rank 0 renames it into place; a
previous checkpoint of the same name is moved aside first and removed after the rename, so a
crash leaves either the old checkpoint or the new one (the old one as ``<dir>.old-<token>`` if
the crash fell between the two renames, which load_sharded names). DCP's own marker, ``.metadata``
written last, only says a directory is complete; it cannot replace one checkpoint by another
atomically, which is why the rename is ours. The directory must be on a file system every rank sees.

>>> import tempfile, torch
>>> net = torch.nn.Linear(3, 2)
>>> path = save_sharded(tempfile.mkdtemp() + "/step-1", net, extra={"steps": 1})
>>> load_sharded(path, torch.nn.Linear(3, 2))["steps"]
1
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import _fsync_dir, atomic_save
from ..errors import CheckpointError

__all__ = ["save_sharded", "load_sharded", "consolidate", "run_consolidate", "EXTRA_FILE"]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

#: The caller's ``extra`` dict, beside DCP's files.
EXTRA_FILE = "extra.pt"
_MARKER = ".metadata"  # DCP writes it last, on the coordinator rank


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def _barrier() -> None:
    dist = _dist()
    if dist:
        dist.barrier()


@contextlib.contextmanager
def _single_process_is_meant():
    # DCP warns whenever it runs without a process group; here that is the documented single-process
    # use (a world of one, consolidate), not a forgotten init_process_group.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _agreed_token() -> str:
    """A name every rank uses for this save's temporary directory (rank 0's random token)."""
    token = [secrets.token_hex(4)]
    dist = _dist()
    if dist:
        dist.broadcast_object_list(token, src=0)
    return token[0]


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def save_sharded(path_dir, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 extra: dict | None = None) -> Path:
    """Write ``model`` (and ``optimizer``) shards and ``extra`` to the directory ``path_dir``, atomically.

    Every rank calls it (it is collective). ``extra`` is taken from rank 0. Returns the directory.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path_dir)
    token = _agreed_token()
    tmp = path.with_name(f"{path.name}.tmp-{token}")
    state = _state(model, optimizer)
    if _rank() == 0:
        _remove_abandoned(path)
        tmp.mkdir(parents=True)
    _barrier()
    try:
        with _single_process_is_meant():
            dcp.save(state, checkpoint_id=str(tmp), no_dist=_dist() is None)
        if _rank() == 0:
            atomic_save(dict(extra or {}), tmp / EXTRA_FILE, integrity=False)
    except OSError as exc:
        raise CheckpointError(f"could not write the sharded checkpoint {path}: {exc}") from exc
    _barrier()  # every rank's shards are on disk
    if _rank() == 0:
        _swap_in(tmp, path, token)
    _barrier()  # nobody reads the path before it is there
    return path


def _swap_in(tmp: Path, path: Path, token: str) -> None:
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}.old-{token}")
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_abandoned(path: Path) -> None:
    # Temporary directories of saves that died before their rename (a new save supersedes them).
    for stale in path.parent.glob(f"{path.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
        logger.info("removed %s, left behind by an interrupted save", stale)


def _check_dir(path: Path) -> None:
    if (path / _MARKER).is_file():
        return
    aside = sorted(path.parent.glob(f"{path.name}.old-*"))
    if not path.exists() and aside:
        raise CheckpointError(f"{path} is missing, but {aside[-1]} holds the checkpoint it replaced (a save was "
                              f"interrupted between two renames); rename {aside[-1]} to {path} to resume from it")
    what = "does not exist" if not path.exists() else "is not a sharded checkpoint (no DCP .metadata in it)"
    raise CheckpointError(f"{path} {what}; give a directory written by save_sharded / Engine.save with parallel "
                          "training (a single-file checkpoint loads with Engine.load)")


def load_sharded(path_dir, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load the directory ``path_dir`` into ``model`` (and ``optimizer``) as they are sharded now; return extra.

    Collective when a process group is running. The model may be FSDP, tensor parallel, DDP or
    plain, on any number of ranks, whatever the saving run used.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path_dir)
    _check_dir(path)
    state = _state(model, optimizer)
    _check_no_unexpected_weights(path, state["model"])

    try:
        with _single_process_is_meant():
            dcp.load(state, checkpoint_id=str(path), no_dist=_dist() is None)
    except (CheckpointException, RuntimeError, ValueError) as exc:  # a missing key, a shape that differs
        what = "the model and optimizer" if optimizer is not None else "the model"
        reason = [line.strip() for line in str(exc).splitlines() if line.strip()][-1:] or [type(exc).__name__]
        raise CheckpointError(f"{path} does not hold {what} as built here: {reason[0]}") from exc
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    extra = path / EXTRA_FILE
    return torch.load(extra, map_location="cpu", weights_only=False) if extra.is_file() else {}


def _saved_weights(path: Path) -> dict:
    """Key (without 'model.') -> storage metadata of every model tensor in the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = "model."
    return {key[len(prefix):]: item
            for key, item in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)}


def _check_no_unexpected_weights(path: Path, model_state: dict) -> None:
    # DCP loads the keys it is asked for and ignores the rest; model.load_state_dict(strict=True) would not.
    unexpected = sorted(set(_saved_weights(path)) - set(model_state))
    if unexpected:
        listed = ", ".join(unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        raise CheckpointError(f"{path} does not hold the model as built here: it has weights this model lacks "
                              f"({listed}); build the model the checkpoint was saved from")


def consolidate(path_dir, out_path) -> Path:
    """Gather the model weights of a sharded checkpoint into one stock state_dict file.

    The file is a plain ``{name: tensor}`` dict keyed like the unwrapped model, so it loads with
    ``model.load_state_dict(torch.load(out_path))``. Runs in one process (no process group); it
    holds the whole model in CPU memory. Optimizer state and extra are left out.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path_dir)
    _check_dir(path)
    weights = {key: torch.empty(item.size, dtype=item.properties.dtype) for key, item in _saved_weights(path).items()}
    if not weights:
        raise CheckpointError(f"{path} holds no model weights (keys under 'model.')")
    with _single_process_is_meant():
        dcp.load({"model": weights}, checkpoint_id=str(path), no_dist=True)
    return atomic_save(weights, out_path, integrity=False)


def run_consolidate(path_dir, out_path) -> str:
    """What ``turbotrain ckpt consolidate DIR OUT.pt`` runs: consolidate, and one line saying what was written."""
    out = consolidate(path_dir, out_path)
    state = torch.load(out, map_location="cpu", weights_only=True, mmap=True)
    numel = sum(t.numel() for t in state.values())
    return f"wrote {out}: {len(state)} tensors, {numel:,} values, from the sharded checkpoint {path_dir}"

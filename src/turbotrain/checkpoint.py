"""Atomic checkpoint files: a crash mid-write never leaves a truncated checkpoint behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from .errors import CheckpointError

__all__ = ["atomic_save", "load_checkpoint", "load_model_weights"]

FORMAT_VERSION = 1


def atomic_save(obj, path: str | os.PathLike) -> Path:
    """torch.save to a temporary file beside ``path``, fsync it, then rename over ``path``."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory; give a file path such as {path / 'ckpt.pt'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Read a turbotrain checkpoint, with a clear error for a missing or foreign file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; check the path (engine.save(path) writes one)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for a corrupt or foreign file
        raise CheckpointError(f"{path} is not a readable torch checkpoint ({exc}); was it fully written?") from exc
    if not isinstance(state, dict) or state.get("format") != "turbotrain" or "model" not in state:
        raise CheckpointError(
            f"{path} is not a turbotrain Engine checkpoint; for a plain state_dict use "
            "model.load_state_dict(torch.load(path))"
        )
    if state.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer turbotrain (format {state['version']}); upgrade turbotrain"
        )
    return state


def load_model_weights(path: str | os.PathLike, model: torch.nn.Module, strict: bool = True):
    """Load an Engine checkpoint's FP32 weights into a plain, untransformed model (stock layout)."""
    return model.load_state_dict(load_checkpoint(path)["model"], strict=strict)

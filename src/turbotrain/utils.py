"""Small helpers more than one package needs: atomic file writes, device sync, SQNR, optional imports,
model runs that leave no trace.

This module imports nothing from turbotrain but ``errors``, so every package can use it without an
import cycle.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "out.json"
>>> atomic_write(path, '{"ok": true}')
>>> path.read_text()
'{"ok": true}'
>>> sqnr_db(torch.ones(4), torch.ones(4))
inf
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import tempfile
from pathlib import Path
from typing import Callable, Union

import torch

from .errors import ConfigError, HardwareError

__all__ = ["atomic_write", "check_output_dir", "check_output_file", "sync_device", "sqnr_db", "require", "local_shard"]

_Data = Union[str, bytes, Callable]


def atomic_write(path: str | os.PathLike, data: _Data, *, encoding: str = "utf-8") -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half of one.

    ``data`` is text, bytes, or a function ``write(binary_file)`` (``np.save``, ``fig.savefig``).
    The temp file gets a unique name in the target folder (``tempfile.mkstemp``: two writers of
    the same path never share a temp file, and ``os.replace`` stays on one filesystem), is fsynced
    before the rename so a crash cannot leave an empty file under the final name, and takes the
    umask's permissions like any new file (mkstemp alone would make it 0600).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode(encoding) if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    # /proc first: os.umask() can only be read by setting it, which races with other threads
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def sync_device(device: str | torch.device) -> None:
    """Wait for the queued work of ``device`` ('cpu', 'cuda', 'cuda:1', 'mps' or a torch.device).

    Timing a GPU step without this measures the launch, not the kernels. A CPU runs eagerly, so
    there is nothing to wait for.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio of ``actual`` against ``reference`` in dB.

    ``10 log10(|ref|^2 / |ref - actual|^2)``, computed in float64; inf when the two are equal,
    -inf when the reference is all zeros and they are not.
    """
    ref = reference.detach().double()
    noise = float((actual.detach().double() - ref).pow(2).sum())
    signal = float(ref.pow(2).sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def require(module: str, extra: str, feature: str):
    """Import an optional dependency, or raise HardwareError naming the extra that installs it.

    >>> require("math", "bench", "the benchmark report").pi > 3
    True
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise HardwareError(f"{feature} needs {top}, which is not installed: pip install 'turbotrain[{extra}]'"
                            ) from exc


def check_output_dir(path: str | os.PathLike, name: str = "--out") -> Path:
    """Raise ConfigError unless ``path`` is, or can be created as, a writable directory.

    Run before the work that fills it, so a typo costs a line instead of a finished benchmark:
    ``path`` or one of its parents may be a regular file, or the nearest existing folder may not
    be writable.
    """
    path = Path(path)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                what = "is" if folder == path else f"is inside {folder}, which is"
                raise ConfigError(f"{name} {str(path)!r} {what} a file, not a directory; "
                                  "give a directory path")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise ConfigError(f"{name} {str(path)!r}: {folder} is not writable")
            break
    return path


def check_output_file(path: str | os.PathLike, name: str = "--out") -> Path:
    """Raise ConfigError unless ``path`` can be written as a file: not a directory, and its folder
    is, or can be created as, a writable directory."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{name} {str(path)!r} is a directory; give a file name, e.g. {path / 'out.json'}")
    check_output_dir(path.absolute().parent, name)
    return path


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (read without a collective; an in-place op on it changes the
    DTensor), else ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


@contextlib.contextmanager
def leaves_no_trace(model: torch.nn.Module):
    """Run ``model`` for inspection without changing what the training run does next.

    The global random state (CPU and the CUDA devices the model is on) is restored afterwards, so a
    probe's dropout masks are not drawn from the run's stream, and every buffer (BatchNorm running
    statistics, counters) gets its value back. A backward through the probe's graph belongs inside
    the block: the buffers it saved are put back on leaving it.
    """
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            with torch.no_grad():  # only those that changed: a copy bumps the version autograd checks
                for b, value in saved:
                    if not torch.equal(b, value):
                        b.copy_(value)

"""Checkpoint files you can trust.

* **Atomic.** A checkpoint is written to a temporary file beside its target, fsynced and renamed
  over it, so a crash or a full disk leaves the previous checkpoint whole and no temporary behind.
* **Verified.** Every save records a SHA-256 of each top-level part and of each tensor in it; a
  load recomputes them and names the part (and tensor) whose bytes changed.
* **Checked.** A file that is not a turbotrain checkpoint, lacks a part, or comes from a newer
  turbotrain is refused with a CheckpointError that says what is wrong.

>>> import tempfile, torch
>>> path = tempfile.mkdtemp() + "/ck.pt"
>>> state = {"format": "turbotrain", "version": FORMAT_VERSION, "model": {"w": torch.ones(2)},
...          "optimizer": {}, "engine": {"steps": 0}, "config": {}}
>>> _ = atomic_save(state, path)
>>> torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(2))
True
"""

from __future__ import annotations

import errno
import glob
import hashlib
import logging
import os
import secrets
import time
import warnings
import zipfile
from pathlib import Path

import torch

from .errors import CheckpointError, CheckpointWarning

try:  # file locks tell a live save's temporary file from an abandoned one; POSIX only
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = [
    # writing and reading
    "atomic_save", "load_checkpoint", "load_model_weights",
    # checks
    "validate_structure", "integrity_record", "CheckpointWarning",
    # random number generators
    "rng_state", "set_rng_state",
    "FORMAT_VERSION", "REQUIRED_KEYS",
]

logger = logging.getLogger(__name__)

#: 2 adds state["integrity"]; format 1 files (no hashes) still load, with a CheckpointWarning.
FORMAT_VERSION = 2
#: Parts an Engine checkpoint must hold (besides "format" and "version").
REQUIRED_KEYS = ("model", "optimizer", "engine", "config")
_DICT_PARTS = ("model", "optimizer", "engine", "config")
_ALGORITHM = "sha256"
# Where file locks are unavailable, a temporary file untouched this long is taken as abandoned;
# an hour is far longer than any save spends between two writes.
_ABANDONED_AFTER_S = 3600.0


# -- writing ---------------------------------------------------------------------------------
def atomic_save(obj, path: str | os.PathLike, *, integrity: bool = True) -> Path:
    """torch.save ``obj`` to a temporary file beside ``path``, fsync it, then rename it over ``path``.

    A dict gets state["integrity"] (see integrity_record) unless ``integrity=False``; the caller's
    dict is not modified. Temporary files left beside ``path`` by an interrupted save are removed
    first. The file gets the permissions of the user's umask. Any OSError (a full disk, a missing
    permission) raises CheckpointError, with the previous file at ``path`` untouched.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory; give a file path such as {path / 'ckpt.pt'}")
    if integrity and isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k != "integrity"}
        obj["integrity"] = integrity_record(obj)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_temps(path)
        fd, tmp = _create_temp(path)
    except OSError as exc:
        raise _write_error(path, exc) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            _lock(f.fileno())
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        # torch.save reports a failed write as RuntimeError("unexpected pos ...") with the OSError
        # as its context; find it so the message says "No space left on device".
        os_error = _find_os_error(exc)
        if os_error is not None and isinstance(exc, (OSError, RuntimeError)):
            raise _write_error(path, os_error) from exc
        raise
    _fsync_dir(path.parent)
    return path


def _create_temp(path: Path) -> tuple[int, Path]:
    """Create ``.{name}.XXXXXXXX.tmp`` beside ``path`` exclusively.

    Mode 0o666 lets the kernel apply the umask (tempfile.mkstemp would force 0o600, and reading the
    umask with os.umask() briefly changes it for every thread).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(path.parent))


def _lock(fd: int) -> None:
    """Hold an exclusive lock on a temporary file while it is written: it marks the save as alive."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a file system without locks; _is_abandoned falls back to the file's age
            pass


def _remove_abandoned_temps(path: Path) -> None:
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        if _is_abandoned(tmp):
            tmp.unlink(missing_ok=True)
            logger.info("removed %s, left behind by an interrupted save", tmp)


def _is_abandoned(tmp: Path) -> bool:
    """True when no live save holds ``tmp`` (another process may be saving to the same path)."""
    try:
        fd = os.open(tmp, os.O_RDONLY)
    except OSError:
        return False
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False
            except OSError:
                pass
        return time.time() - os.fstat(fd).st_mtime > _ABANDONED_AFTER_S
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable; some file systems cannot fsync a directory, which is harmless."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _find_os_error(exc: BaseException | None) -> OSError | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _write_error(path: Path, exc: OSError) -> CheckpointError:
    code = errno.errorcode.get(exc.errno, "no errno") if exc.errno is not None else "no errno"
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        fix = "free space on that file system (or raise the quota) or save somewhere else"
    else:
        fix = "check that the directory exists and is writable"
    return CheckpointError(
        f"could not write checkpoint {path}: {exc.strerror or exc} ({code}); the previous file there, "
        f"if any, is unchanged and no temporary file was left; {fix}"
    )


# -- content hashes ----------------------------------------------------------------------------
def integrity_record(state: dict) -> dict:
    """SHA-256 digests of each top-level part of ``state`` and of every tensor inside it.

    Returns {"algorithm": "sha256", "parts": {key: hex}, "tensors": {key: {path: hex}},
    "record": hex}; "record" hashes the rest, so damage to the record itself is told apart.
    Tensors are hashed by dtype, shape and raw bytes; dicts in sorted-key order. ``state`` must
    not already contain "integrity" (atomic_save removes it).
    """
    parts, tensors = {}, {}
    for key in _sorted_keys(state):
        h, found = hashlib.sha256(), {}
        _feed(h, state[key], "", found)
        parts[key] = h.hexdigest()
        if found:
            tensors[key] = found
    record = {"algorithm": _ALGORITHM, "parts": parts, "tensors": tensors}
    record["record"] = _record_digest(record)
    return record


def _record_digest(record: dict) -> str:
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in record.items() if k != "record"}, "", {})
    return h.hexdigest()


def _feed(h, obj, path: str, tensors: dict) -> None:
    """Hash a canonical serialisation of ``obj``; record each tensor's own digest under its path."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = digest = _tensor_digest(obj, path)
        _put(h, b"T", digest.encode())
    elif isinstance(obj, dict):
        _put(h, b"D", str(len(obj)).encode())
        for key in _sorted_keys(obj):
            _put(h, b"K", _scalar_bytes(key))
            _feed(h, obj[key], f"{path}.{key}" if path else str(key), tensors)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = _sorted_keys(obj) if isinstance(obj, (set, frozenset)) else obj
        _put(h, b"L", str(len(items)).encode())
        for i, item in enumerate(items):
            _feed(h, item, f"{path}.{i}" if path else str(i), tensors)
    else:
        _put(h, b"V", _scalar_bytes(obj))


def _put(h, tag: bytes, payload: bytes) -> None:
    # Tag and length first, so no two different structures can produce the same byte stream.
    h.update(tag + len(payload).to_bytes(8, "little"))
    h.update(payload)


def _scalar_bytes(value) -> bytes:
    # repr is exact for the scalars a weights_only checkpoint can hold (floats round-trip).
    return f"{type(value).__qualname__}:{value!r}".encode()


def _sorted_keys(items) -> list:
    try:
        return sorted(items)
    except TypeError:  # mixed key types, e.g. int and str
        return sorted(items, key=lambda k: (type(k).__qualname__, repr(k)))


def _tensor_digest(t: torch.Tensor, path: str) -> str:
    try:
        t = t.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        t = t.resolve_conj().resolve_neg().cpu().contiguous()
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(
            f"cannot hash tensor {path!r} ({exc}); save it with atomic_save(..., integrity=False)"
        ) from exc
    return h.hexdigest()


def _verify(state: dict, record, where) -> None:
    """Raise CheckpointError naming every part (and its first tensor) whose digest changed."""
    if not isinstance(record, dict) or record.get("algorithm") != _ALGORITHM:
        raise CheckpointError(
            f"{where} carries an integrity record turbotrain cannot read; it is damaged or was written "
            "by a newer turbotrain (upgrade turbotrain)"
        )
    if record.get("record") != _record_digest(record) or not isinstance(record.get("parts"), dict):
        raise CheckpointError(
            f"{where} is damaged: its integrity record does not match its own digest, so the data "
            "cannot be verified; restore an earlier checkpoint"
        )
    fresh = integrity_record(state)
    stored_parts, fresh_parts = record["parts"], fresh["parts"]
    problems = []
    for key, digest in stored_parts.items():
        if key not in fresh_parts:
            problems.append(f"part {key!r} is missing")
        elif fresh_parts[key] != digest:
            tensor = _first_changed_tensor(record.get("tensors", {}).get(key, {}), fresh["tensors"].get(key, {}))
            problems.append(f"part {key!r} changed" + (f" (tensor {tensor!r})" if tensor else ""))
    problems += [f"part {key!r} was not saved" for key in fresh_parts if key not in stored_parts]
    if problems:
        raise CheckpointError(
            f"{where} is damaged: {'; '.join(problems)} since it was saved (SHA-256 mismatch); "
            "restore an earlier checkpoint"
        )


def _first_changed_tensor(stored, fresh: dict) -> str | None:
    if not isinstance(stored, dict):
        return None
    for name, digest in stored.items():
        if fresh.get(name) != digest:
            return name or None
    return next((name for name in fresh if name not in stored), None) or None


# -- reading -----------------------------------------------------------------------------------
def load_checkpoint(path: str | os.PathLike, map_location="cpu", *, required=REQUIRED_KEYS) -> dict:
    """Read a turbotrain checkpoint and verify it; returns the dict that was saved (no "integrity").

    Raises CheckpointError for a missing, unreadable, damaged, foreign or incomplete file. A format
    1 checkpoint (no content hashes) loads with a CheckpointWarning.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; check the path (engine.save(path) writes one)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for a corrupt or foreign file
        raise CheckpointError(
            f"{path} is not a readable torch checkpoint ({exc}){_zip_damage(path)}; was it fully written?"
        ) from exc
    _check_format(state, path)
    record = state.pop("integrity", None)
    version = state.get("version")
    if record is not None:
        _verify(state, record, path)
    elif version == FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has no integrity record although format {FORMAT_VERSION} always writes one; it was "
            "edited or written without atomic_save, so it cannot be verified"
        )
    elif isinstance(version, int) and version < FORMAT_VERSION:
        warnings.warn(
            f"{path} is a format {version} checkpoint without content hashes; it is loaded unverified. "
            "Save it again to add them.", CheckpointWarning, stacklevel=2,
        )
    validate_structure(state, required, where=path)
    return state


def _zip_damage(path: Path) -> str:
    """Name the damaged zip entry when the file's own CRC-32s show one (torch.load does not check them)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except Exception:  # noqa: BLE001 - not even a zip archive; the caller's message covers it
        return "; the file is not an intact zip archive"
    return f"; zip entry {bad!r} fails its CRC check, so the file is damaged" if bad else ""


def _check_format(state, where) -> None:
    if not isinstance(state, dict) or state.get("format") != "turbotrain":
        raise CheckpointError(
            f"{where} is not a turbotrain Engine checkpoint; for a plain state_dict use "
            "model.load_state_dict(torch.load(path))"
        )


def validate_structure(state, required=REQUIRED_KEYS, *, where="checkpoint") -> None:
    """Raise CheckpointError unless ``state`` is a turbotrain checkpoint dict holding ``required``.

    Checks format and version, names every missing key, and requires the model, optimizer,
    engine and config parts to be dicts.

    >>> validate_structure({"format": "turbotrain", "version": 2, "model": {}}, required=("model",))
    """
    _check_format(state, where)
    missing = [k for k in ("version", *required) if k not in state]
    if missing:
        raise CheckpointError(
            f"{where} lacks {', '.join(repr(k) for k in missing)}; it was not written by Engine.save() "
            "or was cut down; save it again from the Engine"
        )
    version = state["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{where} has format version {version!r}; expected an integer from 1 to {FORMAT_VERSION}")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{where} was written by a newer turbotrain (format {version}); upgrade turbotrain")
    wrong = [f"{k!r} is a {type(state[k]).__name__}"
             for k in _DICT_PARTS if k in state and not isinstance(state[k], dict)]
    if wrong:
        raise CheckpointError(f"{where} is malformed: {', '.join(wrong)}, not a dict")


def load_model_weights(path: str | os.PathLike, model: torch.nn.Module, strict: bool = True):
    """Load an Engine checkpoint's FP32 weights into a plain, untransformed model (stock layout)."""
    return model.load_state_dict(load_checkpoint(path)["model"], strict=strict)


# -- random number generators --------------------------------------------------------------------
def rng_state() -> dict:
    """The CPU generator state and, once CUDA is in use, every device's: {"cpu": ..., "cuda": [...] or None}.

    CUDA is not initialised just to read its state: a process that never touched it has none.
    """
    cuda_in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if cuda_in_use else None}


def set_rng_state(state) -> None:
    """Restore what rng_state() returned; also a bare CPU state tensor (format 1) or None (no-op).

    CUDA states for more or fewer devices than are visible restore the common ones, with a warning.
    """
    if state is None:
        return
    if isinstance(state, torch.Tensor):
        state = {"cpu": state, "cuda": None}
    if not isinstance(state, dict) or not set(state) <= {"cpu", "cuda"} \
            or not isinstance(state.get("cuda"), (list, tuple, type(None))):
        raise CheckpointError(
            f"cannot restore an RNG state from {type(state).__name__} {_short(state)}; expected "
            "{'cpu': tensor, 'cuda': [tensor, ...] or None} as rng_state() returns"
        )
    try:
        if state.get("cpu") is not None:
            torch.set_rng_state(state["cpu"])
        cuda = state.get("cuda")
        if cuda is not None:
            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if visible != len(cuda):
                warnings.warn(
                    f"the checkpoint holds CUDA RNG states for {len(cuda)} device(s) but {visible} are "
                    f"visible; restoring the first {min(visible, len(cuda))}", CheckpointWarning, stacklevel=2,
                )
            for index, device_state in enumerate(cuda[:visible]):
                torch.cuda.set_rng_state(device_state, index)
    except (TypeError, RuntimeError) as exc:
        raise CheckpointError(
            f"cannot restore the RNG state ({exc}); the checkpoint's 'rng' entry is damaged"
        ) from exc


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

"""Process-group start-up: read the launcher's variables, pick the backend, fail with the fix.

torchrun, Open MPI, MPICH/Intel MPI (PMI) and Slurm each name rank and world size differently;
``init()`` reads whichever set is present, checks it, and starts torch.distributed over env://.

>>> import os; env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
...                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
>>> read_launch_env(env).launcher
'torchrun'
"""

from __future__ import annotations

import atexit
import datetime
import os
import time
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from ..errors import DistributedError, HardwareError, check_number

__all__ = ["DistInfo", "LaunchEnv", "init", "read_launch_env", "is_initialized", "LAUNCHERS"]

#: (launcher, rank variable, world-size variable, local-rank variables in order of preference).
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",)),
    ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    ("pmi", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID")),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",)),
)

_LAUNCH_HINT = (
    "start the script with `turbotrain launch --nproc N script.py` (or torchrun), or set "
    "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself"
)


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher's variables say about this process."""

    launcher: str
    """'torchrun', 'mpi', 'pmi' or 'slurm': which set of variables was read."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job, as ``init()`` set it up."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    """'nccl' or 'gloo'."""
    device: torch.device
    """The device this rank computes on: cuda:LOCAL_RANK with NCCL, cpu with gloo."""
    launcher: str = "torchrun"

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints and writes files."""
        return self.rank == 0


def _int_var(env: Mapping[str, str], name: str, launcher: str) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        raise DistributedError(f"{name} is not set but {launcher} launch variables are present; {_LAUNCH_HINT}")
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not an integer; set it to this process's number") from None


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Parse and check the launcher's variables (``os.environ`` by default) without starting anything."""
    env = os.environ if env is None else env
    for launcher, rank_var, size_var, local_vars in LAUNCHERS:
        if rank_var in env or size_var in env:
            break
    else:
        raise DistributedError(
            "no launcher variables found (RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/PMI_SIZE "
            f"or SLURM_PROCID/SLURM_NTASKS); {_LAUNCH_HINT}"
        )
    rank = _int_var(env, rank_var, launcher)
    world_size = _int_var(env, size_var, launcher)
    if world_size < 1:
        raise DistributedError(f"{size_var}={world_size} must be >= 1: the number of processes in the job")
    if not 0 <= rank < world_size:
        raise DistributedError(
            f"{rank_var}={rank} is outside 0..{world_size - 1} ({size_var}={world_size}); give every process a "
            f"distinct rank below {size_var}"
        )
    local_var = next((v for v in local_vars if v in env), None)
    if local_var is None:
        names = " or ".join(local_vars)
        raise DistributedError(f"{names} is not set; it says which GPU this process uses on its node. {_LAUNCH_HINT}")
    local_rank = _int_var(env, local_var, launcher)
    if local_rank < 0:
        raise DistributedError(f"{local_var}={local_rank} must be >= 0: this process's index on its node")
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        raise DistributedError(
            "MASTER_ADDR is not set; export MASTER_ADDR=<host name or address of rank 0> "
            "(127.0.0.1 on a single machine) on every process"
        )
    port = _int_var(env, "MASTER_PORT", launcher) if "MASTER_PORT" in env else None
    if port is None:
        raise DistributedError("MASTER_PORT is not set; export MASTER_PORT=<free TCP port on rank 0>, e.g. 29500")
    if not 1 <= port <= 65535:
        raise DistributedError(f"MASTER_PORT={port} is not a TCP port; use a free port in 1024..65535")
    return LaunchEnv(launcher, rank, world_size, local_rank, addr, port)


def is_initialized() -> bool:
    """True once torch.distributed has a default process group."""
    return dist.is_available() and dist.is_initialized()


def _pick_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise DistributedError(f"backend={backend!r} is not supported; choose 'nccl' (CUDA) or 'gloo' (CPU)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise HardwareError("backend='nccl' needs CUDA GPUs and none is visible; use backend='gloo' on CPU")
    return backend


def _device_for(backend: str, local_rank: int) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise HardwareError(
            f"local rank {local_rank} has no GPU: only {count} visible on this node; start at most {count} "
            "processes per node (--nproc) or widen CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", local_rank)


_INFO: DistInfo | None = None

#: How long the exit handler releases the GIL for gloo's worker threads (their last releases take microseconds).
EXIT_DRAIN_S = 0.1


def _drain_at_exit() -> None:
    """Give gloo's worker threads the GIL once more before the interpreter starts to finalize.

    A gloo collective completes on one of the group's worker threads, which then drops its references
    to the work and to the Python callback a comm hook chained onto it (``.then``); both need the GIL.
    When the script ends right after the last step, the main thread can reach interpreter shutdown
    first, and a thread that asks for the GIL then is ended inside a C++ destructor: the rank aborts
    after its work is done ("terminate called without an active exception", exit -6: 3 of 60
    two-rank Engine runs here, 2 of 60 with ``destroy_process_group`` at the end, 0 of 80 with this
    handler; benchmarks/2026-12-07-exit-abort). Exit handlers run before that point, so sleeping
    here lets those releases happen while the interpreter is whole.
    """
    time.sleep(EXIT_DRAIN_S)


def _drain_gloo_at_exit(backend: str) -> None:
    # NCCL marks a work's future done on the thread that issued it (the device orders the rest), so
    # its callbacks run and are released there; gloo's run on the group's own threads.
    if backend == "gloo":
        atexit.unregister(_drain_at_exit)  # once, however many times init() is called
        atexit.register(_drain_at_exit)


def _current_info() -> DistInfo:
    # A group made outside init() (or remade after destroy) is described from torch itself.
    if _INFO is not None and (_INFO.rank, _INFO.world_size) == (dist.get_rank(), dist.get_world_size()):
        return _INFO
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device, launcher="existing")


def init(backend: str | None = None, timeout_s: float = 300.0) -> DistInfo:
    """Start torch.distributed from the launcher's variables; a no-op returning the info if already started.

    ``backend=None`` picks NCCL when CUDA is available and gloo otherwise. ``timeout_s`` bounds every
    collective, so a rank that never arrives fails the job instead of hanging it (a rank that dies
    closes its connections, and the others fail at once). An Engine with ``data_parallel`` starts
    the group with the default; call ``init(timeout_s=...)`` before building it for another bound.
    """
    # checked first: timedelta would take a bool, and a timeout of 0 fails every collective at once
    check_number("timeout_s", timeout_s, minimum=0, exclusive=True)
    if not dist.is_available():
        raise HardwareError("this PyTorch build has no torch.distributed; install a build with distributed support")
    global _INFO
    if is_initialized():
        info = _current_info()
        if backend is not None and backend != info.backend:
            raise DistributedError(
                f"torch.distributed is already running on {info.backend!r}, not {backend!r}; call "
                "init() with the same backend (or None), or destroy the process group first"
            )
        _drain_gloo_at_exit(info.backend)
        return info
    launch = read_launch_env()
    backend = _pick_backend(backend)
    device = _device_for(backend, launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # env:// still reads MASTER_ADDR/PORT; rank and size come from whichever launcher set them.
    os.environ.setdefault("MASTER_ADDR", launch.master_addr)
    os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    _INFO = DistInfo(launch.rank, launch.world_size, launch.local_rank, backend, device, launch.launcher)
    _drain_gloo_at_exit(backend)
    return _INFO

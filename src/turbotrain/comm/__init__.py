"""Data-parallel communication: process-group start-up, DDP with gradient compression, NCCL presets.

    from turbotrain import comm
    info = comm.init()                                  # reads torchrun / MPI / Slurm variables
    model, opt, state = comm.prepare(model, opt, DataParallelConfig(compression="bf16"), info.device)
    with state.no_sync(): loss.backward()               # accumulation micro-steps: no traffic

Compression: 'bf16'/'fp16' (cast on the wire), 'powersgd' (rank-r, error feedback) and 'onebit'
(1-bit Adam), all as DDP comm hooks on plain all-reduce futures, so they run on gloo and NCCL.
"""

from .cli import add_cli
from .config import COMPRESSIONS, DataParallelConfig
from .ddp import CommState, convert_batchnorm, prepare, to_onebit_adam
from .env import DistInfo, init, is_initialized, read_launch_env
from .nccl import PRESETS as NCCL_PRESETS
from .nccl import apply_preset, validate_nccl_env
from .onebit import OneBitAdam
from .preflight import build_plan, preflight

__all__ = [
    # start-up
    "init", "DistInfo", "read_launch_env", "is_initialized", "preflight", "build_plan",
    # training
    "prepare", "CommState", "DataParallelConfig", "COMPRESSIONS", "OneBitAdam", "convert_batchnorm",
    "to_onebit_adam",
    # launching and tuning
    "NCCL_PRESETS", "apply_preset", "validate_nccl_env", "add_cli",
]

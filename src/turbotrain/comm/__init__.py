"""Data-parallel communication: process-group start-up, DDP with gradient compression, NCCL presets.

    from turbotrain import comm
    info = comm.init()                                  # reads torchrun / MPI / Slurm variables
    model, opt, state = comm.prepare(model, opt, DataParallelConfig(compression="bf16"), info.device)
    with state.no_sync(): loss.backward()               # accumulation micro-steps: no traffic

Compression: 'bf16'/'fp16' (cast on the wire), 'powersgd' (rank-r, error feedback) and 'onebit'
(1-bit Adam), all as DDP comm hooks on plain all-reduce futures, so they run on gloo and NCCL.

The names below are loaded on first use: ``turbotrain.Config`` needs only ``comm.config``, and
``import turbotrain`` should not pay for DDP, the hooks and torch.distributed's start-up code.
"""

from __future__ import annotations

import importlib

__all__ = [
    # start-up
    "init", "DistInfo", "read_launch_env", "is_initialized", "preflight", "build_plan",
    # training
    "prepare", "CommState", "DataParallelConfig", "COMPRESSIONS", "OneBitAdam", "convert_batchnorm",
    "to_onebit_adam",
    # launching and tuning
    "NCCL_PRESETS", "apply_preset", "validate_nccl_env", "torchrun_command",
]

#: public name -> (submodule, its name there)
_LAZY = {
    "init": ("env", "init"), "DistInfo": ("env", "DistInfo"), "read_launch_env": ("env", "read_launch_env"),
    "is_initialized": ("env", "is_initialized"),
    "preflight": ("agree", "preflight"), "build_plan": ("agree", "build_plan"),
    "prepare": ("ddp", "prepare"), "CommState": ("ddp", "CommState"), "convert_batchnorm": ("ddp", "convert_batchnorm"),
    "to_onebit_adam": ("ddp", "to_onebit_adam"),
    "DataParallelConfig": ("config", "DataParallelConfig"), "COMPRESSIONS": ("config", "COMPRESSIONS"),
    "OneBitAdam": ("onebit", "OneBitAdam"),
    "NCCL_PRESETS": ("nccl", "PRESETS"), "apply_preset": ("nccl", "apply_preset"),
    "validate_nccl_env": ("nccl", "validate_nccl_env"),
    "torchrun_command": ("launch", "torchrun_command"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted({*globals(), *__all__})

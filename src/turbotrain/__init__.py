"""turbotrain: faster, cheaper PyTorch training without changing its results.

>>> import turbotrain
>>> turbotrain.Config(precision="bf16-master").precision
'bf16-master'
"""

import logging

from .checkpoint import load_model_weights
from .comm.config import DataParallelConfig
from .config import Config
from .engine import Engine, StepStats
from .guards import GuardConfig, PrecisionDriftError, PrecisionDriftWarning
from .parallel.config import ParallelConfig
from .errors import (
    CheckpointError, ConfigError, DistributedError, FusionError, HardwareError, LossScaleError, MetaInitError,
    TurbotrainError, UnknownWorkloadError,
)
from .precision.config import LossScaleConfig

__version__ = "0.1.0"

# Library code logs through logging.getLogger(__name__) and never prints; an application (or the
# `turbotrain` command) decides what reaches the terminal. Without a handler of its own, Python would
# show our warnings through its last-resort handler.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    # training
    "Engine", "StepStats", "Config", "LossScaleConfig", "DataParallelConfig", "ParallelConfig",
    "load_model_weights",
    # search (turbotrain/tune: harness, imported on first use)
    "tune",
    # guards while training
    "GuardConfig", "PrecisionDriftWarning",
    # errors
    "TurbotrainError", "ConfigError", "UnknownWorkloadError", "CheckpointError", "HardwareError",
    "DistributedError", "LossScaleError", "FusionError", "MetaInitError", "PrecisionDriftError",
]


def __getattr__(name):
    # turbotrain.tune is harness (it runs the bench workers), so `import turbotrain` must not load it;
    # the package is callable: turbotrain.tune(model_fn, optimizer_fn, batches, ...)
    if name == "tune":
        import importlib

        return importlib.import_module(".tune", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

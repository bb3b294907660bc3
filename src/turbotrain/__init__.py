"""turbotrain: faster, cheaper PyTorch training without changing its results.

>>> import turbotrain
>>> turbotrain.Config(precision="bf16-master").precision
'bf16-master'
"""

from .checkpoint import load_model_weights
from .comm.config import DataParallelConfig
from .config import Config
from .engine import Engine, StepStats
from .errors import (
    CheckpointError, ConfigError, DistributedError, FusionError, HardwareError, LossScaleError,
    TurbotrainError, UnknownWorkloadError,
)
from .precision.config import LossScaleConfig

__version__ = "0.1.0"

__all__ = [
    # training
    "Engine", "StepStats", "Config", "LossScaleConfig", "DataParallelConfig", "load_model_weights",
    # errors
    "TurbotrainError", "ConfigError", "UnknownWorkloadError", "CheckpointError", "HardwareError",
    "DistributedError", "LossScaleError", "FusionError",
]

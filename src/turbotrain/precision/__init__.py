"""Mixed precision: FP32 master weights, bounded dynamic loss scaling, an FP32 keep-list, auto dtype."""

from .align import alignment_advice, warn_misaligned
from .config import PRECISIONS, LossScaleConfig
from .keep_fp32 import KeepFp32Mode
from .policy import Precision, find_head, resolve_precision
from .scaler import DynamicLossScaler, unscale_and_check_

__all__ = [
    # configuration
    "LossScaleConfig", "PRECISIONS", "resolve_precision",
    # the pieces an Engine uses
    "Precision", "DynamicLossScaler", "KeepFp32Mode", "unscale_and_check_",
    # advice
    "alignment_advice", "warn_misaligned", "find_head",
]

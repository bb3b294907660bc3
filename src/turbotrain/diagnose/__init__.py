"""Numerical diagnostics: where inf/NaN first appears, and which layers low precision hurts."""

from .audit import AuditReport, AuditRow, precision_audit, sqnr_db
from .causes import CAUSES
from .inject import INJECTIONS, inject_fault
from .nonfinite import NonFiniteReport, find_nonfinite, nonfinite_flag
from .stats import TensorStats

__all__ = [
    # NaN/inf origin
    "find_nonfinite",
    "nonfinite_flag",
    "NonFiniteReport",
    "CAUSES",
    "TensorStats",
    # precision audit
    "precision_audit",
    "AuditReport",
    "AuditRow",
    "sqnr_db",
    # demonstrations
    "inject_fault",
    "INJECTIONS",
]

"""Where a training step's time goes: op table, categories, MFU, trace, HTML, recommendations."""

from .advice import THRESHOLDS, Recommendation, recommend
from .categories import CATEGORIES, categorise, category_of_name
from .core import MFU_CONVENTIONS, OpRow, ProfileReport, profile
from .counting import OpCounter, StepCounts

__all__ = [
    # profiling
    "profile",
    "ProfileReport",
    "OpRow",
    "MFU_CONVENTIONS",
    # categories and advice
    "CATEGORIES",
    "category_of_name",
    "categorise",
    "recommend",
    "Recommendation",
    "THRESHOLDS",
    # counting
    "OpCounter",
    "StepCounts",
]

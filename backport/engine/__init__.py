"""The backport engine: place a pack's patches on a tree, decide per fix,
commit the series crash-safe, and detect fixes in a tree."""

from .apply import apply_series, recover_checkout
from .detect import Detection, detect
from .report import ApplyReport, HunkResult, PatchResult

__all__ = [
    "ApplyReport",
    "Detection",
    "HunkResult",
    "PatchResult",
    "apply_series",
    "detect",
    "recover_checkout",
]

"""Shipping a patched tree: the patched wheel (`wheel.py`) and the patch series (`series.py`),
both read from the tree's git history (`lineage.py`)."""

from backport.export.lineage import Lineage, read_lineage
from backport.export.series import write_series
from backport.export.wheel import ExportedWheel, build_wheel

__all__ = ["ExportedWheel", "Lineage", "build_wheel", "read_lineage", "write_series"]

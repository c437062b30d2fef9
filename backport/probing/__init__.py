"""Probing: the CPU probe environment and the harness runner (one subprocess per tree).

The probes themselves (`probes/`) run inside the probe environment and never import this package.
"""

from backport.probing.env import ensure_env
from backport.probing.harness import run_harness
from backport.probing.matrix import run_matrix

__all__ = ["ensure_env", "run_harness", "run_matrix"]

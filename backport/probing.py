"""Run the probe harness on one tree, in a subprocess whose only SGLang is that tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from functools import cache as memoize
from pathlib import Path

from backport.errors import BadInput, Finding
from backport.probeenv import PROBES_DIR, SHIMS


@memoize
def needs_torchvision_stand_in(python: str) -> bool:
    """True when the interpreter has no torchvision (SGLang imports it at module level)."""
    check = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torchvision') else 1)"
    return subprocess.run([python, "-c", check], capture_output=True, check=False).returncode != 0


def probe_environ(python: str, package_root: Path, probes_parent: Path) -> dict[str, str]:
    paths = [str(probes_parent)]
    if needs_torchvision_stand_in(python):
        paths.append(str(SHIMS))
    paths.append(str(package_root))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1")
    return env


def run_harness(python: str, package_root: Path, probes: list[str] | None = None,
                label: str | None = None) -> dict:
    """Run every probe on one tree; returns the harness's JSON document."""
    package_root = Path(package_root).resolve()
    if not (package_root / "sglang" / "__init__.py").is_file():
        raise BadInput(f"{package_root}: not an SGLang package root (no sglang/__init__.py)")
    print(f"probing {label or package_root} ...", file=sys.stderr, flush=True)
    # Put only the `probes` package on the path (through a link), never the directory it sits in,
    # which may be a site-packages with another SGLang.
    with tempfile.TemporaryDirectory(prefix="sglang-backport-probes-") as tmp:
        (Path(tmp) / "probes").symlink_to(PROBES_DIR, target_is_directory=True)
        cmd = [python, "-m", "probes.harness", "--tree", str(package_root)]
        for name in probes or []:
            cmd += ["--probe", name]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              env=probe_environ(python, package_root, Path(tmp)), cwd=tmp)
    try:
        document = json.loads(proc.stdout)
    except json.JSONDecodeError:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise Finding(f"probe harness on {package_root} exited {proc.returncode} without a JSON result:\n{tail}")
    if proc.returncode == 2:
        raise BadInput(f"{package_root}: {document.get('error', 'the probe harness refused the tree')}")
    return document

"""Run the probe harness on one tree, in a subprocess whose only SGLang is that tree."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from functools import cache as memoize
from pathlib import Path

from backport.errors import BadInput, Finding
from backport.probing.env import PROBES_DIR, SHIMS
from backport.probing.supervise import Heartbeat, supervise

log = logging.getLogger("backport.probing")
LAUNCHER = PROBES_DIR / "runtime" / "launch.py"


# Packages some releases import at module level that a CPU environment cannot have; each has a
# named stand-in in probes/standins/shims/<name>/ (every function in it raises when called).
STAND_INS = ("torchvision", "sgl_kernel", "vllm", "decord", "mori")
_FIND = ("import importlib.util, sys; print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n) "
         "is None))")


@memoize
def missing_packages(python: str) -> tuple[str, ...]:
    """The stand-in packages this interpreter lacks (a real one is never shadowed)."""
    proc = subprocess.run([python, "-c", _FIND, *STAND_INS], capture_output=True, text=True, check=False)
    return tuple(proc.stdout.split()) if proc.returncode == 0 else STAND_INS


def probe_environ(python: str, package_root: Path | None, first: Path | None = None) -> dict[str, str]:
    """The environment of a probe interpreter: `first` (a folder of the caller's own, e.g. upstream
    tests' scratch path), the stand-ins this interpreter needs, then the tree (None: the matrix adds
    each tree itself). The probe package is not on the path: `launch` registers it from its folder."""
    paths = [str(first)] if first is not None else []
    paths += [str(SHIMS / name) for name in missing_packages(python)]
    if package_root is not None:
        paths.append(str(package_root))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1")
    return env


def launch(python: str, entry: str) -> list[str]:
    """The command that runs one entry of the probe runtime (harness, matrix) in `python`:
    `probes/runtime/launch.py`, which registers the probe package from its own folder (a checkout's or
    an installed wheel's), so that neither that folder's parent nor a link to it is ever on the path."""
    return [python, str(LAUNCHER), entry]


def scrub_package_path(text: str) -> str:
    """A probe document names the probe package's files as `probes/...` (tracebacks in case details),
    wherever the package lies on this machine."""
    return text.replace(str(PROBES_DIR), "probes")


def absolute_interpreter(python: str) -> str:
    """A relative interpreter path made absolute: probe runs happen in a temporary directory."""
    return os.path.abspath(python) if os.sep in python else python


def check_package_root(package_root: Path) -> Path:
    package_root = Path(package_root).resolve()
    if not (package_root / "sglang" / "__init__.py").is_file():
        raise BadInput(f"{package_root}: not an SGLang package root (no sglang/__init__.py)")
    return package_root


def read_document(text: str, stderr: str, returncode: int, package_root: Path) -> dict:
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        tail = "\n".join(stderr.strip().splitlines()[-8:])
        raise Finding(
            f"probe harness on {package_root} exited {returncode} without a JSON result:\n{tail}"
        ) from None
    if returncode == 2:
        raise BadInput(f"{package_root}: {document.get('error', 'the probe harness refused the tree')}")
    return document


def run_harness(python: str, package_root: Path, probes: list[str] | None = None,
                label: str | None = None, version: str | None = None) -> dict:
    """Run every probe on one tree; returns the harness's JSON document. `version`: the version the
    toolkit decided for the tree (its probes read it, not the tree's `sglang.version` fallback)."""
    package_root = check_package_root(package_root)
    log.info("probing %s ...", label or package_root)
    with tempfile.TemporaryDirectory(prefix="sglang-backport-probes-") as tmp:
        python = absolute_interpreter(python)
        cmd = [*launch(python, "harness"), "--tree", str(package_root)]
        for name in probes or []:
            cmd += ["--probe", name]
        if version and version != "unknown":
            cmd += ["--version", version]
        what = label or str(package_root)
        beat = Heartbeat(log.info, lambda seconds: f"      probing {what}: still running, {seconds:.0f} s")
        code = supervise(cmd, env=probe_environ(python, package_root), cwd=tmp,
                         stdout=Path(tmp) / "out.json", stderr=Path(tmp) / "err.log", tick=beat)
        stdout = scrub_package_path((Path(tmp) / "out.json").read_text(errors="replace"))
        stderr = (Path(tmp) / "err.log").read_text(errors="replace")
    return read_document(stdout, stderr, code, package_root)

"""The CPU probe environment: a cached virtualenv that imports SGLang's modules without a GPU.

Built once per requirements set (keyed by the sha256 of `probes/requirements-cpu.txt` and the
interpreter version) and reused. torch is held to the CPU wheel by a constraint on every
install, or pip would replace it with a CUDA build of several GB.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

from backport import cache, resources
from backport.errors import BadInput

log = logging.getLogger("backport.probing")
PROBES_DIR = resources.probes_dir()
REQUIREMENTS = PROBES_DIR / "requirements-cpu.txt"
SHIMS = PROBES_DIR / "shims"


def _torch_pin(requirements: str) -> str:
    for line in requirements.splitlines():
        if line.strip().startswith("torch=="):
            return line.strip()
    raise BadInput(f"{REQUIREMENTS}: no torch== pin (the CPU build must be pinned)")


def env_key() -> str:
    text = REQUIREMENTS.read_bytes() + f"{sys.version_info.major}.{sys.version_info.minor}".encode()
    return hashlib.sha256(text).hexdigest()[:16]


def env_dir() -> Path:
    return cache.cache_root() / "envs" / f"probe-{env_key()}"


def env_python(path: Path) -> Path:
    return path / "bin" / "python"


def ensure_env(python: str | None = None, *, quiet: bool = False) -> Path:
    """The interpreter probes run in: `python` if given, else the cached environment (built on first use)."""
    chosen = python or os.environ.get("SGLANG_BACKPORT_PROBE_PYTHON")
    if chosen:
        exe = Path(chosen)
        if not os.access(exe, os.X_OK):
            raise BadInput(f"{chosen}: not an executable Python interpreter")
        return exe
    final = env_dir()
    if (final / "READY").is_file():
        return env_python(final)
    say = (lambda *_: None) if quiet else log.warning
    requirements = REQUIREMENTS.read_text()
    started = time.monotonic()

    def build(staged: Path) -> None:
        say(f"building the CPU probe environment in {final} (one time, about 2-3 minutes) ...")
        venv.EnvBuilder(with_pip=True).create(staged)
        constraint = staged / "constraints.txt"
        constraint.write_text(_torch_pin(requirements) + "\n")
        cmd = [str(env_python(staged)), "-m", "pip", "install", "--disable-pip-version-check",
               "--progress-bar", "off", "-c", str(constraint), "-r", str(REQUIREMENTS)]
        say("  pip install -r probes/requirements-cpu.txt (torch pinned to the CPU wheel) ...")
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise BadInput(f"{REQUIREMENTS}: probe environment install failed:\n{tail}")
        (staged / "READY").write_text(requirements)
        say(f"  probe environment ready in {time.monotonic() - started:.0f} s")

    # A venv records its own path in scripts, not in bin/python or site-packages; probes only ever
    # run `bin/python -m ...`, so building under a staging name and renaming is safe.
    cache.build_entry(final, build)
    return env_python(final)

"""The CPU probe environment: a cached virtualenv that imports SGLang's modules without a GPU.

Built once per requirements set (keyed by the sha256 of `probes/requirements-cpu.txt` and the
interpreter version) and reused. torch is held to the CPU wheel by a constraint on every
install, or pip would replace it with a CUDA build of several GB.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import venv
from pathlib import Path

from backport import cache, resources
from backport.errors import BadInput
from backport.probing.supervise import stop_group

log = logging.getLogger("backport.probing")
PROBES_DIR = resources.probes_dir()
REQUIREMENTS = PROBES_DIR / "requirements-cpu.txt"
SHIMS = PROBES_DIR / "standins" / "shims"


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


PROGRESS_SECONDS = 10   # the longest an environment build stays silent


def _pip_install(python: Path, constraint: Path, requirements: Path) -> list[str]:
    return [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off",
            "-c", str(constraint), "-r", str(requirements)]


def _run_step(cmd: list[str], tmpdir: Path, what: str, say, started: float) -> None:
    """Run one build command with its temporary files in `tmpdir` (inside the staging entry, so they
    go with it on every exit path), a line of progress at least every PROGRESS_SECONDS, and the
    command's whole process group ended when this one is interrupted or fails."""
    tmpdir.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmpdir), "PIP_NO_INPUT": "1"}
    lines: collections.deque[str] = collections.deque(maxlen=20)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    out = proc.stdout
    assert out is not None  # stdout=PIPE
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip() for line in out), daemon=True)
    reader.start()
    try:
        while True:
            try:
                proc.wait(timeout=PROGRESS_SECONDS)
                break
            except subprocess.TimeoutExpired:
                last = next((line.strip() for line in reversed(lines) if line.strip()), "starting")
                say(f"  probe environment: {what}, {time.monotonic() - started:.0f} s: {last[:120]}")
    finally:
        if proc.poll() is None:
            stop_group(proc, grace=5)  # pip may be mid-write: give it a moment
        reader.join(timeout=2)
    if proc.returncode != 0:
        tail = "\n".join(list(lines)[-5:])
        raise BadInput(f"{REQUIREMENTS}: probe environment {what} failed (exit {proc.returncode}):\n{tail}")


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
    cache.clean_stale_staging(final.parent)  # a killed build's leftovers, pip's temporary files with them

    def build(staged: Path) -> None:
        say(f"building the CPU probe environment in {final} (one time, about 3-6 minutes) ...")
        venv.EnvBuilder(with_pip=False).create(staged)
        tmpdir = staged / "tmp"    # TMPDIR of every step: pip's temporary directories die with the entry
        _run_step([str(env_python(staged)), "-m", "ensurepip", "--upgrade", "--default-pip"], tmpdir,
                  "ensurepip", say, started)
        constraint = staged / "constraints.txt"
        constraint.write_text(_torch_pin(requirements) + "\n")
        say("  pip install -r probes/requirements-cpu.txt (torch pinned to the CPU wheel) ...")
        _run_step(
            _pip_install(env_python(staged), constraint, REQUIREMENTS), tmpdir, "pip install", say, started
        )
        shutil.rmtree(tmpdir, ignore_errors=True)
        (staged / "READY").write_text(requirements)
        say(f"  probe environment ready in {time.monotonic() - started:.0f} s")

    # A venv records its own path in scripts, not in bin/python or site-packages; probes only ever
    # run `bin/python -m ...`, so building under a staging name and renaming is safe.
    cache.build_entry(final, build)
    return env_python(final)

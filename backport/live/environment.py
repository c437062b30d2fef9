"""The serving environment of the live tier: the probe environment plus a small overlay, and the router.

One interpreter serves the pinned releases, as it probes them (per release range through setups.py;
the pairs served so far are listed in docs/live-tier.md): the CPU
probe environment (torch 2.13 CPU, the pinned SGLang dependency set), with the tree, the stand-ins
of probes/standins/shims (and, per release range, those of setups.py) and an overlay folder on PYTHONPATH.
The overlay holds what `launch_server` needs beyond the probe set (`requirements-serve.txt`:
Mooncake, the HTTP and grammar extras, torchao), installed with `--no-deps` so it can never
replace a probe pin. The router `smg` is a Rust binary in its own
virtual environment (`requirements-router.txt`). Both are content-addressed cache entries, built
once. Mooncake's engine needs Debian's `libibverbs1`: checked here, installed by `.ci/run`.
"""

from __future__ import annotations

import ctypes.util
import hashlib
import logging
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

from backport import cache
from backport.errors import BadInput
from backport.probing.env import SHIMS, ensure_env

log = logging.getLogger("backport.live")
HERE = Path(__file__).resolve().parent
SERVE_REQUIREMENTS = HERE / "requirements-serve.txt"
ROUTER_REQUIREMENTS = HERE / "requirements-router.txt"
STAND_INS = ("torchvision", "sgl_kernel")  # probes/standins/shims: their real wheels need CUDA


@dataclass(frozen=True)
class ServingEnv:
    python: Path        # the probe interpreter
    overlay: Path       # extra packages for launch_server
    router: Path        # the smg executable

    def pythonpath(self, package_root: Path, extras: list[str] | tuple[str, ...] = ()) -> str:
        """Stand-ins first (the probes' and a serving setup's `extras`), then the overlay, then the
        tree: the tree is the only SGLang on the path."""
        paths = [str(SHIMS / name) for name in STAND_INS] + [*extras, str(self.overlay), str(package_root)]
        return ":".join(paths)


def _key(*parts: bytes) -> str:
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _pip(python: Path, args: list[str], what: Path) -> None:
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off",
           "-q", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise BadInput(f"{what}: install failed:\n{tail}")


def check_libibverbs() -> None:
    if ctypes.util.find_library("ibverbs") is None:
        raise BadInput("libibverbs.so.1 not found: Mooncake's transfer engine needs Debian's libibverbs1 "
                       "(apt-get install -y libibverbs1)")


def ensure_overlay(python: Path) -> Path:
    requirements = SERVE_REQUIREMENTS.read_bytes()
    final = cache.cache_root() / "envs" / f"serve-{_key(requirements, str(python).encode())}"
    if (final / "READY").is_file():
        return final

    def build(staged: Path) -> None:
        log.warning("building the serving overlay in %s (one time, about a minute) ...", final)
        _pip(
            python, ["--no-deps", "--target", str(staged), "-r", str(SERVE_REQUIREMENTS)], SERVE_REQUIREMENTS
        )
        (staged / "READY").write_bytes(requirements)

    cache.build_entry(final, build)
    return final


def ensure_router() -> Path:
    requirements = ROUTER_REQUIREMENTS.read_bytes()
    version = f"{sys.version_info.major}.{sys.version_info.minor}".encode()
    final = cache.cache_root() / "envs" / f"router-{_key(requirements, version)}"
    if not (final / "READY").is_file():
        def build(staged: Path) -> None:
            log.warning("building the router environment in %s (one time) ...", final)
            venv.EnvBuilder(with_pip=True).create(staged)
            _pip(staged / "bin" / "python", ["-r", str(ROUTER_REQUIREMENTS)], ROUTER_REQUIREMENTS)
            (staged / "READY").write_bytes(requirements)

        cache.build_entry(final, build)
    return final / "bin" / "smg"


def ensure_serving_env(python: str | None = None) -> ServingEnv:
    check_libibverbs()
    interpreter = ensure_env(python)
    overlay = ensure_overlay(interpreter)
    return ServingEnv(python=interpreter, overlay=overlay, router=ensure_router())


def router_command(env: ServingEnv) -> list[str]:
    """How to start smg: its venv's interpreter on the wrapper (the wrapper's shebang may name the
    staging folder the venv was built in)."""
    return [str(env.router.parent / "python"), str(env.router)]

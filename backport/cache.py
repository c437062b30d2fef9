"""The content-addressed cache: wheels, materialised trees, probe environments.

Every entry is built under a temporary name inside the cache and renamed into place
when complete, so a crash or a failed verification never leaves a half-written
entry, and two processes building the same entry both succeed with one result.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    explicit = os.environ.get("SGLANG_BACKPORT_CACHE")
    if explicit:
        return Path(explicit).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return (Path(base) / "sglang-backport").resolve()


def staging_dir(final: Path) -> Path:
    """A fresh directory beside `final` (same filesystem, so the rename is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))


def publish_dir(staged: Path, final: Path) -> bool:
    """Rename a completed staging directory into place. False when another process won the race."""
    try:
        os.rename(staged, final)
        return True
    except OSError:
        if final.exists():
            shutil.rmtree(staged, ignore_errors=True)
            return False
        raise


def build_entry(final: Path, build: Callable[[Path], None]) -> bool:
    """Build a directory entry atomically. Returns True when this call created it."""
    staged = staging_dir(final)
    try:
        build(staged)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return publish_dir(staged, final)


def write_file_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, document: object) -> None:
    write_file_atomic(path, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode())

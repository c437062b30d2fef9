"""The content-addressed cache: wheels, materialised trees, probe environments, work clones.

Every entry is built under a temporary name inside the cache and renamed into place when
complete, so a crash or a failed verification never leaves a half-written entry, and two
processes building the same entry both succeed with one result. A staging directory's name
carries the pid that builds it: the next run removes those whose builder is gone (a killed
fetch leaves no 130 MB directory behind for long). Work clones (`apply SPEC` without `--out`)
live under `work/` until `sglang-backport gc` removes them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

STAGING_SUFFIX = ".partial"


def cache_root() -> Path:
    explicit = os.environ.get("SGLANG_BACKPORT_CACHE")
    if explicit:
        return Path(explicit).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return (Path(base) / "sglang-backport").resolve()


def work_root() -> Path:
    """Work clones and the live tier's temporary folders; made here, since on a fresh cache nothing
    else makes it before a caller creates a temporary directory in it."""
    root = cache_root() / "work"
    root.mkdir(parents=True, exist_ok=True)
    return root


def staging_dir(final: Path) -> Path:
    """A fresh directory beside `final` (same filesystem, so the rename is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.", suffix=STAGING_SUFFIX,
                                 dir=final.parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_staging(directory: Path) -> list[Path]:
    """Staging leftovers in `directory` whose building process no longer runs."""
    stale: list[Path] = []
    if not directory.is_dir():
        return stale
    for path in directory.iterdir():
        if not (path.name.startswith(".") and path.name.endswith(STAGING_SUFFIX)):
            continue
        parts = path.name.split(".")
        pid = next((int(p) for p in parts if p.isdigit()), None)
        if pid is None or not _alive(pid):
            stale.append(path)
    return stale


def clean_stale_staging(directory: Path) -> list[Path]:
    """Remove the staging leftovers of dead processes (directories and half-written files)."""
    removed = stale_staging(directory)
    for path in removed:
        if path.is_dir():
            discard_dir(path)
        else:
            path.unlink(missing_ok=True)
    return removed


def discard_dir(path: Path) -> None:
    """Remove a directory so that nobody sees it half-removed: rename it aside first."""
    if not path.exists():
        return
    aside = path.with_name(f".{path.name}.{os.getpid()}.discard{STAGING_SUFFIX}")
    try:
        os.rename(path, aside)
    except OSError:
        aside = path
    from backport.job.progress import heartbeat  # here: the job imports the cache

    with heartbeat(f"removing {path}"):  # a 2 GB probe environment takes minutes on a slow disk
        shutil.rmtree(aside, ignore_errors=True)


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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=STAGING_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, document: object) -> None:
    write_file_atomic(path, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode())


def _installed_snapshot(entry: Path) -> bool:
    """A tree entry snapshotted from an interpreter's installed sglang (`status installed`, `run
    installed`)."""
    try:
        return json.loads((entry / "target.json").read_text()).get("spec") == "installed"
    except (OSError, ValueError, AttributeError):
        return False


def gc(*, older_than_days: float, now: float | None = None) -> dict:
    """Remove work clones and snapshots of installed packages older than the given age, and every
    staging leftover of a dead process (a killed probe environment build's, pip's temporary files
    included). A snapshot of an installed package is taken again on the next use; no bundle needs
    it (a bundle holds digests, and verify reads only the bundle)."""
    root = cache_root()
    now = time.time() if now is None else now
    removed: list[str] = []
    for directory in (root / "trees", root / "wheels", root / "envs", work_root()):
        removed += [str(path) for path in clean_stale_staging(directory)]
    work = work_root()
    if work.is_dir():
        for path in sorted(work.iterdir()):
            if path.name.startswith("."):
                continue
            if now - path.stat().st_mtime >= older_than_days * 86400:
                discard_dir(path)
                removed.append(str(path))
    trees = root / "trees"
    if trees.is_dir():
        for path in sorted(trees.glob("path-*")):
            if _installed_snapshot(path) and now - path.stat().st_mtime >= older_than_days * 86400:
                discard_dir(path)
                removed.append(str(path))
    return {"cache": str(root), "removed": removed}

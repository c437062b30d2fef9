"""What a killed apply leaves in ``.git`` beyond the work tree, and how recovery tells its own
leftovers from a user's.

Two kinds, both named in the journal before they exist (journal.py):

- the pack's temporary files (``objects/pack/tmp_pack_sglang-backport-<token>``, ``tmp_idx_...``:
  the token is the journal's, drawn when it is created) and the pack itself once its name is known
  (``pack-<id>.pack``/``.idx``, recorded only when this run creates it). Rolled back, nothing points
  at the pack's objects, so it goes too; rolled forward, HEAD holds its commits and it stays.
- the ref locks ``git update-ref`` takes for the commit point: ``HEAD.lock`` and the branch's
  ``refs/heads/<name>.lock``. A SIGKILL of the group while git holds them leaves both, and every
  later ``update-ref`` fails on them. A lock at a recorded path is this run's only when it was made
  after the journal named it, holds nothing or this run's target commit (git writes the new id
  into the branch lock, nothing into ``HEAD.lock``), and is still there, unchanged, a second after
  it was made (a live git holds a ref lock for milliseconds). Any other lock is a concurrent or
  crashed git's: never removed; ``foreign_locks`` names it so that apply refuses in one line.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from ..gitops import objects_dir

TEMP_PREFIX = "sglang-backport-"
LOCK_SETTLE = 1.0  # seconds: older than this, a ref lock is no live git's
CLOCK_SLACK = 2.0  # seconds: file systems with coarse timestamps


def pack_temp(pack_dir: Path, ext: str, token: str) -> Path:
    """The temporary file a pack (``ext`` "pack" or "idx") is written to; git's gc knows ``tmp_``."""
    return pack_dir / f"tmp_{ext}_{TEMP_PREFIX}{token}"


def common_dir(git_dir: Path) -> Path:
    return objects_dir(git_dir).parent


def ref_locks(git_dir: Path) -> list[Path]:
    """The locks ``update-ref`` takes to move HEAD: HEAD's own, and its branch's when it is on one."""
    locks = [git_dir / "HEAD.lock"]
    try:
        head = (git_dir / "HEAD").read_text(encoding="utf-8").strip()
    except OSError:
        return locks
    if head.startswith("ref: refs/"):
        locks.append(common_dir(git_dir) / f"{head[5:]}.lock")
    return locks


def foreign_locks(git_dir: Path) -> list[Path]:
    """Ref locks present now; after recovery none of them is this toolkit's."""
    return [lock for lock in ref_locks(git_dir) if os.path.lexists(lock)]


def _is_ours(lock: Path, since: float, target: str | None) -> bool:
    try:
        st = lock.lstat()
        data = lock.read_bytes() if lock.is_file() and not lock.is_symlink() else None
    except OSError:
        return False
    if data not in (b"", f"{target}\n".encode()) or st.st_mtime < since - CLOCK_SLACK:
        return False
    young = LOCK_SETTLE - (time.time() - st.st_mtime)
    if young > 0:  # a live git renames or removes its lock within milliseconds: wait, look again
        time.sleep(min(young, LOCK_SETTLE))
        try:
            again = lock.lstat()
        except OSError:
            return False
        return (again.st_ino, again.st_mtime_ns, again.st_size) == (st.st_ino, st.st_mtime_ns, st.st_size)
    return True


def clear(git_dir: Path, *, token: str, pack: str | None, locks: list[str], locks_at: float,
          target: str | None, forward: bool) -> list[str]:
    """Remove this run's leftovers (see the module docstring); the names removed."""
    pack_dir = objects_dir(git_dir) / "pack"
    doomed = [pack_temp(pack_dir, ext, token) for ext in ("pack", "idx")] if token else []
    if pack and not forward:
        doomed += [
            pack_dir / f"{pack}.{ext}" for ext in ("idx", "pack")
        ]  # the index first: git reads through it
    doomed += [lock for lock in map(Path, locks) if _is_ours(lock, locks_at, target)]
    removed = []
    for path in doomed:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    return removed

"""The gits that change a repository's index and refs in the engine's write window.

Both are plumbing fed on stdin: ``update-index --stdin`` builds the next index beside the index
(a second name of it: git renames its lock over that name, never writing through), and
``update-ref --stdin`` moves HEAD and the pending ref in one transaction. Each can start ahead of
its moment (``IndexUpdate``, ``RefUpdate``) so its start overlaps the caller's file writes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from .. import gitops

UPDATE_INDEX_ARGS = ("update-index", "--add", "--remove", "-z", "--stdin")  # paths NUL-separated on stdin


def update_index(root: Path, paths: Iterable[str], index_file: Path) -> None:
    """Record the work tree's files at ``paths`` (with stat info; removed when
    gone) in the index file ``index_file``, not the repository's own index."""
    gitops.run(root, *UPDATE_INDEX_ARGS, input=gitops.z_paths(paths), env={"GIT_INDEX_FILE": str(index_file)})


def index_twin(source: Path, index_file: Path) -> None:
    """``index_file`` becomes a second name of the index ``source`` for git to build the next index
    in: a hard link, which costs nothing to make (git never writes an index in place: it writes
    ``<name>.lock`` and renames it over the name, so ``source`` keeps its bytes); a copy where the
    file system has no hard links. A name left by an earlier run is replaced, never written through."""
    index_file.unlink(missing_ok=True)
    try:
        os.link(source, index_file)
    except OSError:
        shutil.copyfile(source, index_file)


def swap_index(index_file: Path, target: Path) -> None:
    """Rename the built index over ``target``. Where git had nothing to write, the name is still a
    link to ``target``'s own file, which rename leaves in place (both names, one file): it goes."""
    os.replace(index_file, target)
    index_file.unlink(missing_ok=True)


class _FedGit:
    """A git started ahead of its moment and fed on stdin (IndexUpdate, RefUpdate): its start
    overlaps the caller's writes. The caller holds SIGINT/SIGTERM/SIGHUP in this window, but a
    signal sent to the process group (Ctrl-C, a supervisor's killpg) also reaches this git: ``_end``
    says when it died of one, and the caller then does the work once more, so the held signal still
    loses nothing."""

    def __init__(self, root: Path, args: Sequence[str], env: Mapping[str, str] | None = None):
        self.args = args
        self.p = subprocess.Popen(
            gitops.command(root, args),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )

    def _end(self, data: bytes | None = None) -> bool:
        """Close its input (after ``data``) and wait; True when a signal killed it, GitError when it
        failed."""
        _, err = self.p.communicate(data)  # a stdin already broken is closed quietly
        if self.p.returncode < 0:
            return True
        if self.p.returncode != 0:
            raise gitops.GitError(f"git {self.args[0]} failed: {err.decode(errors='replace').strip()}")
        return False

    def reap(self) -> None:
        """Stop it when the caller gives up before the end (nothing it would write was written)."""
        if self.p.returncode is None:
            self.p.kill()
            self.p.communicate()


class IndexUpdate(_FedGit):
    """``update_index`` fed a path at a time: git starts and reads the index copy while the caller
    is still writing the files, and records each path as soon as it is given (``--stdin`` reads
    one path, records it, reads the next); the copy is written at ``finish``. Killed by a group
    signal, ``finish`` records the paths again on a fresh copy of ``source``."""

    def __init__(self, root: Path, source: Path, index_file: Path):
        self.root, self.source, self.index_file = root, source, index_file
        index_twin(source, index_file)
        self.paths: list[str] = []
        super().__init__(root, UPDATE_INDEX_ARGS, env={**os.environ, "GIT_INDEX_FILE": str(index_file)})

    def add(self, path: str) -> None:
        self.paths.append(path)
        try:
            self.p.stdin.write(gitops.z_paths([path]))  # type: ignore[union-attr]
            self.p.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, ValueError):
            pass  # it died: finish() says how and starts again

    def finish(self) -> None:
        if self._end():  # once more, in full
            Path(f"{self.index_file}.lock").unlink(missing_ok=True)
            index_twin(self.source, self.index_file)
            update_index(self.root, self.paths, self.index_file)


RefUpdates = Sequence[
    tuple[str, str | None, str | None]
]  # (ref, new id or None to delete, expected old id or None)


def _ref_lines(updates: RefUpdates) -> bytes:
    lines = []
    for ref, new, old in updates:
        if new is None:
            lines.append(f"delete {ref}" + (f" {old}" if old else ""))
        else:
            lines.append(f"update {ref} {new}" + (f" {old}" if old else ""))
    return ("\n".join(lines) + "\n").encode()


def move_refs(root: Path, message: str, updates: RefUpdates) -> None:
    """One atomic ref transaction."""
    gitops.run(root, "update-ref", "-m", message, "--stdin", input=_ref_lines(updates))


class RefUpdate(_FedGit):
    """``move_refs`` started ahead of its moment: git starts (exec, config, the ref store) while the
    caller is still writing, and ``commit`` then costs a pipe write and git's lock, write and rename.
    ``update-ref --stdin`` queues the lines it reads and locks nothing before the end of its input,
    so a git stopped before ``commit`` leaves no lock behind. Killed by a group signal, ``commit``
    runs the transaction once more, unless it had already gone through."""

    def __init__(self, root: Path, message: str):
        self.root, self.message = root, message
        super().__init__(root, ("update-ref", "-m", message, "--stdin"))

    def commit(self, updates: RefUpdates) -> None:
        if self._end(_ref_lines(updates)) and any(
            gitops.read_ref(self.root, ref) != new for ref, new, _ in updates
        ):
            move_refs(self.root, self.message, updates)


def delete_ref(root: Path, ref: str) -> None:
    gitops.run(root, "update-ref", "-d", ref)

"""Every git process the toolkit starts is started here (``run``, ``Background``, ``command``).

The engine talks to git through plumbing only (ls-files, diff-index, cat-file here;
update-index and update-ref, which change the repository, in engine/index_refs.py)
and parses its ``-z`` / batch output. It hashes in
process (``object_id``): a file's blob id, to check that a file on disk is
exactly its committed blob without a process, and the objects of a series
(engine/objects.py writes them as one pack; it replaced ``git fast-import``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO

from .errors import BadInput

REGULAR_MODES = ("100644", "100755")


class GitError(RuntimeError):
    """A git command failed (its stderr is in the message)."""


def command(root: Path, args: Sequence[str]) -> list[str]:
    return ["git", "-C", str(root), *args]


def run(root: Path, *args: str, input: bytes | None = None, env: Mapping[str, str] | None = None) -> bytes:
    """Run git in ``root``; its stdout, or GitError."""
    p = subprocess.run(command(root, args), input=input, capture_output=True, check=False,
                       env=None if env is None else {**os.environ, **env})
    if p.returncode != 0:
        raise GitError(f"git {' '.join(args[:2])} failed: {p.stderr.decode(errors='replace').strip()}")
    return p.stdout


class Background:
    """A git command running while the caller works (the engine overlaps its
    few git processes: they are most of its cost). Its input is all there before
    it starts, so starting never blocks."""

    def __init__(self, root: Path, *args: str, input: bytes | None = None):
        self.args = args
        stdin = _ready_input(input)
        try:
            self.p = subprocess.Popen(
                command(root, args), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        finally:
            if isinstance(stdin, int):
                if stdin >= 0:
                    os.close(stdin)
            else:
                stdin.close()
        self.out: bytes | None = None

    def result(self) -> bytes:
        if self.out is None:
            out, err = self.p.communicate()
            if self.p.returncode != 0:
                raise GitError(
                    f"git {' '.join(self.args[:2])} failed: {err.decode(errors='replace').strip()}"
                )
            self.out = out
        return self.out

    def reap(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.communicate()


def _ready_input(input: bytes | None) -> int | IO[bytes]:
    """A child's stdin already holding all of ``input``: DEVNULL, the read end of a pipe written
    without blocking (no file is made), or, when the pipe cannot take it all, a temporary file."""
    if input is None:
        return subprocess.DEVNULL
    r, w = os.pipe()
    try:
        os.set_blocking(w, False)
        try:
            whole = os.write(w, input) == len(input)
        except BlockingIOError:
            whole = False
    finally:
        os.close(w)
    if whole:
        return r
    os.close(r)
    f = tempfile.TemporaryFile()  # noqa: SIM115 - closed right after Popen
    f.write(input)
    f.seek(0)
    return f


def z_paths(paths: Iterable[str]) -> bytes:
    return "".join(p + "\0" for p in paths).encode("utf-8", "surrogateescape")


def _decode(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


# ----------------------------------------------------------------- reading


def work_tree(root: Path) -> tuple[Path, str | None]:
    """(git dir, HEAD's commit id or None before the first commit) of the git
    work tree whose root is ``root``; BadInput for anything else. Reads
    files only (gitpython), no process."""
    import git

    try:
        repo = git.Repo(root)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise BadInput(f"{root}: not a git repository") from None
    try:
        if (
            repo.bare
            or repo.working_tree_dir is None
            or Path(repo.working_tree_dir).resolve() != root.resolve()
        ):
            raise BadInput(f"{root}: not the root of a git work tree")
        return Path(repo.git_dir), _deref(repo, "HEAD")
    finally:
        repo.close()


def read_ref(root: Path, ref: str) -> str | None:
    """The object id a ref (or HEAD) points to, None when it does not exist; no process."""
    import git

    repo = git.Repo(root)
    try:
        return _deref(repo, ref)
    finally:
        repo.close()


def _deref(repo, ref: str) -> str | None:
    from git.refs.symbolic import SymbolicReference

    try:  # loose or packed ref files, followed through symbolic refs
        return SymbolicReference.dereference_recursive(repo, ref)
    except ValueError:
        return None


def staged_args(base: str) -> tuple[str, ...]:
    """``diff-index --cached`` of the index against ``base``: the staged and the unmerged paths
    (the index's cache tree makes it cheap; no work-tree file is read)."""
    return ("--no-optional-locks", "diff-index", "--cached", "-z", "--name-only", "--no-renames", base, "--")


def staged_paths(diff_index_out: bytes) -> set[str]:
    return {_decode(p) for p in diff_index_out.split(b"\0") if p}


def uncommitted_paths(root: Path, pathspec: str) -> set[str]:
    """Paths under `pathspec` that differ from HEAD, untracked files included (what a clone of
    HEAD would not carry)."""
    out = run(root, "--no-optional-locks", "status", "--porcelain=v1", "-z", "--untracked-files=all",
              "--", pathspec)
    return _status_paths(out)


def _status_paths(status_out: bytes) -> set[str]:
    """The paths of ``git status --porcelain=v1 -z`` (a rename or copy names both)."""
    parts = status_out.split(b"\0")
    paths: set[str] = set()
    i = 0
    while i < len(parts):
        e = parts[i]
        i += 1
        if len(e) < 4:
            continue
        paths.add(_decode(e[3:]))
        if (e[:1] in (b"R", b"C") or e[1:2] in (b"R", b"C")) and i < len(parts):
            paths.add(_decode(parts[i]))
            i += 1
    return paths


def flags_args(paths: Sequence[str]) -> tuple[str, ...]:
    return ("--no-optional-locks", "--literal-pathspecs", "ls-files", "-v", "-z", "--", *paths)


def flagged_paths(ls_files_out: bytes) -> dict[str, str]:
    """Paths whose index entry hides local changes from ``git status``:
    {path: "skip-worktree" | "assume-unchanged"}, from ``ls-files -v -z``
    (tag ``S``: skip-worktree; a lowercase tag: assume-unchanged)."""
    out: dict[str, str] = {}
    for entry in ls_files_out.split(b"\0"):
        if len(entry) < 3:
            continue
        tag, path = entry[:1], _decode(entry[2:])
        if tag in (b"S", b"s"):
            out[path] = "skip-worktree"
        elif tag.islower():
            out[path] = "assume-unchanged"
    return out


def object_id(kind: bytes, data: bytes) -> bytes:
    """The SHA-1 object id (20 bytes) git gives an object of this type (b"blob", b"tree", b"commit")."""
    return hashlib.sha1(b"%s %d\0" % (kind, len(data)) + data, usedforsecurity=False).digest()


def blob_id(data: bytes) -> str:
    """The object id git gives a file with these bytes (no filters), in hex."""
    return object_id(b"blob", data).hex()


def batch_args() -> tuple[str, ...]:
    # objects as stored, as the engine reads loose ones itself (git replace is a view, not history)
    return ("--no-replace-objects", "cat-file", "--batch")


def batch_input(specs: Sequence[str]) -> bytes:
    return "".join(s + "\n" for s in specs).encode("utf-8", "surrogateescape")


def batch_objects(out: bytes, specs: Sequence[str]) -> dict[str, tuple[str, bytes] | None]:
    """``cat-file --batch`` output for ``specs``: {spec: (type, content)}, None where git has no such
    object."""
    got: dict[str, tuple[str, bytes] | None] = {}
    pos = 0
    for spec in specs:
        eol = out.index(b"\n", pos)
        head = out[pos:eol].split()
        pos = eol + 1
        if len(head) == 3 and head[1] != b"missing":
            size = int(head[2])
            got[spec] = (head[1].decode(), out[pos:pos + size])
            pos += size + 1
        else:
            got[spec] = None
    return got


def read_blobs(root: Path, specs: Sequence[str]) -> dict[str, bytes | None]:
    """{spec: content} for ``rev:path`` specs (None: no such blob), one ``cat-file --batch``."""
    out = batch_objects(run(root, *batch_args(), input=batch_input(specs)), specs)
    return {spec: obj[1] if obj and obj[0] == "blob" else None for spec, obj in out.items()}


def objects_dir(git_dir: Path) -> Path:
    """Where the repository of ``git_dir`` keeps its objects (a linked work tree's are in the common dir)."""
    common = git_dir / "commondir"
    if common.is_file():
        return (git_dir / common.read_text().strip()).resolve() / "objects"
    return git_dir / "objects"


# ------------------------------------------------------------------ clones


def clone_work_tree(src: Path, dest: Path) -> Path:
    """A fresh clone of the git work tree ``src`` at ``dest`` (which must not
    exist or be empty), checked out at src's HEAD; returns dest resolved.
    Objects are hard-linked (they never change); the work tree files are new."""
    src, dest = Path(src), Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BadInput(f"{dest}: exists and is not an empty directory")
    existed = dest.exists()
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        run(dest.parent, "clone", "--quiet", "--local", "--", str(src.resolve()), str(dest))
    except GitError as e:
        # git keeps a clone whose checkout failed ("Clone succeeded, but checkout failed"):
        # the destination goes back to what it was (absent, or the empty directory given)
        if existed:
            for child in dest.iterdir():
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        else:
            shutil.rmtree(dest, ignore_errors=True)
        raise CloneFailed(f"{src}: cannot clone ({str(e).splitlines()[-1]})") from None
    return dest.resolve()


class CloneFailed(BadInput):
    """A clone of a work tree failed (a user's path: bad input; a cache entry: damaged, rebuilt)."""


# ------------------------------------------------------------------ blame


def blame_commits(root: Path, path: str, rev: str = "HEAD") -> list[str]:
    """The commit that last changed each line of `path` at `rev` (index 0 is line 1)."""
    out = run(root, "blame", "--porcelain", "--root", rev, "--", path).decode("utf-8", "replace")
    commits: list[str] = []
    for line in out.splitlines():
        head = line.split(" ")
        # a line header: "<40 hex> <orig line> <final line> [<group size>]"
        if len(head) in (3, 4) and len(head[0]) == 40 and all(c in "0123456789abcdef" for c in head[0]):
            final = int(head[2])
            commits.extend([""] * (final - len(commits)))
            commits[final - 1] = head[0]
    return commits


# ----------------------------------------------------------------- shipping


def commits_since(root: Path, base: str, rev: str = "HEAD") -> list[str]:
    """The commits after ``base`` up to ``rev``, oldest first (a patched tree's backport commits)."""
    return run(root, "rev-list", "--reverse", f"{base}..{rev}").decode().split()


def commit_message(root: Path, commit: str) -> str:
    return _decode(run(root, "show", "-s", "--format=%B", commit))


def format_patch(root: Path, base: str, out_dir: Path, rev: str = "HEAD") -> list[Path]:
    """``git format-patch`` of the commits after ``base``: one mbox file each, numbered, with
    the commit messages (trailers included). No signature line (it names the git version), so
    the same commits give the same bytes on every machine."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = run(root, "-c", "core.quotePath=false", "format-patch", "--no-signature", "--no-numbered",
              "--output-directory", str(out_dir.resolve()), f"{base}..{rev}")
    return [Path(line) for line in _decode(out).splitlines() if line]


# ------------------------------------------------------------------ refresh


def diff(root: Path, base: str, rev: str = "HEAD", package_prefix: str = "") -> str:
    """The unified diff (3 lines of context, ``a/``/``b/`` prefixes, paths relative to the
    package root) of ``sglang/`` between two commits, as a patch variant carries it. Options a
    user's git config could change (prefixes, renames, colour, algorithm) are pinned; ``.rej``
    files are left out."""
    args = ["-c", "core.quotePath=false", "diff", "--no-color", "--no-ext-diff", "--no-textconv",
            "--no-renames", "--diff-algorithm=myers", "-U3", "--src-prefix=a/", "--dst-prefix=b/"]
    if package_prefix:
        args.append(f"--relative={package_prefix}")
    args += [base, rev, "--", f"{package_prefix}sglang", ":(exclude,glob)**/*.rej"]
    return _decode(run(root, *args))
